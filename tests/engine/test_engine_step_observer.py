"""The engine's step observer: told of every step the engine plans and computes, and the stage's metrics from it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from qwenserve.telemetry.engine_steps import EngineStepObserver
from qwenserve.telemetry.metrics import engine_metrics

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[tuple[str, int]], float]] = []

    def on_scheduled(self, plan: SchedulerOutput) -> None:
        self.events.append(("scheduled", [(s.seq.request_id, s.num_tokens) for s in plan.scheduled], 0.0))

    def on_step(self, scheduled: list[ScheduledSequence], seconds: float) -> None:
        self.events.append(("computed", [(s.seq.request_id, s.num_tokens) for s in scheduled], seconds))


def test_every_computed_step_is_reported_after_its_plan_with_its_tokens_and_duration(make_engine) -> None:
    engine = make_engine("qwen3_gqa4")
    recorder = Recorder()
    engine.observe_steps(recorder)
    [tokens] = engine.generate_sync([[1, 2, 3, 4, 5]], GREEDY)
    assert len(tokens) == 4
    kinds = [kind for kind, _, _ in recorder.events]
    assert kinds == ["scheduled", "computed"] * 4  # a 5-token prefill, then three one-token decodes
    rid = recorder.events[0][1][0][0]
    assert [batch for kind, batch, _ in recorder.events if kind == "computed"] == [[(rid, 5)]] + [[(rid, 1)]] * 3
    assert all(seconds > 0 for kind, _, seconds in recorder.events if kind == "computed")
    engine.observe_steps(None)
    engine.generate_sync([[6, 7]], GREEDY)
    assert len(recorder.events) == 8


def test_the_stage_observer_counts_steps_and_tokens_and_times_a_watched_requests_first_step(make_engine) -> None:
    engine = make_engine("qwen3_gqa4")
    metrics = engine_metrics(CollectorRegistry())
    observer = EngineStepObserver(metrics)
    engine.observe_steps(observer)
    observer.watch("sync-watched")  # not submitted under this id: never scheduled, so no time for it
    engine.generate_sync([[1, 2, 3, 4, 5, 6]], GREEDY)
    assert (observer.steps, observer.tokens) == (4, 6 + 3)
    assert observer.first_scheduled_ns("sync-watched") is None
    assert observer.tokens_per_second() > 0
    assert metrics.step_time._sum.get() > 0  # type: ignore[attr-defined]
