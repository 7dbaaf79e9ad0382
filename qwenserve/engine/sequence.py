"""One request as the engine tracks it: its tokens, how many have KV, and the blocks holding that KV."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from qwenserve.engine.kv_handoff import KVExportSink, KVImport
from qwenserve.engine.outputs import RequestOutput, TokenCounts, TokenLogprob
from qwenserve.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """A request in flight. `token_ids` is prompt + output; each step computes KV for
    token_ids[num_computed_tokens : num_computed_tokens + n] and, once all of them have KV, samples the next.
    Preemption resets num_computed_tokens and frees the blocks; the tokens are kept and recomputed."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # output budget, resume tokens included
    emit: Callable[[RequestOutput], None]
    cache_salt: str | None = None
    kv_import: KVImport | None = None
    kv_export: KVExportSink | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks registered so far
    state_slot: int | None = None  # hybrid models: its linear-attention state's slot (state_pool.py) while running
    restore_state: bytes | None = None  # hybrid models: the snapshot its slot is loaded from at admission
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (reported in usage)
    admitted_once: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower is served first (vLLM's convention); a tenant's tier
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # position p+1's, at index p
    prompt_logprobs_sent: bool = False
    grammar: Any = None  # the structured-output matcher (llguidance), fed every output token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions are still without their logprobs (each needs its position computed here)."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def usage(self) -> TokenCounts:
        return TokenCounts(self.prompt_len, self.num_output_tokens, self.num_cached_tokens)

    def take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs, once, with the first token (a resumed or preempted request computes none again)."""
        if self.sampling.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs
