"""Prompts that are real text of an exact token length, so tokenization and prefix caching behave as
they do in production (random token ids would neither round-trip through text nor share prefixes the
way real system prompts do).

Text comes from a small built-in corpus, shuffled per request; the length is made exact by tokenizing,
trimming or extending the token window, and decoding again until `encode(text)` has the requested count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from qwenserve.loadgen.workload import RequestSpec
from qwenserve.tokenizer import Tokenizer

# Written for this load generator; mixed topics and a little Chinese and code, like chat traffic.
CORPUS = (
    "A serving system is judged by the slowest answer its busiest minute produces, not by its average.",
    "The cache keeps the keys and values of every token it has seen, so the next token costs one row, not a whole prompt.",
    "When the queue grows faster than the batch drains, the first token of every new request arrives later and later.",
    "Please summarise the attached quarterly report in three bullet points and flag any number that changed by more than ten percent.",
    "Translate the following paragraph into plain English, keeping the technical terms as they are.",
    "The river rose overnight; by morning the footbridge was under water and the ferry ran every twenty minutes.",
    "She wrote the test first, watched it fail for the right reason, and only then changed a single line of the scheduler.",
    "Explain why a hash chain over fixed-size blocks lets two requests with the same system prompt share memory.",
    "def percentile(values, q):\n    ordered = sorted(values)\n    return ordered[int(q / 100 * (len(ordered) - 1))]\n",
    "Customer: my order arrived with the wrong colour. Assistant: I am sorry about that; could you share the order number?",
    "请分析这份财报中净利润的变化趋势，并说明主要原因。",
    "如果突发流量超过了批处理的容量，排队时间就会迅速上升，首个词元的延迟也随之变长。",
    "The committee met on Tuesday and agreed to postpone the vote until the budget figures were checked again.",
    "Write a short poem about a lighthouse keeper who counts ships instead of sheep.",
    "In a disaggregated deployment the prompt is computed on one machine and the generation continues on another.",
    "SELECT region, SUM(tokens) FROM usage WHERE day = CURRENT_DATE GROUP BY region ORDER BY 2 DESC;",
    "Rate limits count tokens, not requests, because one long document costs as much as a hundred greetings.",
    "The recipe needs two cups of flour, a pinch of salt, warm water and patience while the dough rests.",
    "Our latency target is a first token within half a second for nine requests out of ten during the evening peak.",
    "He opened the map, traced the old railway line with a finger, and decided to walk the last ten kilometres.",
    "Given the log lines below, find the request that timed out and explain which service it was waiting on.",
    "A good benchmark states its hardware, its model, its traffic and its failures, and never only its best run.",
    "Photosynthesis turns light, water and carbon dioxide into sugar, releasing oxygen as a by-product.",
    "The function returns early when the list is empty, which is why the caller never sees a division by zero.",
)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's text and the token ids the server's tokenizer makes of it (len == the requested count)."""

    text: str
    token_ids: list[int]


class PromptFactory:
    """Makes prompts of exact token lengths from the corpus; shared prefixes are made once per prefix id."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self._prefixes: dict[int, Prompt] = {}

    def _raw_text(self, approx_tokens: int) -> str:
        """Shuffled corpus sentences until roughly `approx_tokens` tokens (about 4 characters each)."""
        parts: list[str] = []
        chars = 0
        while chars < approx_tokens * 5 + 32:
            sentence = self.rng.choice(CORPUS)
            parts.append(sentence)
            chars += len(sentence) + 1
        return " ".join(parts)

    def text_of_length(self, n: int, lead: str = "") -> Prompt:
        """Text whose tokens are exactly `lead`'s tokens followed by n more (lead is kept verbatim)."""
        if n < 1:
            raise ValueError(f"a prompt needs at least one token, asked for {n}")
        lead_ids = self.tokenizer.encode(lead) if lead else []
        target = len(lead_ids) + n
        # A random start inside the first sentence: two prompts rarely share even their first KV block.
        pool = self.tokenizer.encode(self._raw_text(n))[self.rng.randrange(8):]
        take = n
        best: Prompt | None = None
        for _ in range(12):
            while take > len(pool):
                pool += self.tokenizer.encode(" " + self._raw_text(n))
            text = lead + self.tokenizer.decode(pool[:take])
            ids = self.tokenizer.encode(text)
            if len(ids) == target:
                return Prompt(text, ids)
            if best is None or abs(len(best.token_ids) - target) > abs(len(ids) - target):
                best = Prompt(text, ids)
            take = max(1, take + (target - len(ids)))
        # Rare: a boundary that keeps merging. Fall back to the ids themselves, decoded once.
        assert best is not None
        ids = (best.token_ids + pool)[:target]
        return Prompt(self.tokenizer.decode(ids), ids)

    def for_spec(self, spec: RequestSpec) -> Prompt:
        """The prompt of one request: a shared prefix (when the spec has one) then text of its own."""
        if spec.prefix_len <= 0:
            return self.text_of_length(spec.prompt_len)
        # Keyed by group only: every request of a group shares the very same system prompt, sized by the
        # first request of the group.
        prefix = self._prefixes.get(spec.prefix_id)
        if prefix is None:
            # A system prompt ends in a newline, so the user's text starts a fresh token.
            prefix = self.text_of_length(max(1, spec.prefix_len - 1), lead="")
            prefix = Prompt(prefix.text + "\n", self.tokenizer.encode(prefix.text + "\n"))
            self._prefixes[spec.prefix_id] = prefix
        return self.text_of_length(max(1, spec.prompt_len - len(prefix.token_ids)), lead=prefix.text)
