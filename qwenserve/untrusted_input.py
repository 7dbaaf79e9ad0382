"""Untrusted input read within bounds, and echoed back within bounds.

One JSON reader for everything a client sends as JSON: the HTTP body and every gRPC field that carries JSON
text (`chat.tools_json`, `chat.chat_template_kwargs_json`, a message's `tool_calls_json`, a JSON schema).
It refuses, naming the field and the limit, before anything recurses on the value: text larger than its
limit, nesting deeper than its limit (counted on the text, so "[[[[..." is refused without parsing it),
NaN / Infinity (not JSON), and lone UTF-16 surrogates ("\\ud800" is valid JSON syntax, but not text that
protobuf, the tokenizer or a grammar compiler can hold).

`echo` is the one way an error message quotes what the client sent: truncated, so an error built from a
megabyte-long model name stays small (gRPC carries the message in trailing metadata, which has a size limit).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

# Nesting allowed in one JSON value a client passes on (a tool, a schema, template variables): the stages
# parse it again and templates and grammar compilers recurse once per level.
MAX_JSON_DEPTH = 32
# Nesting of a whole HTTP body: room for its own levels (tools[i].function.parameters...) around a value nested
# somewhat deeper than MAX_JSON_DEPTH, so such a value is refused naming its own parameter.
MAX_BODY_DEPTH = 2 * MAX_JSON_DEPTH
# One JSON field's text (a tool, a schema), as one text's limit in the tokenizer.
MAX_JSON_FIELD_BYTES = 1 << 20
# What an error message and its field path may carry: gRPC sends both in trailing metadata.
MAX_ECHO_CHARS = 64
MAX_MESSAGE_CHARS = 1024
MAX_FIELD_CHARS = 256

_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_NESTING_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# The escape of a UTF-16 surrogate: the only way parsed JSON text can hold one (protobuf strings and UTF-8
# bytes cannot), so only text with such an escape needs its strings checked after parsing.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonRefused(ValueError):
    """A client's JSON that is not read: `field` names it, `message` says which limit or rule it broke."""

    def __init__(self, field: str, reason: str) -> None:
        field = bounded(field, MAX_FIELD_CHARS)
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason  # what is wrong, without the field: "is nested too deeply: ..."
        self.message = f"{field} {reason}"


def read_json(
    text: str | bytes, field: str, *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int | None = MAX_JSON_FIELD_BYTES,
    check_strings: bool = True,
) -> Any:
    """The JSON value of `text` (bytes must be UTF-8), or JsonRefused naming `field` and what is wrong.

    `check_strings=False` leaves lone surrogates to the caller, which checks each string where it reads it
    (and can name that field better than a path into the text).
    """
    if max_bytes is not None and len(text) > max_bytes:  # characters first: cheap, and a lower bound on bytes
        raise JsonRefused(field, f"is {len(text)} bytes or more, more than the limit of {max_bytes}")
    if isinstance(text, bytes):
        try:  # JSON over the wire is UTF-8 (RFC 8259); json.loads(bytes) would guess UTF-16/32 instead
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonRefused(field, f"is not valid UTF-8: {e.reason} at byte {e.start}") from None
    if max_bytes is not None and not text.isascii() and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise JsonRefused(field, f"is more than the limit of {max_bytes} bytes")
    check_nesting(text, field, max_depth)
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:  # JSONDecodeError, and NaN / Infinity
        raise JsonRefused(field, f"is not valid JSON: {e}") from None
    except RecursionError:  # not reached below the depth limit; kept so no limit can turn this into a crash
        raise JsonRefused(field, f"is nested too deeply (the limit is {max_depth} levels)") from None
    if check_strings and _SURROGATE_ESCAPE.search(text):
        check_json_value(value, field, max_depth=max_depth)
    return value


def check_nesting(text: str, field: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """JsonRefused naming `field` when JSON text nests more than `max_depth` levels: the part of `read_json`
    that needs no parse, for text too large to parse where it enters (milliseconds for a megabyte)."""
    if nests_deeper(text, max_depth):
        raise JsonRefused(field, f"is nested too deeply: more than the limit of {max_depth} levels")


def nests_deeper(text: str, max_depth: int) -> bool:
    """Whether arrays and objects in JSON text nest more than `max_depth` levels, found without parsing it:
    strings are skipped (their brackets are text), then the brackets left are counted, stopping at the first
    level too deep (all in C: "[[[[..." of megabytes is answered at once). Malformed text gets some answer;
    the parser refuses it anyway."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    return any(map(max_depth.__lt__, accumulate(map(_NESTING_STEP.__getitem__, brackets))))


def check_json_value(value: Any, field: str, *, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A parsed JSON value passed on: nesting within `max_depth` and every string (keys too) valid Unicode.

    Raises JsonRefused naming the path at fault ("tools[0].function.name"). Iterative, so any depth is safe; a
    path is spelled out only for the error (a client's keys can be megabytes long, its arrays millions long).
    """
    if isinstance(value, str):
        _check_text(value, field, None)
    if not isinstance(value, dict | list):
        return
    pending: list[tuple[dict[str, Any] | list[Any], _Path, int]] = [(value, None, 1)]
    while pending:
        item, path, depth = pending.pop()
        if depth > max_depth:
            raise JsonRefused(field, f"is nested too deeply: more than the limit of {max_depth} levels")
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for key, inner in pairs:
            if isinstance(key, str):
                _check_text(key, field, path)  # a bad key is the fault of the object that holds it
            if isinstance(inner, str):
                _check_text(inner, field, (path, key))
            elif isinstance(inner, dict | list):
                pending.append((inner, (path, key), depth + 1))


# A place in a JSON value: None for the value itself, else (the container's place, a key or an index).
_Path = tuple[Any, str | int] | None


def _check_text(text: str, field: str, path: _Path) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise JsonRefused(_spelled(field, path), "contains invalid Unicode (a lone surrogate)") from None


def _spelled(field: str, path: _Path) -> str:
    """`field` and the path below it as a dotted path ("tools[0].function.name"), each key cut short."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else "." + bounded(key, MAX_ECHO_CHARS))
    return bounded(field + "".join(reversed(parts)), MAX_FIELD_CHARS)


def echo(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` quoted for an error message (as repr does), cut to about `limit` characters (a long string says
    its length): the one way an error repeats what a client sent."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return bounded(repr(value), limit + 2)


def bounded(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters (an ellipsis marks the cut): for error messages and field paths
    at the edges that send them, whatever built them."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")
