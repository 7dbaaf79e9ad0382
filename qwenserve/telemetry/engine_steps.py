"""Per-step engine metrics and per-request queue timing, as the engine's step observer.

The stage registers an `EngineStepObserver` with `engine.observe_steps(...)`; the compute loop then calls
`on_scheduled(plan)` once a step is planned and `on_step(scheduled, seconds)` once it is computed, so each step
yields batch size, tokens and duration (schedule + forward; sampling follows and is not included) without the
engine knowing about Prometheus. The observer also remembers when a watched request was first scheduled, which
splits a request's time into "queue" (waiting for a batch slot) and "compute" for its trace.

Both calls run on the engine thread: they do a few dict and deque operations per step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from qwenserve.telemetry.metrics import EngineMetrics, SlidingRate

if TYPE_CHECKING:
    from qwenserve.engine.scheduler import ScheduledSequence, SchedulerOutput


class EngineStepObserver:
    """Records every engine step into `metrics` and the first-scheduled time of watched requests."""

    def __init__(self, metrics: EngineMetrics, window_s: float = 10.0) -> None:
        self.metrics = metrics
        self.steps = 0
        self.tokens = 0
        self.rate = SlidingRate(window_s)
        # request id -> time.time_ns() of its first step, None until scheduled; only watched ids.
        self._first_scheduled: dict[str, int | None] = {}

    def on_scheduled(self, plan: SchedulerOutput) -> None:
        """A step was planned: note the first step of every watched request in it."""
        if not self._first_scheduled:
            return
        now = time.time_ns()
        for item in plan.scheduled:
            rid = item.seq.request_id
            if rid in self._first_scheduled and self._first_scheduled[rid] is None:
                self._first_scheduled[rid] = now

    def on_step(self, scheduled: list[ScheduledSequence], seconds: float) -> None:
        """A step was computed in `seconds` (from its planning on)."""
        tokens = sum(item.num_tokens for item in scheduled)
        self.metrics.observe_step(len(scheduled), tokens, seconds)
        self.steps += 1  # only the engine thread writes these
        self.tokens += tokens
        self.rate.add(tokens)

    def watch(self, request_id: str) -> None:
        """Remember when `request_id` is first scheduled (call before submitting it)."""
        self._first_scheduled[request_id] = None

    def first_scheduled_ns(self, request_id: str) -> int | None:
        """When the watched request was first scheduled (time.time_ns()), and stop watching it."""
        return self._first_scheduled.pop(request_id, None)

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens computed per second over the last `window_s` seconds."""
        return self.rate.per_second(now)
