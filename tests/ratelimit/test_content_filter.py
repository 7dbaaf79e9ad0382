"""The streaming content filter: a match never reaches the client, however the text is cut; the rest does."""

from __future__ import annotations

import pytest

from qwenserve.tenancy.content_filter import ContentFilter, ContentFilterError, content_filter_from

RULES = ContentFilter(words=("secret sauce", "Kraken"), patterns=(r"\b\d{3}-\d{4}\b",))


def _through(rules: ContentFilter, pieces: list[str]) -> tuple[str, bool]:
    stream = rules.stream()
    sent, ended = "", False
    for piece in pieces:
        text, ended = stream.push(piece)
        sent += text
        if ended:
            return sent, True
    text, ended = stream.finish()
    return sent + text, ended


@pytest.mark.parametrize(("text", "sent", "filtered"), [
    ("The recipe uses a secret sauce, they say.", "The recipe uses a ", True),
    ("Release the KRAKEN now", "Release the ", True),
    ("Call 555-1234 today", "Call ", True),
    ("Krakens are plural, krakenish is not a word", "Krakens are plural, krakenish is not a word", False),
    ("secret saucepan", "secret saucepan", False),  # not the whole word
    ("ends with kraken", "ends with ", True),  # at the very end, decided when the answer ends
    ("nothing to see", "nothing to see", False),
])
def test_a_match_is_never_sent_wherever_the_stream_is_cut(text: str, sent: str, filtered: bool) -> None:
    for size in (1, 2, 3, 5, 8, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert _through(RULES, pieces) == (sent, filtered), size


def test_a_word_inside_a_longer_word_is_not_matched_across_a_cut() -> None:
    # "x" was sent long before "kraken" arrives: the boundary still sees it.
    assert _through(RULES, ["x" * 40, "kraken", " and more"]) == ("x" * 40 + "kraken and more", False)


def test_the_key_files_filter_and_its_refusals() -> None:
    rules = content_filter_from({"words": ["bad"], "patterns": [r"[0-9]{16}"]}, "tenants.acme.content_filter")
    assert rules is not None and rules.window == 17
    assert content_filter_from(None, "x") is None and content_filter_from({"words": []}, "x") is None
    with pytest.raises(ContentFilterError, match="bound its repetitions"):
        content_filter_from({"patterns": [r"\w+"]}, "tenants.acme.content_filter")
    with pytest.raises(ContentFilterError, match="tenants.acme.content_filter"):
        content_filter_from({"patterns": ["(unclosed"]}, "tenants.acme.content_filter")
    with pytest.raises(ContentFilterError, match="expected"):
        content_filter_from({"wordz": ["x"]}, "tenants.acme.content_filter")
