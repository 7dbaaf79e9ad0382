"""A Qwen3 chat answer's thinking, split from its content as the text streams in.

Qwen3 writes `<think>\\nreasoning\\n</think>\\n\\n` before its answer. The text arrives a token's worth at
a time and a tag can be cut anywhere, so text that could be the start of a tag (or whitespace that may
end up trimmed) is held back until the next piece decides. Thinking-only variants, and templates that
open the block in the prompt, leave the opening tag out: a request whose prompt ends inside an open
block starts in reasoning. An answer cut off inside the block (max_tokens) is all reasoning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

THINK_START, THINK_END = "<think>", "</think>"


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (what to hold back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def thinking_open_in_prompt(prompt_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """Whether the prompt opens a thinking block it does not close (the model continues inside it)."""
    for token in reversed(prompt_ids):
        if token == end_id:
            return False
        if token == start_id:
            return True
    return False


def thinking_closed_in_prompt(prompt_ids: Sequence[int], end_id: int, text_of: Callable[[Sequence[int]], str]) -> bool:
    """Whether the prompt ends with a closed thinking block (a template's way to turn thinking off: Qwen3's
    "<think>\n\n</think>\n\n"): nothing but whitespace after its last end tag."""
    tail = 0
    for token in reversed(prompt_ids):
        if token == end_id:
            return not text_of(prompt_ids[len(prompt_ids) - tail:]).strip()
        tail += 1
        if tail > 8:  # more than whitespace follows
            return False
    return False


class ReasoningSplitter:
    """Text pieces in, (reasoning, content) pieces out."""

    def __init__(self, open_in_prompt: bool = False) -> None:
        # "start": nothing but whitespace yet (a <think> may come); "reasoning"; "content".
        self._state = "reasoning" if open_in_prompt else "start"
        self._held = ""
        self._trim = open_in_prompt  # whitespace right after a tag is layout, not text
        self.opened = open_in_prompt  # the answer has (or began in) a thinking block

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` completes."""
        return self._advance(self._held + text)

    def flush(self) -> tuple[str, str]:
        """What is held back, once the answer has ended."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", "" if self._trim else held

    def _advance(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        self._held = ""
        while True:
            if self._state == "start":
                rest = text.lstrip()
                if rest.startswith(THINK_START):
                    self._state, self._trim, text = "reasoning", True, rest[len(THINK_START):]
                    self.opened = True
                    continue
                if THINK_START.startswith(rest):  # whitespace, or a tag still arriving
                    self._held = text
                    break
                self._state = "content"
                continue
            if self._trim:
                text = text.lstrip()
                if not text:
                    break
                self._trim = False
            if self._state == "content":
                content.append(text)
                break
            end = text.find(THINK_END)
            if end >= 0:
                reasoning.append(text[:end].rstrip())
                self._state, self._trim, text = "content", True, text[end + len(THINK_END):]
                continue
            keep = partial_tag(text, THINK_END)
            body = text[: len(text) - keep]
            kept = body.rstrip()  # trailing whitespace waits: it is dropped if the tag follows
            reasoning.append(kept)
            self._held = text[len(kept):]
            break
        return "".join(reasoning), "".join(content)
