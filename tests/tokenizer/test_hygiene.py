"""Input hygiene: invisible trouble removed, joiners kept, NFC, limits, errors that name the field."""

from __future__ import annotations

import pytest

from qwenserve.tokenizer import InvalidInput, clean_messages, clean_text, decode_utf8


def test_zero_width_space_bom_and_controls_are_stripped_but_tab_newline_cr_kept():
    dirty = "\ufeffa\u200bb\x00c\x07d\x1be\x7ff\x85g\x9fh\ti\nj\rk"
    assert clean_text(dirty) == "abcdefgh\ti\nj\rk"


def test_zero_width_joiner_and_non_joiner_are_kept():
    family = "👨\u200d👩\u200d👧"
    persian = "می\u200cخواهم"
    assert clean_text(family) == family
    assert clean_text(persian) == persian


def test_text_is_nfc_normalised():
    assert clean_text("cafe\u0301") == "café"
    assert clean_text("e\u200b\u0301") == "é"  # stripping first lets the accent compose


def test_text_over_the_byte_limit_is_refused_with_its_field():
    with pytest.raises(InvalidInput) as err:
        clean_text("你" * 400, field="messages[0].content", max_bytes=1000)
    assert err.value.field == "messages[0].content" and "1000 bytes" in err.value.message
    assert clean_text("你" * 333, max_bytes=1000) == "你" * 333


def test_lone_surrogates_and_invalid_utf8_are_refused():
    with pytest.raises(InvalidInput, match="surrogates"):
        clean_text("a\ud800b")
    with pytest.raises(InvalidInput, match=r"0xc3 at offset 1"):
        decode_utf8(b"a\xc3(")
    assert decode_utf8("ok ✓".encode()) == "ok ✓"


def test_messages_need_known_roles_and_are_cleaned():
    cleaned = clean_messages(
        [{"role": "user", "content": "hi\u200b"}, {"role": "assistant", "content": None}]
    )
    assert cleaned == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    with pytest.raises(InvalidInput) as err:
        clean_messages([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    assert err.value.field == "messages[1].role"
    with pytest.raises(InvalidInput, match="empty"):
        clean_messages([])
    with pytest.raises(InvalidInput, match="only assistant"):
        clean_messages([{"role": "user", "content": "a", "tool_calls": [{}]}])
