"""Start-up steps shared by the two engine stages (prefill and decode); their options are in `qwenserve.stages`."""

from __future__ import annotations

import asyncio
from typing import Any

from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import CheckpointError, MaxModelLenError
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models.config import UnsupportedModelError
from qwenserve.telemetry.engine_steps import EngineStepObserver
from qwenserve.telemetry.metrics import engine_metrics, handoff_metrics
from qwenserve.v1 import common_pb2

#: Failures of an engine stage's start that are the configuration's: one line and exit 1, not a traceback.
ENGINE_STARTUP_ERRORS: tuple[type[Exception], ...] = (MaxModelLenError, CheckpointError, UnsupportedModelError)


def engine_info(engine: LLMEngine) -> common_pb2.EngineInfo:
    """What a stage's GetInfo answers: the engine's limits, from which the router learns its own."""
    return common_pb2.EngineInfo(
        max_model_len=engine.max_model_len, kv_cache_tokens=engine.pool.num_blocks * engine.pool.block_size,
        precision=engine.precision.name,
    )


def engine_failure(engine: LLMEngine) -> asyncio.Future[str]:
    """A future on the running loop that resolves with the reason if the engine's compute loop dies; give it to
    `serve(failure=...)`, which then reports NOT_SERVING everywhere and ends the process non-zero."""
    loop = asyncio.get_running_loop()
    failure: asyncio.Future[str] = loop.create_future()

    def resolve(reason: str) -> None:
        if not failure.done():
            failure.set_result(reason)

    engine.on_failure(lambda reason: loop.call_soon_threadsafe(resolve, reason))
    return failure


async def warm_up_engine(engine: LLMEngine) -> None:
    """One real forward pass before health says SERVING, so the first request pays no start-up cost."""
    async for _ in engine.generate("warm-up", [0, 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2)):
        pass


def observe_engine_steps(engine: LLMEngine) -> EngineStepObserver:
    """Per-step metrics (batch size, tokens, step time), queue timing for traces, grammar refusals, and the
    engine's precision (an info metric, set once)."""
    observer = EngineStepObserver(engine_metrics())
    engine.observe_steps(observer)
    engine_metrics().record_precision(engine.precision.labels(), engine.precision.reason)
    engine.on_grammar_refusal(engine_metrics().record_grammar_refusal)
    return observer


async def publish_engine_metrics(
    engine: LLMEngine, exporter: Any = None, interval_s: float = 0.5, steps: EngineStepObserver | None = None,
    model_name: str | None = None,
) -> None:
    """Copy the engine's (and exporter's) state into the Prometheus gauges, forever; vLLM's carry `model_name`."""
    gauges, handoff = engine_metrics(), handoff_metrics()
    if model_name:
        gauges.model_name = model_name
    reclaimed_seen = 0
    while True:
        gauges.update_from_stats(engine.stats())
        if steps is not None:
            gauges.throughput.set(steps.tokens_per_second())
        if exporter is not None:
            counters = exporter.counters()
            handoff.leases_outstanding.set(counters.outstanding)
            handoff.leases_reclaimed.inc(counters.reclaimed - reclaimed_seen)
            reclaimed_seen = counters.reclaimed
        await asyncio.sleep(interval_s)
