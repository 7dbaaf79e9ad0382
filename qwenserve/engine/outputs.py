"""What the engine hands back: per-step request outputs and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of a generated token (from the model's raw distribution, before sampling
    transforms) and the `top_logprobs` most likely alternatives as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # 1 for the most likely token; 0 where it was not computed (sampled tokens)


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Token counts. completion_tokens includes tokens passed as `resume_token_ids`, so the last output of
    a resumed request reports the whole request; cached_prompt_tokens are prefix-cache hits."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One step's news for one request. Exactly one output per request has finished=True; its
    finish_reason is "stop", "length", "abort", "error" or "export"."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    usage: TokenCounts
    error: str | None = None
    # With the first token, when `prompt_logprobs` was asked for: one entry per prompt position after the
    # first (the first token has nothing before it to be predicted from).
    prompt_logprobs: list[TokenLogprob] | None = None
    # With finish_reason "error": True when the request itself was at fault (its grammar went past a bound), a
    # client's error (4xx) that says nothing of the worker's health; False for the engine's own failures.
    request_fault: bool = False


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load. prefix_cache_hit_rate = tokens hit / prompt tokens looked up."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_cached: int  # free blocks that still hold reusable prefix KV
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    preemptions: int
    finished: int = 0
    prefill_only_steps: int = 0  # short_first steps that left decodes out to drain a burst
    cpu_kernels: bool = False  # whether this engine runs the C kernels (engine/kernels.py chose them)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
