"""Which waiting request the scheduler admits first: a policy object per `admission_policy`.

- "fcfs": arrival order.
- "short_first": requests whose whole prompt fits the step first, shortest first, and prefill-only steps
  in a burst (BurstSteps).
- "watermark": the field reports' sliding watermark. Each arriving request gets a score that predicts
  its cost to the batch, 0.8 x prompt tokens + 1.2 x output budget; the last `window` scores form a ring
  buffer and their `percentile` is the watermark. A request scoring above it is held while cheaper work
  is waiting or a prompt is still being prefilled, so a burst of short chats is not queued behind long
  documents; held requests are admitted when nothing cheaper is left (the engine never idles for them).
  A held request's score decays by `decay` per second of waiting, so it comes under the watermark in
  time; after `reset_idle_s` with an empty queue the window starts afresh, so the scores of a finished
  burst do not set the watermark of the next.

Every policy keeps two rules: requests are ordered by their priority (lower first, as vLLM's), which improves
by one level every `priority_aging_s` of waiting, so a low tier is served late but never starves behind a stream
of high-tier work; and within a priority level a request preempted earlier or waiting longer than
max_queue_delay_s goes first, so the policy's own reordering starves nothing. Urgency does not jump a tier: when a
slow engine let a flood of free-tier requests wait past max_queue_delay_s, the paid requests behind them were
served last (aging is what lifts a low tier).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the stages' option checks import this module, which must not import torch
    from qwenserve.engine.sequence import Sequence

POLICIES = ("short_first", "fcfs", "watermark")


@dataclass(frozen=True, slots=True)
class WatermarkSettings:
    window: int = 48  # recent scores the watermark is taken from (the field reports settled on 48)
    percentile: float = 90.0
    decay: float = 0.95  # a held request's score is multiplied by this per second of waiting
    reset_idle_s: float = 3.0  # an empty queue this long forgets the window

    def __post_init__(self) -> None:
        checks = [("--watermark-window", self.window >= 1, "must be >= 1"),
                  ("--watermark-percentile", 0 <= self.percentile <= 100, "must be in [0, 100]"),
                  ("--watermark-decay", 0 < self.decay <= 1, "must be in (0, 1]"),
                  ("--watermark-reset-idle-s", self.reset_idle_s >= 0, "must be >= 0")]
        for flag, ok, why in checks:
            if not ok:
                raise ValueError(f"{flag} {why}")


def request_score(seq: Sequence) -> float:
    """The reports' cost estimate: prompt tokens weigh 0.8, the output budget 1.2."""
    return 0.8 * seq.prompt_len + 1.2 * seq.max_tokens


class BurstSteps:
    """Prefill-only steps in a burst: when more prompt tokens wait than a step could take beside its decodes,
    up to `max_steps` steps in a row leave the decodes out. Every decode row costs a pass through the LM head,
    so such a step is short and first tokens come sooner: inter-token latency pays a little so that time to
    first token does not pay a lot. Only while such steps are short: the time they took (the first one is the
    probe) must say that the decodes would wait no longer than `max_stall_s` in all. max_steps=0: never."""

    def __init__(self, max_steps: int, max_stall_s: float) -> None:
        self.max_steps = max_steps
        self.max_stall_s = max_stall_s
        self.skipped = 0  # consecutive prefill-only steps so far
        self.step_s: float | None = None  # how long a prefill-only step takes here, smoothed

    def wanted(self, num_decoding: int, budget: int, waiting_tokens: Iterable[int]) -> bool:
        """Should the next step leave its `num_decoding` decodes out, with `waiting_tokens` prompt tokens queued
        (each entry one request's) and a budget of `budget` tokens a step?"""
        if not num_decoding or self.skipped >= self.max_steps:
            return False
        if self.step_s is not None and (self.skipped + 1) * self.step_s > self.max_stall_s:
            return False
        room, waiting = budget - num_decoding, 0
        for tokens in waiting_tokens:
            waiting += tokens
            if waiting > room:
                return True
        return False

    def planned(self, prefill_only: bool) -> None:
        """The step just planned did (or did not) leave the decodes out."""
        self.skipped = self.skipped + 1 if prefill_only else 0

    def observe(self, seconds: float) -> None:
        """A prefill-only step took `seconds`. Not scaled up to a full budget: a step's fixed costs (the LM head
        for prompts that finish) would make a small step look slow."""
        self.step_s = seconds if self.step_s is None else 0.7 * self.step_s + 0.3 * seconds


