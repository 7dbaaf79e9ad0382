"""Typed reads of an OpenAI request body's fields: each checks one JSON value and raises InvalidRequest
naming the parameter at fault (it becomes the error's `param`)."""

from __future__ import annotations

import json
import math
from typing import Any

from qwenserve.router.errors import InvalidRequest
from qwenserve.untrusted_input import MAX_BODY_DEPTH, MAX_JSON_DEPTH, JsonRefused, check_json_value, read_json

UINT32_MAX = 2**32 - 1


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; a 400 that says what is wrong otherwise."""
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object", "body")
    try:
        # Its size was bounded as it was read. Its strings are checked where each field is read
        # (checked_text, checked_json), which names the parameter at fault.
        body = read_json(raw, "body", max_depth=MAX_BODY_DEPTH, max_bytes=None, check_strings=False)
    except JsonRefused as e:
        raise InvalidRequest(f"the request body {e.reason}", "body") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type_name(body)}", "body")
    return body


def is_token_id(value: Any) -> bool:
    """An int that is not a bool (JSON true is not token 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def stop_strings(stop: Any) -> list[str]:
    """`stop`: absent, one string or an array of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [checked_text(stop, "stop")]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [checked_text(s, "stop") for s in stop]
    raise InvalidRequest("stop must be a string or an array of strings", "stop")


def first_max_tokens(body: dict[str, Any], names: tuple[str, ...], default: int | None) -> int | None:
    """The first of `names` that is set (max_completion_tokens wins over the deprecated max_tokens)."""
    for name in names:
        value = optional(body, name, int, None)
        if value is not None:
            if not 1 <= value <= UINT32_MAX:
                raise InvalidRequest(f"{name} must be >= 1", name)
            return value
    return default


def optional(body: dict[str, Any], name: str, kind: type, default: Any, prefix: str = "") -> Any:
    """body[name] if present and not null, checked to be of `kind` (bool is not an int here)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 2.0 from a client that only has floats
    if not ok:
        raise InvalidRequest(f"{prefix}{name} must be {kind_name(kind)}, got {type_name(value)}", prefix + name)
    return value


def optional_number(body: dict[str, Any], name: str) -> float | None:
    """body[name] as a float if present and not null: a finite number of at most a million in size."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{name} must be a number, got {type_name(value)}", name)
    # abs() first: an integer of hundreds of digits is valid JSON that float() (and isfinite) cannot take.
    if abs(value) > 1e6 or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number of reasonable size", name)
    return float(value)


def checked_text(value: str, where: str) -> str:
    """Strings go into protobuf, which refuses lone surrogates ("\\ud800" is valid JSON)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(f"{where} contains invalid Unicode (a lone surrogate)", where) from e
    return value


def checked_json(value: Any, where: str) -> str:
    """Free-form JSON passed on as text: nesting bounded (MAX_JSON_DEPTH), every string (keys too) valid Unicode.

    json.dumps would escape a lone surrogate as "\\ud800", and the tokenizer service would then
    fail on it after parsing it back; so it is refused here, naming the field.
    """
    try:
        check_json_value(value, where, max_depth=MAX_JSON_DEPTH)
    except JsonRefused as e:
        raise InvalidRequest(e.message, e.field) from None
    return json.dumps(value)


def read_json_field(text: str, where: str) -> Any:
    """A field whose value is JSON text (guided_json as a string): read by the bounded reader."""
    try:
        return read_json(text, where, max_depth=MAX_JSON_DEPTH)
    except JsonRefused as e:
        raise InvalidRequest(e.message, e.field) from None


def kind_name(kind: type) -> str:
    """A Python type as an error message names its JSON kind: "an integer", "a string"..."""
    return {bool: "a boolean", int: "an integer", str: "a string", dict: "an object", list: "an array"}.get(
        kind, kind.__name__
    )


def type_name(value: Any) -> str:
    """What a JSON value is, as an error message says it: "null", "a number", "an object"..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", dict: "an object", list: "an array"}.get(type(value), type(value).__name__)
