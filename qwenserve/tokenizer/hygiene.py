"""Input hygiene: what user text looks like before it is tokenized, and what is refused.

Pure functions. Text is NFC-normalised and stripped of invisible characters that only cause
trouble (zero-width space, byte-order mark, C0/C1 control characters other than tab, newline and
carriage return). The zero-width joiner and non-joiner (U+200D, U+200C) are kept: emoji sequences
and scripts such as Persian and the Indic ones need them.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from qwenserve.tokenizer.errors import InvalidInput
from qwenserve.untrusted_input import JsonRefused, read_json

# Every character hygiene deletes: C0 controls but tab, newline and CR; DEL and C1; ZWSP; BOM.
# (A regex scan is cheaper than str.translate on text with nothing to strip, the usual case: it copies nothing.)
_STRIPPED = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\ufeff]")

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class InputLimits:
    """Size limits on what one request may carry."""

    max_text_bytes: int = 1 << 20  # one text, or one message's content, in UTF-8 bytes
    max_total_bytes: int = 8 << 20  # all texts of one request together (characters for chats)
    max_messages: int = 1024
    max_batch: int = 4096  # texts in one TokenizeBatch / CountTokens call
    max_tools: int = 128


def clean_text(text: str, field: str = "text", max_bytes: int = InputLimits.max_text_bytes) -> str:
    """Return `text` stripped of zero-width spaces, BOMs and control characters, then NFC-normalised.

    Raises InvalidInput when the text is larger than `max_bytes` UTF-8 bytes.
    """
    # A character is at most 4 UTF-8 bytes: only long texts need the exact (copying) count.
    if len(text) * 4 > max_bytes and len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise InvalidInput(
            field, f"is larger than the limit of {max_bytes} bytes; split it or raise the limit"
        )
    if _has_surrogates(text):
        raise InvalidInput(field, "contains lone UTF-16 surrogates, which are not valid Unicode text")
    cleaned = _STRIPPED.sub("", text) if _STRIPPED.search(text) else text
    if not unicodedata.is_normalized("NFC", cleaned):
        cleaned = unicodedata.normalize("NFC", cleaned)
    return cleaned


def _has_surrogates(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def decode_utf8(data: bytes, field: str = "text_bytes") -> str:
    """Decode bytes that must be UTF-8, naming the first bad byte when they are not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidInput(
            field, f"is not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}: {err.reason})"
        ) from None


def parse_json_object(raw: str, field: str) -> dict[str, Any]:
    """Parse a JSON text that must hold one object, with the bounded reader every JSON input goes through
    (size, nesting, no lone surrogates): the template renders it recursively."""
    try:
        value = read_json(raw, field)
    except JsonRefused as err:
        raise InvalidInput(err.field, err.reason) from None
    if not isinstance(value, dict):
        raise InvalidInput(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def clean_messages(
    messages: list[dict[str, Any]], limits: InputLimits = InputLimits()
) -> list[dict[str, Any]]:
    """Validate a conversation and apply `clean_text` to every text field; returns new message dicts.

    Each message has a `role` (system, user, assistant or tool) and `content`; optional `name`,
    `tool_call_id`, `tool_calls` (list of objects) and `reasoning_content`.
    """
    if not messages:
        raise InvalidInput("messages", "is empty; send at least one message")
    if len(messages) > limits.max_messages:
        raise InvalidInput(
            "messages", f"has {len(messages)} messages, more than the limit of {limits.max_messages}"
        )
    cleaned: list[dict[str, Any]] = []
    total = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidInput(f"{where}.role", f"is {role!r}; expected one of {', '.join(CHAT_ROLES)}")
        out: dict[str, Any] = {"role": role}
        for key in ("content", "name", "tool_call_id", "reasoning_content"):
            value = message.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise InvalidInput(f"{where}.{key}", f"must be a string, got {type(value).__name__}")
            out[key] = clean_text(value, f"{where}.{key}", limits.max_text_bytes)
            total += len(out[key])
        if "content" not in out:
            out["content"] = ""
        tool_calls = message.get("tool_calls")
        if tool_calls:
            if role != "assistant":
                raise InvalidInput(
                    f"{where}.tool_calls", f"only assistant messages carry tool calls, not {role}"
                )
            if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
                raise InvalidInput(f"{where}.tool_calls", "must be a list of JSON objects")
            out["tool_calls"] = tool_calls
        if total > limits.max_total_bytes:
            raise InvalidInput(
                "messages", f"hold more than {limits.max_total_bytes} characters of text, the limit"
            )
        cleaned.append(out)
    return cleaned
