"""A tenant's streaming content filter: words and patterns that must never reach the client.

Checked on the detokenized text as it streams: the last `window` characters are held back (the length
of the longest possible match, less one), so a match that spans two deltas is caught before any of it
is sent. A match ends the answer there, with finish reason `content_filter`; the text before it is
sent. Words match whole and case-insensitively; patterns are Python regular expressions whose matches
have a bounded length (a pattern like `\\w+` could outgrow any window, so it is refused at load).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_ITEMS = 1000
MAX_MATCH_CHARS = 256  # the longest match a word or pattern may have: what a stream holds back at most


class ContentFilterError(ValueError):
    """A filter that cannot be used (a bad or unbounded pattern); the message says which."""


@dataclass(frozen=True)
class ContentFilter:
    """Compiled words and patterns, and how much text a stream must hold back for them."""

    words: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    window: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.words) + len(self.patterns) > MAX_ITEMS:
            raise ContentFilterError(f"a content filter holds at most {MAX_ITEMS} words and patterns")
        parts, longest = [], 0
        for word in self.words:
            if not word.strip() or len(word) > MAX_MATCH_CHARS:
                raise ContentFilterError(f"content filter word {word!r}: 1 to {MAX_MATCH_CHARS} characters")
            # Whole words: not inside a longer word (a boundary only where the word itself begins or ends one).
            start = r"(?<!\w)" if word[0].isalnum() or word[0] == "_" else ""
            end = r"(?!\w)" if word[-1].isalnum() or word[-1] == "_" else ""
            parts.append(f"{start}(?i:{re.escape(word)}){end}")
            longest = max(longest, len(word) + 1)  # + the character after it, which decides the boundary
        for pattern in self.patterns:
            try:
                width = re._parser.parse(pattern).getwidth()  # type: ignore[attr-defined]
                re.compile(pattern)
            except re.error as e:
                raise ContentFilterError(f"content filter pattern {pattern!r}: {e}") from None
            if width[1] > MAX_MATCH_CHARS:
                raise ContentFilterError(f"content filter pattern {pattern!r} can match more than {MAX_MATCH_CHARS} "
                                         "characters; bound its repetitions (\\w{1,20}, not \\w+)")
            if width[1] == 0:
                raise ContentFilterError(f"content filter pattern {pattern!r} matches only empty text")
            parts.append(f"(?:{pattern})")
            longest = max(longest, width[1] + 1)
        object.__setattr__(self, "regex", re.compile("|".join(parts)) if parts else re.compile(r"(?!)"))
        object.__setattr__(self, "window", longest)

    def __bool__(self) -> bool:
        return bool(self.words or self.patterns)

    def stream(self) -> FilteredText:
        return FilteredText(self)


def content_filter_from(raw: object, where: str) -> ContentFilter | None:
    """A tenant's `content_filter: {words: [...], patterns: [...]}` from the key file; None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"words", "patterns"}:
        raise ContentFilterError(f"{where}: expected {{words: [...], patterns: [...]}}")
    lists: list[tuple[str, ...]] = []
    for key in ("words", "patterns"):
        items = raw.get(key) or []
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ContentFilterError(f"{where}.{key}: expected a list of strings")
        lists.append(tuple(items))
    try:
        return ContentFilter(*lists) or None
    except ContentFilterError as e:
        raise ContentFilterError(f"{where}: {e}") from None


class FilteredText:
    """One answer's text through the filter: push deltas, get what is safe to send."""

    def __init__(self, rules: ContentFilter) -> None:
        self._rules = rules
        self._held = ""
        self._before = ""  # the text last sent: what word boundaries and lookbehinds at the held text's start see
        self.matched: str | None = None

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text safe to send now, whether a match ended the answer); `final` once the answer has ended."""
        if self.matched is not None:
            return "", True
        text = self._held + text
        found = self._rules.regex.search(self._before + text, len(self._before))
        at = len(self._before)
        if found is not None and (final or found.end() < at + len(text)):
            self.matched, self._held = found.group(0), ""
            return text[: found.start() - at], True
        # Nothing yet, or a match that ends where the text does (the next character may extend the word).
        keep = min(len(text), self._rules.window - 1)
        if found is not None:
            keep = max(keep, at + len(text) - found.start())
        if final:
            keep = 0
        sent, self._held = text[: len(text) - keep], text[len(text) - keep:]
        self._before = (self._before + sent)[-MAX_MATCH_CHARS:]
        return sent, False

    def finish(self) -> tuple[str, bool]:
        """The answer ended: what was held back, checked a last time."""
        return self.push("", final=True)
