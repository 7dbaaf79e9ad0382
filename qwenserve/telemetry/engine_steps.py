"""Per-step engine metrics and per-request queue timing, observed from outside the engine.

The engine's compute loop calls `scheduler.schedule()` and then, after the forward pass,
`scheduler.on_step_computed(scheduled)`. `EngineStepObserver.attach(engine)` wraps those two
bound methods on the engine's scheduler instance, so each step yields batch size, tokens and
duration (schedule + forward; sampling follows and is not included) without the engine knowing
about Prometheus. It also remembers when a watched request was first scheduled, which splits a
request's time into "queue" (waiting for a batch slot) and "compute" for its trace.

The wrappers run on the engine thread: they do a few dict and deque operations per step.
"""

from __future__ import annotations

import time
from typing import Any

from qwenserve.telemetry.metrics import EngineMetrics, SlidingRate


class EngineStepObserver:
    """Records every engine step into `metrics` and the first-scheduled time of watched requests."""

    def __init__(self, metrics: EngineMetrics, window_s: float = 10.0) -> None:
        self.metrics = metrics
        self.steps = 0
        self.tokens = 0
        self.rate = SlidingRate(window_s)
        self._step_started = 0.0
        # request id -> time.time_ns() of its first step, None until scheduled; only watched ids.
        self._first_scheduled: dict[str, int | None] = {}

    def attach(self, engine: Any) -> EngineStepObserver:
        """Wrap `engine.scheduler`'s `schedule` and `on_step_computed`; returns self."""
        scheduler = engine.scheduler
        schedule, computed = scheduler.schedule, scheduler.on_step_computed

        def observed_schedule() -> Any:
            self._step_started = time.perf_counter()
            plan = schedule()
            if self._first_scheduled:
                now = time.time_ns()
                for item in plan.scheduled:
                    rid = item.seq.request_id
                    if rid in self._first_scheduled and self._first_scheduled[rid] is None:
                        self._first_scheduled[rid] = now
            return plan

        def observed_computed(scheduled: list[Any]) -> None:
            computed(scheduled)
            tokens = sum(item.num_tokens for item in scheduled)
            self.metrics.observe_step(len(scheduled), tokens, time.perf_counter() - self._step_started)
            self.steps += 1  # only the engine thread writes these
            self.tokens += tokens
            self.rate.add(tokens)

        scheduler.schedule = observed_schedule
        scheduler.on_step_computed = observed_computed
        return self

    def watch(self, request_id: str) -> None:
        """Remember when `request_id` is first scheduled (call before submitting it)."""
        self._first_scheduled[request_id] = None

    def first_scheduled_ns(self, request_id: str) -> int | None:
        """When the watched request was first scheduled (time.time_ns()), and stop watching it."""
        return self._first_scheduled.pop(request_id, None)

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens computed per second over the last `window_s` seconds."""
        return self.rate.per_second(now)
