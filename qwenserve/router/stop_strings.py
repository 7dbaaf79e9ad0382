"""Stop strings over a stream of text deltas: emit only what can no longer become a stop string.

`TextRelay` puts incremental detokenization in front: token ids in, text deltas out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class StopCheck:
    """What to send now, and whether a stop string ended the text (it is never included)."""

    text: str
    stopped: bool
    matched: str | None = None


class StopStringMatcher:
    """Holds back the tail of the text that could still be the start of a stop string.

    A stop string may span several deltas, so the last `max(len(stop)) - 1` characters that match
    some stop string's prefix are withheld until the next delta settles them.
    """

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""
        self._done = False

    def push(self, delta: str) -> StopCheck:
        """Add newly decoded text; return the text now safe to emit."""
        if self._done:
            return StopCheck("", True)
        if not self._stops:
            return StopCheck(delta, False)
        text = self._pending + delta
        first: tuple[int, str] | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self._done = True
            self._pending = ""
            return StopCheck(text[: first[0]], True, first[1])
        hold = self._held_suffix(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return StopCheck(text[: len(text) - hold], False)

    def flush(self) -> str:
        """The stream ended without a stop string: release what was held back."""
        out, self._pending = ("" if self._done else self._pending), ""
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[len(text) - n :]):
                    best = n
                    break
        return best


class Detokenizer(Protocol):
    def push(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


class TextRelay:
    """Token ids to text deltas: incremental detokenization, then stop strings."""

    def __init__(self, detokenizer: Detokenizer, stops: StopStringMatcher) -> None:
        self._detok = detokenizer
        self._stops = stops

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        check = self._stops.push(self._detok.push(ids))
        return check.text, check.stopped

    def flush(self) -> str:
        check = self._stops.push(self._detok.flush())
        return check.text + ("" if check.stopped else self._stops.flush())