class AdmissionPolicy:
    """Arrival order, with the two rules every policy keeps (by aged priority; urgent first within a level)."""

    name = "fcfs"
    #: The scheduler admits whole short prompts before running prefill chunks.
    prefers_short = False
    #: When the scheduler may leave the decodes out of a step to drain a burst of prompts; None: never.
    burst: BurstSteps | None = None

    def __init__(self, max_queue_delay_s: float, priority_aging_s: float = 5.0) -> None:
        self.max_queue_delay_s = max_queue_delay_s
        self.priority_aging_s = priority_aging_s

    def on_arrival(self, seq: Sequence, queue_was_empty_since: float | None, now: float) -> None:
        """A request joined the queue (`queue_was_empty_since`: when the queue last became empty, or None)."""

    def order(self, waiting: deque[Sequence], now: float, prefilling: bool) -> list[Sequence]:
        """The waiting requests in the order to try them; `prefilling`: a running prompt is still being computed."""
        urgent, rest = self._split_urgent(waiting, now)
        return self._tiered(urgent, sorted(rest, key=lambda s: s.arrival_time), now)

    def _tiered(self, urgent: list[Sequence], rest: list[Sequence], now: float) -> list[Sequence]:
        """By aged priority level; within a level the urgent requests (in arrival order), then `rest` in the order
        the policy gave them (the sort is stable)."""
        marked = {id(s) for s in urgent}
        return sorted(urgent + rest, key=lambda s: (self._tier(s, now), id(s) not in marked))

    def _split_urgent(self, waiting: deque[Sequence], now: float) -> tuple[list[Sequence], list[Sequence]]:
        deadline = now - self.max_queue_delay_s
        urgent = [s for s in waiting if s.admitted_once or s.arrival_time < deadline]
        marked = {id(s) for s in urgent}
        return urgent, [s for s in waiting if id(s) not in marked]

    def _tier(self, seq: Sequence, now: float) -> int:
        """The priority level a request competes at: its own, one better per priority_aging_s waited."""
        if seq.priority <= 0:
            return seq.priority
        aged = int((now - seq.arrival_time) / self.priority_aging_s) if self.priority_aging_s > 0 else 0
        return max(0, seq.priority - aged)


class ShortFirst(AdmissionPolicy):
    """Shortest remaining prompt first, and prefill-only steps in a burst."""

    name = "short_first"
    prefers_short = True

    def __init__(self, max_queue_delay_s: float, priority_aging_s: float = 5.0,
                 burst: BurstSteps | None = None) -> None:
        super().__init__(max_queue_delay_s, priority_aging_s)
        self.burst = burst or BurstSteps(max_steps=2, max_stall_s=0.25)

    def order(self, waiting: deque[Sequence], now: float, prefilling: bool) -> list[Sequence]:
        urgent, rest = self._split_urgent(waiting, now)
        return self._tiered(urgent, sorted(rest, key=lambda s: s.num_uncomputed_tokens), now)


class SlidingWatermark(AdmissionPolicy):
    """The field reports' sliding watermark (see the module docstring)."""

    name = "watermark"

    def __init__(self, max_queue_delay_s: float, priority_aging_s: float = 5.0,
                 settings: WatermarkSettings = WatermarkSettings()) -> None:
        super().__init__(max_queue_delay_s, priority_aging_s)
        self.settings = settings
        self.scores: deque[float] = deque(maxlen=settings.window)
        self.resets = 0

    def on_arrival(self, seq: Sequence, queue_was_empty_since: float | None, now: float) -> None:
        if queue_was_empty_since is not None and now - queue_was_empty_since >= self.settings.reset_idle_s:
            if self.scores:
                self.resets += 1
            self.scores.clear()
        self.scores.append(request_score(seq))

    @property
    def watermark(self) -> float:
        """The percentile of the window's scores (inf while the window is empty: nothing is held)."""
        return percentile(list(self.scores), self.settings.percentile) if self.scores else math.inf

    def held(self, seq: Sequence, now: float) -> bool:
        """Whether the request scores above the watermark, after its waiting decayed its score."""
        waited = max(0.0, now - seq.arrival_time)
        return request_score(seq) * self.settings.decay ** waited > self.watermark

    def order(self, waiting: deque[Sequence], now: float, prefilling: bool) -> list[Sequence]:
        urgent, rest = self._split_urgent(waiting, now)
        below = [s for s in rest if not self.held(s, now)]
        above = [s for s in rest if self.held(s, now)]
        key = lambda s: s.arrival_time  # noqa: E731
        if below or prefilling:
            return self._tiered(urgent, sorted(below, key=key), now)  # the expensive ones wait for a quieter step
        return self._tiered(urgent, sorted(above, key=key), now)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation between the closest ranks (as numpy's default)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def make_policy(name: str, max_queue_delay_s: float, priority_aging_s: float = 5.0,
                watermark: WatermarkSettings = WatermarkSettings(), burst: BurstSteps | None = None) -> AdmissionPolicy:
    if name == "fcfs":
        return AdmissionPolicy(max_queue_delay_s, priority_aging_s)
    if name == "short_first":
        return ShortFirst(max_queue_delay_s, priority_aging_s, burst)
    if name == "watermark":
        return SlidingWatermark(max_queue_delay_s, priority_aging_s, watermark)
    raise ValueError(f"admission_policy {name!r}: use one of {', '.join(POLICIES)}")
