"""Per-request sampling settings, validated once at the edge and then trusted by the engine.

Checks that need the model (stop ids below the vocabulary size) are the engine's, at intake."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qwenserve.engine.structured import ReasoningFirst, StructuredOutput

#: More stop ids than any real use needs; bounds the per-step masking work a single request can ask for.
MAX_STOP_TOKEN_IDS = 1024
#: A top_k above the vocabulary size keeps every token; the cap keeps it inside the sampler's integer tensors.
MAX_TOP_K = 2**31 - 1


class InvalidSamplingParams(ValueError):
    """A sampling setting is out of range; `field` names it for the client's error."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next tokens of one request are chosen.

    temperature 0 means greedy. `seed` makes sampling reproducible whatever else runs in the batch:
    the random draw for output position i depends only on (seed, i), so a request resumed after a
    failover continues with the same tokens. `max_tokens` None means up to the context length.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: bool = False
    top_logprobs: int = 0
    # Log-probabilities of the prompt's own tokens, with this many alternatives each; None: not computed.
    # The whole prompt is then computed, so such a request never takes prefix-cache hits.
    prompt_logprobs: int | None = None
    # Every token must keep the answer inside this grammar (a JSON schema, a regex, ...); None: free text.
    structured: StructuredOutput | None = None
    # With `structured`: the reasoning block a thinking model writes first is not constrained.
    reasoning_first: ReasoningFirst | None = None

    def __post_init__(self) -> None:
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in floats:
            # NaN fails every range check below by accident; inf passes some of them (temperature, penalties).
            if not math.isfinite(getattr(self, name)):
                raise InvalidSamplingParams(name, "must be a finite number")
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", 0 <= self.top_k <= MAX_TOP_K, f"must be in [0, {MAX_TOP_K}] (0 disables)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "must be in [0, 2^64)"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} ids"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "token ids must be >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidSamplingParams(name, why)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams("min_tokens", "must not exceed max_tokens")
        if self.structured is not None and (self.min_tokens or self.ignore_eos):
            # The grammar decides where the answer ends: forcing it on past that end has no valid token.
            raise InvalidSamplingParams("min_tokens" if self.min_tokens else "ignore_eos",
                                        "cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logits_read(self) -> int:
        """How many of the raw logits' largest its next token depends on, 0 where it reads them all: 1 greedy, top_k
        sampling with a top_k (its top_p and min_p are taken within those), and nothing that moves or reports logits
        (penalties, min_tokens masking, logprobs, a grammar). The LM head may then be screened (screened_head.py)."""
        if (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens or self.logprobs or self.top_logprobs or self.structured is not None):
            return 0
        return 1 if self.temperature == 0.0 else self.top_k
