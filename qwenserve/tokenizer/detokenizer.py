"""Incremental detokenization: token ids arrive one step at a time, text leaves without broken characters."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Protocol


class TokenBytes(Protocol):
    """What the detokenizer needs from a tokenizer: the bytes of each id, and which ids are special."""

    special_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals a full decode.

    A multi-byte UTF-8 character split across tokens is held back until its last byte arrives,
    so a delta never ends in half a character. Invalid byte sequences become U+FFFD exactly as in
    `Tokenizer.decode`. Not thread-safe: one instance per stream.
    """

    __slots__ = ("_decoder", "_skip", "_table")

    def __init__(self, tokenizer: TokenBytes, skip_special_tokens: bool = False) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._table = tokenizer.token_bytes

    def push(self, ids: Iterable[int]) -> str:
        """Add ids; return the text they complete (possibly empty while a character is incomplete)."""
        skip, table = self._skip, self._table
        data = b"".join(table(i) for i in ids if i not in skip)
        return self._decoder.decode(data) if data else ""

    def flush(self) -> str:
        """End the stream: return whatever is pending, an incomplete character as U+FFFD."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._decoder.getstate()[0])
