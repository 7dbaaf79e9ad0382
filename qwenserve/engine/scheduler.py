"""Which sequences run in the next step, and how many tokens each computes.

Every step has a token budget (max_num_batched_tokens) shared by decodes (one token each) and prefill
chunks, so a long prompt is computed a chunk at a time and never stalls decoding for more than one step. A step
with no decodes in it makes nobody wait: its budget is max_prefill_only_tokens (larger chunks re-read the weights
fewer times).

Admission reserves KV blocks for the sequence's whole known length (prompt, or prompt + output after a
preemption) minus what the prefix cache already holds; decoding then allocates one block at a time. When
a running sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed (its full blocks usually survive in
the prefix cache, so recomputation is cheap).

A hybrid model's sequence also holds a slot of the state pool (its linear-attention layers' state) from admission
until it finishes or is preempted; nothing is admitted while no slot is free. A preempted sequence's state is
dropped with its blocks: it recomputes from its first token. With prefix caching, a hybrid model's prefill chunks
end at every snapshot boundary, whose state is kept (state_snapshots.py), and a prefix hit counts only up to the
last boundary whose snapshot is kept: the sequence's slot is restored from it.

Admission policies (the order of the waiting queue is admission_policy.py's; each keeps priorities and
lets nothing starve):
- "fcfs": decodes, then in-flight prefill chunks, then new requests in arrival order.
- "watermark": as fcfs, but a request whose cost scores above the sliding watermark of recent requests
  waits while cheaper ones do.
- "short_first" (default): decodes, then waiting requests whose whole remaining prompt fits in what is
  left of this step's budget, shortest first, then in-flight prefill chunks, then the rest, so a short
  prompt in a burst is not queued behind long prompts' chunks; one that waited max_queue_delay_s goes first.
  In a burst it may also leave the decodes out of a few steps (admission_policy.BurstSteps says when).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from qwenserve.engine.admission_policy import BurstSteps, WatermarkSettings, make_policy
from qwenserve.engine.block_pool import BlockPool
from qwenserve.engine.sequence import Sequence, SequenceStatus
from qwenserve.engine.state_pool import StatePool
from qwenserve.engine.state_snapshots import StateSnapshots


@dataclass(slots=True)
class ScheduledSequence:
    """A sequence computing `num_tokens` tokens this step; `samples` when that completes its tokens."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The step's work; `imports` are newly admitted sequences whose KV must be scattered in first, `restores`
    newly admitted sequences of a hybrid model whose state slot is loaded from a snapshot (seq.restore_state)."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    imports: list[Sequence] = field(default_factory=list)
    restores: list[Sequence] = field(default_factory=list)
    prefill_only: bool = False  # short_first left the decodes out of this step to drain a burst

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(slots=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    # The budget of a step with no decodes (prompt chunks only; None: max_num_batched_tokens).
    max_prefill_only_tokens: int | None = None
    admission_policy: str = "short_first"
    max_queue_delay_s: float = 2.0
    watermark_blocks: int = 0
    burst_prefill_steps: int = 2
    burst_max_stall_s: float = 0.25
    priority_aging_s: float = 5.0
    watermark: WatermarkSettings = field(default_factory=WatermarkSettings)


class Scheduler:
    """Owns the waiting queue and the running batch; the block pool (and for a hybrid model the state pool) backs
    its decisions."""

    def __init__(self, limits: SchedulerLimits, pool: BlockPool, states: StatePool | None = None,
                 snapshots: StateSnapshots | None = None) -> None:
        self.policy = make_policy(limits.admission_policy, limits.max_queue_delay_s, limits.priority_aging_s,
                                  limits.watermark, BurstSteps(limits.burst_prefill_steps, limits.burst_max_stall_s))
        self.limits = limits
        self.pool = pool
        self.states = states
        self.snapshots = snapshots
        self.block_size = pool.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefill_only_steps = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self._empty_since: float | None = time.monotonic()  # when the queue last became empty

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.policy.on_arrival(seq, self._empty_since, time.monotonic())
        self._empty_since = None
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        self._release_state(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work (see the module docstring for the order)."""
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        if not decoding:  # no decode waits on this step: larger chunks, fewer passes over the weights
            budget = max(budget, self.limits.max_prefill_only_tokens or 0)
        burst = self.policy.burst
        if burst is not None and burst.wanted(len(decoding), budget, self._waiting_tokens(prefilling)):
            self._admit(self._schedule_running(prefilling, self._admit(budget, out, only_whole=True), out),
                        out, only_whole=False)
            if out.scheduled:
                out.prefill_only = True
                burst.planned(True)
                self.num_prefill_only_steps += 1
                return out
        if burst is not None:
            burst.planned(False)
        budget = self._schedule_running(decoding, budget, out)
        if self.policy.prefers_short:
            budget = self._admit(budget, out, only_whole=True)
            budget = self._schedule_running(prefilling, budget, out)
        else:
            budget = self._schedule_running(prefilling, budget, out)
        self._admit(budget, out, only_whole=False, prefilling=bool(prefilling))
        if not self.waiting and self._empty_since is None:
            self._empty_since = time.monotonic()
        return out

    def _waiting_tokens(self, prefilling: list[Sequence]) -> Iterator[int]:
        """The prompt tokens still to compute, request by request: running prompts first, then queued ones."""
        return (seq.num_uncomputed_tokens for seq in (*prefilling, *self.waiting))

    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """The engine's timing of a step just computed: prefill-only steps teach how long the next would be."""
        if plan.prefill_only and self.policy.burst is not None:
            self.policy.burst.observe(seconds)

    def _schedule_running(self, seqs: list[Sequence], budget: int, out: SchedulerOutput) -> int:
        for seq in seqs:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = self._chunk(seq, budget)
            need = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if need > 0:
                seq.block_table += self.pool.allocate(need)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return budget

    def _admit(self, budget: int, out: SchedulerOutput, only_whole: bool, prefilling: bool = False) -> int:
        for seq in self.policy.order(self.waiting, time.monotonic(), prefilling):
            if budget == 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            if only_whole and seq.num_tokens > budget and not seq.admitted_once:
                continue
            if self.states is not None and self.states.num_free == 0:
                break
            if not self._try_reserve(seq):
                break  # the pool is full: later (larger or equal) requests would not fit either
            if self.states is not None:
                seq.state_slot = self.states.allocate()
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.kv_import is not None:
                out.imports.append(seq)
            if seq.restore_state is not None:
                out.restores.append(seq)
            n = self._chunk(seq, budget)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return budget

    def _try_reserve(self, seq: Sequence) -> bool:
        """Take cached prefix blocks and fresh blocks covering the sequence's tokens, if they fit."""
        bs = self.block_size
        hashes: list[bytes] = []
        if seq.kv_import is None and not seq.needs_prompt_logprobs:
            # The last token is always computed: its logits are needed to sample.
            hashes = self.pool.chain_hashes(seq.token_ids, seq.cache_salt, (seq.num_tokens - 1) // bs)
        hits, idle_hits = self.pool.count_prefix_hits(hashes)
        if self.snapshots is not None and hits:
            hits = self._snapshot_hit(hashes, hits)
            idle_hits = self.pool.count_prefix_hits(hashes[:hits])[1]
        need_new = self._blocks_for(seq.num_tokens) - hits
        reserve = self.limits.watermark_blocks if self.running else 0
        if need_new + idle_hits > self.pool.num_free - reserve:
            return False
        seq.block_table = self.pool.lookup_prefix(hashes[:hits]) + self.pool.allocate(need_new)
        seq.block_hashes = hashes[:hits]
        seq.num_computed_tokens = hits * bs
        seq.restore_state = hashes[hits - 1] if self.snapshots is not None and hits else None
        if seq.kv_import is not None:
            seq.num_computed_tokens = min(seq.kv_import.num_tokens, seq.num_tokens - 1)
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.num_cached_tokens = min(hits * bs, seq.prompt_len)
            self.prefix_hit_tokens += seq.num_cached_tokens
            # A prompt whose KV was imported was looked up where it was prefilled, not here.
            self.prefix_query_tokens += seq.prompt_len if seq.kv_import is None else 0
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table, seq.block_hashes = [], []
        self._release_state(seq)
        seq.num_computed_tokens = 0
        seq.kv_import = None  # recomputed from tokens; imported KV may be gone by then
        seq.restore_state = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        out.imports = [s for s in out.imports if s is not seq]
        out.restores = [s for s in out.restores if s is not seq]

    def _release_state(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def _blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens the sequence computes this step: what is left, within the budget, and for a hybrid model with
        snapshots not past the next snapshot boundary (its state is kept there)."""
        n = min(seq.num_uncomputed_tokens, budget)
        if self.snapshots is not None:
            interval = self.snapshots.interval
            boundary = (seq.num_computed_tokens // interval + 1) * interval
            if boundary < seq.num_tokens:
                n = min(n, boundary - seq.num_computed_tokens)
        return n

    def _snapshot_hit(self, hashes: list[bytes], hits: int) -> int:
        """The cached blocks a hybrid model can use: up to the last snapshot boundary among the first `hits`
        blocks whose state is kept, else none."""
        step = self.snapshots.interval // self.block_size
        for blocks in range(hits - hits % step, 0, -step):
            if hashes[blocks - 1] in self.snapshots:
                return blocks
        return 0

    def on_step_computed(self, scheduled: list[ScheduledSequence]) -> list[tuple[int, bytes]]:
        """Advance computed counts and publish newly filled blocks to the prefix cache. Returns the state slots to
        snapshot, with their keys: a hybrid model's sequences that stopped at a snapshot boundary."""
        snapshots: list[tuple[int, bytes]] = []
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            full = seq.num_computed_tokens // self.block_size
            for h in self.pool.chain_hashes(seq.token_ids, seq.cache_salt, full, known=seq.block_hashes):
                self.pool.register(seq.block_table[len(seq.block_hashes)], h)
                seq.block_hashes.append(h)
            computed = seq.num_computed_tokens
            if (self.snapshots is not None and computed % self.snapshots.interval == 0 and computed < seq.num_tokens
                    and seq.state_slot is not None):
                snapshots.append((seq.state_slot, seq.block_hashes[computed // self.block_size - 1]))
        return snapshots
