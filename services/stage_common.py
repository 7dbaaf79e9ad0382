"""Flags and start-up steps shared by the two engine stages (prefill and decode)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import MaxModelLenError
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.flags import add_flag
from qwenserve.telemetry.engine_steps import EngineStepObserver
from qwenserve.telemetry.metrics import engine_metrics, handoff_metrics
from qwenserve.telemetry.startup import add_telemetry_flags
from qwenserve.v1 import common_pb2

#: Failures of an engine stage's start that are the configuration's: one line and exit 1, not a traceback.
ENGINE_STARTUP_ERRORS: tuple[type[Exception], ...] = (MaxModelLenError,)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--kv-cache-gb", type=float, default=1.0, help="memory for the paged KV cache")
    add_flag(parser, "--max-model-len", type=int, default=None,
             help="longest request, prompt + output tokens (default: the model's, lowered to what the KV cache "
                  "holds; one the KV cache cannot hold stops the start)")
    add_flag(parser, "--max-num-batched-tokens", type=int, default=None,
             help="per-step token budget (default: 512 on CPU, 2048 on CUDA)")
    add_flag(parser, "--max-num-seqs", type=int, default=256, help="running sequences at once")
    add_flag(parser, "--admission-policy", default="short_first", choices=["short_first", "fcfs"])
    add_flag(parser, "--burst-prefill-steps", type=int, default=2,
             help="short_first: prefill-only steps in a row allowed while prompts queue up (0: never)")
    add_flag(parser, "--threads", type=int, default=None, help="torch threads (default: all cores)")
    add_flag(parser, "--dtype", default=None, help="float32 (CPU default), bfloat16, float16")
    add_flag(parser, "--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    add_flag(parser, "--enable-prefix-caching", type=bool, default=True, help="share KV of common prompt prefixes")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        device=args.device, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_gb, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        admission_policy=args.admission_policy, burst_prefill_steps=args.burst_prefill_steps,
        num_threads=args.threads,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def engine_info(engine: LLMEngine) -> common_pb2.EngineInfo:
    """What a stage's GetInfo answers: the engine's limits, from which the router learns its own."""
    return common_pb2.EngineInfo(
        max_model_len=engine.max_model_len, kv_cache_tokens=engine.pool.num_blocks * engine.pool.block_size
    )


def resolve_model(model: str | None) -> str:
    """The checkpoint to serve: the given folder, or the built-in default (made on first use)."""
    if model:
        return model
    from qwenserve.default_model import ensure_default_model

    return str(ensure_default_model())


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


def add_metrics_flag(parser: argparse.ArgumentParser) -> None:
    """`--metrics-port` (Prometheus /metrics, /healthz, /readyz), `--served-model-name` plus the logging flags."""
    add_flag(parser, "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    add_flag(parser, "--served-model-name", default="",
             help="the model_name label of vLLM's metrics, as the router's (default: the checkpoint folder's name)")
    add_telemetry_flags(parser)


def observe_engine_steps(engine: LLMEngine) -> EngineStepObserver:
    """Per-step metrics (batch size, tokens, step time) and queue timing for traces."""
    return EngineStepObserver(engine_metrics()).attach(engine)


def served_model_name(args: argparse.Namespace, model: str) -> str:
    """`--served-model-name`, or the folder name of the checkpoint `model` (what the router defaults to)."""
    return args.served_model_name or Path(model).name


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
