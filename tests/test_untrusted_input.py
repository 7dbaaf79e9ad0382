"""The one bounded reader of a client's JSON, and the one way an error quotes what a client sent."""

from __future__ import annotations

import time

import pytest

from qwenserve.rpc_errors import error_detail
from qwenserve.untrusted_input import (
    MAX_FIELD_CHARS,
    MAX_JSON_DEPTH,
    MAX_MESSAGE_CHARS,
    JsonRefused,
    bounded,
    check_json_value,
    echo,
    nests_deeper,
    read_json,
)


def nested(depth: int, inside: str = "1") -> str:
    return "[" * depth + inside + "]" * depth


def test_values_within_the_limits_are_read_as_json_reads_them() -> None:
    assert read_json('{"a": [1, {"b": "x"}], "c": null}', "f") == {"a": [1, {"b": "x"}], "c": None}
    assert read_json(nested(MAX_JSON_DEPTH), "f") is not None
    # A surrogate pair written as escapes is one character, not a lone surrogate.
    assert read_json('"\\ud83d\\ude00"', "f") == "😀"
    assert read_json(b'{"k": "\xc3\xa9"}', "f") == {"k": "é"}


def test_nesting_past_the_limit_is_refused_without_parsing_even_at_any_depth() -> None:
    with pytest.raises(JsonRefused) as refused:
        read_json(nested(MAX_JSON_DEPTH + 1), "guided_json")
    assert refused.value.field == "guided_json" and f"limit of {MAX_JSON_DEPTH} levels" in refused.value.message
    started = time.perf_counter()
    for text in (nested(100_000), '{"a":' * 100_000 + "1" + "}" * 100_000, "[" * 4_000_000):
        with pytest.raises(JsonRefused, match="nested too deeply"):
            read_json(text, "f", max_bytes=None)
    assert time.perf_counter() - started < 1.0


def test_brackets_inside_strings_are_text_not_nesting() -> None:
    text = '{"a": "[[[[{{{{\\"]]]]", "b": ["\\\\", "]"]}'
    assert not nests_deeper(text, 2) and nests_deeper(text, 1)
    assert read_json(text, "f", max_depth=2)["a"] == '[[[[{{{{"]]]]'
    assert not nests_deeper('"[[["', 0) and not nests_deeper("7", 0) and nests_deeper("[[]]", 1)


@pytest.mark.parametrize(
    ("text", "field"),
    [('"\\ud800"', "f"), ('{"a": ["x", "\\udfff"]}', "f.a[1]"), ('{"\\ud83d": 1}', "f"),
     ('["\\ud83d\\ud83d"]', "f[0]")],
)
def test_lone_surrogates_are_refused_naming_where_they_are(text: str, field: str) -> None:
    with pytest.raises(JsonRefused) as refused:
        read_json(text, "f")
    assert refused.value.field == field and "surrogate" in refused.value.message


def test_size_encoding_and_non_json_numbers_are_refused() -> None:
    with pytest.raises(JsonRefused, match="limit of 10"):
        read_json('"' + "x" * 20 + '"', "f", max_bytes=10)
    with pytest.raises(JsonRefused, match="limit of 10"):
        read_json('"ééééé"', "f", max_bytes=10)  # 7 characters, 12 UTF-8 bytes
    with pytest.raises(JsonRefused, match="UTF-8"):
        read_json(b'"\xff"', "f")
    for text in ("NaN", "[Infinity]", "{nope", ""):
        with pytest.raises(JsonRefused, match="not valid JSON"):
            read_json(text, "f")


def test_a_parsed_value_is_checked_iteratively_at_any_depth() -> None:
    value: object = "leaf"
    for _ in range(100_000):  # deeper than Python's recursion limit
        value = [value]
    with pytest.raises(JsonRefused, match="nested too deeply"):
        check_json_value(value, "tools[0]")
    check_json_value({"a": [{"b": "ok"}]}, "f", max_depth=3)
    with pytest.raises(JsonRefused) as refused:
        check_json_value({"a": [{"b": "\udc80"}]}, "f")
    assert refused.value.field == "f.a[0].b"
    # A megabyte-long key is cut short in the path; a long array is walked without a path per element.
    started = time.perf_counter()
    with pytest.raises(JsonRefused) as refused:
        check_json_value({"k" * (1 << 20): ["x"] * 1_000_000 + ["\ud800"]}, "f")
    assert time.perf_counter() - started < 1.0
    assert len(refused.value.field) <= MAX_FIELD_CHARS and refused.value.field.endswith("...[1000000]")


def test_echo_and_bounded_keep_what_a_client_sent_short() -> None:
    assert echo("qwen") == "'qwen'"
    huge = "m" * 1_000_000
    shown = echo(huge)
    assert len(shown) < 100 and "1000000 characters" in shown
    assert len(echo(list(range(100_000)))) <= 66
    assert bounded("short", 10) == "short" and bounded("x" * 50, 10) == "xxxxxxx..."


def test_every_error_detail_is_bounded_whatever_built_it() -> None:
    detail = error_detail("invalid_request", "bad: " + "x" * 1_000_000, field="a." + "k" * 1_000_000)
    assert len(detail.message) <= MAX_MESSAGE_CHARS and len(detail.field) <= MAX_FIELD_CHARS
    assert detail.message.startswith("bad: x") and detail.message.endswith("...")
