"""`qwen-serve bench`: drive a target with a traffic mix and report latency, throughput and goodput.

Examples:
  qwen-serve bench --target grpc://127.0.0.1:50050 --mix chat --rate 2 --duration 60 --slo-ttft-ms 500
  qwen-serve bench --target http://127.0.0.1:8000 --mix shared-prefix --concurrency 4 --num-requests 50
  qwen-serve bench --target http://host:8000 --api chat --model Qwen/Qwen3-8B --rates 1,2,4,8 --duration 60
  qwen-serve bench --target grpc://127.0.0.1:50050 --trace requests.jsonl --out bench-out/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenserve.flags import StrictParser
from qwenserve.loadgen import arrivals
from qwenserve.loadgen.progress import show_progress
from qwenserve.loadgen.prompts import PromptFactory
from qwenserve.loadgen.report import format_sweep, format_table, run_document, write_json, write_plots
from qwenserve.loadgen.runner import Bounds, LiveCounters, RunResult, run_closed_loop, run_open_loop
from qwenserve.loadgen.stats import Slo, Summary, summarize
from qwenserve.loadgen.targets import LoadRequest, Target, make_target, new_request_id
from qwenserve.loadgen.workload import (
    Mix,
    RequestSpec,
    WorkloadError,
    builtin_mix,
    load_mix,
    load_trace,
    mix_spec_fields,
)
from qwenserve.tokenizer import Tokenizer


@dataclass(slots=True)
class BenchConfig:
    """Everything one `qwen-serve bench` invocation does. Exactly one of rates / concurrencies is used
    (rates win); a trace replays at its own times unless rates are given."""

    target: str = "grpc://127.0.0.1:50050"
    mix: str = "chat"
    mix_file: Path | None = None
    trace: Path | None = None
    rates: list[float] = field(default_factory=list)
    concurrencies: list[int] = field(default_factory=list)
    num_requests: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    drain_s: float = 30.0
    scale: float = 1.0  # token lengths multiplied by this (small machines)
    time_scale: float = 1.0  # trace arrival times multiplied by this
    max_model_len: int | None = None
    tokenizer: Path | None = None
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    out_dir: Path | None = None
    progress: bool = True
    label: str = ""
    target_options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RunOutcome:
    """One run of a (possibly swept) bench: its label, the rate or concurrency, the records and numbers."""

    label: str
    load: float
    result: RunResult
    summary: Summary


def _tokenizer(config: BenchConfig) -> Tokenizer:
    if config.tokenizer is not None:
        return Tokenizer.from_dir(config.tokenizer)
    if config.target.startswith("engine:"):
        return Tokenizer.from_dir(config.target.removeprefix("engine:"))
    return Tokenizer.builtin()


def _mix(config: BenchConfig) -> Mix:
    mix = load_mix(config.mix_file) if config.mix_file else builtin_mix(config.mix)
    return mix.scaled(config.scale) if config.scale != 1.0 else mix


def _plan(config: BenchConfig, load: float, open_loop: bool, max_len: int | None) -> list[RequestSpec]:
    """The specs of one run (seeded, so every rate of a sweep and every target sees the same draw)."""
    rng = random.Random(config.seed)
    if config.trace is not None:
        specs = arrivals.scale_trace(load_trace(config.trace), config.scale, max_len, config.time_scale)
        if open_loop and config.rates:
            # A trace replayed at a chosen rate keeps its lengths and gets Poisson arrivals.
            times = arrivals.open_loop(builtin_mix("normal"), load, rng, num_requests=len(specs))
            specs = [RequestSpec(s.index, s.prompt_len, s.output_len, s.group, t.arrival_s)
                     for s, t in zip(specs, times, strict=False)]
        return specs[: config.num_requests] if config.num_requests else specs
    mix = _mix(config)
    if open_loop:
        return arrivals.open_loop(mix, load, rng, num_requests=config.num_requests, duration_s=config.duration_s,
                                  max_model_len=max_len)
    n = config.num_requests or 100_000  # a duration-bounded closed loop draws lazily from a long list
    return arrivals.closed_loop(mix, n, rng, max_len)


async def bench(config: BenchConfig, target: Target | None = None, stop: asyncio.Event | None = None,
                out: Any = sys.stdout) -> list[RunOutcome]:
    """Run every load of the config against the target; print the tables; write JSON and plots to out_dir."""
    if config.num_requests is None and config.duration_s is None and config.trace is None:
        raise WorkloadError("give --num-requests or --duration (a run must stop by itself)")
    target = target or make_target(config.target, **config.target_options)
    stop = stop or asyncio.Event()
    tokenizer = await asyncio.to_thread(_tokenizer, config)
    await target.start()
    outcomes: list[RunOutcome] = []
    try:
        max_len = config.max_model_len or await target.max_model_len()
        open_loop = bool(config.rates) or (config.trace is not None and not config.concurrencies)
        loads: list[float] = (list(config.rates) or [0.0]) if open_loop else [float(c) for c in
                                                                               config.concurrencies or [1]]
        for load in loads:
            if stop.is_set():
                break
            specs = _plan(config, load, open_loop, max_len)
            factory = PromptFactory(tokenizer, config.seed)

            def build(spec: RequestSpec, factory: PromptFactory = factory) -> LoadRequest:
                return LoadRequest(new_request_id(), spec, factory.for_spec(spec))

            kind = ("trace" if not config.rates else f"rate={load:g}") if open_loop else f"conc={int(load)}"
            label = f"{config.label} {kind}".strip()
            counters = LiveCounters()
            ticker = asyncio.create_task(show_progress(label, counters)) if config.progress else None
            bounds = Bounds(config.num_requests, config.duration_s, config.request_timeout_s, config.drain_s)
            try:
                if open_loop:
                    requests = await asyncio.to_thread(lambda s=specs: [build(x) for x in s])
                    result = await run_open_loop(target, requests, bounds, stop, counters)
                else:
                    result = await run_closed_loop(
                        target, lambda i, s=specs: build(s[i]) if i < len(s) else None, int(load), bounds, stop,
                        counters)
            finally:
                if ticker is not None:
                    ticker.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await ticker
            summary = summarize(result.records, config.slo)
            outcomes.append(RunOutcome(label, load, result, summary))
            print(format_table(f"{label} ({result.stopped_by})", summary), file=out, flush=True)
    finally:
        await target.close()
    if len(outcomes) > 1:
        print(format_sweep([(o.label, o.summary) for o in outcomes]), file=out, flush=True)
    if config.out_dir is not None:
        write_report(config, outcomes, open_loop)
    return outcomes


def write_report(config: BenchConfig, outcomes: list[RunOutcome], open_loop: bool) -> None:
    """report.json plus the PNG plots in config.out_dir."""
    assert config.out_dir is not None
    settings = {
        "target": config.target, "mix": mix_spec_fields(_mix(config)) if config.trace is None else None,
        "trace": str(config.trace) if config.trace else None, "scale": config.scale, "seed": config.seed,
        "num_requests": config.num_requests, "duration_s": config.duration_s,
        "request_timeout_s": config.request_timeout_s, "open_loop": open_loop,
    }
    runs = [run_document(o.label, o.result.records, o.summary, o.result.stopped_by, {**settings, "load": o.load})
            for o in outcomes]
    write_json(config.out_dir / "report.json", {"runs": runs})
    sweep = [(o.load, o.summary) for o in outcomes] if open_loop else []
    if not write_plots(config.out_dir, [(o.label, o.result.records) for o in outcomes], sweep):
        print("qwen-serve bench: no plots: they need the 'bench' extra (matplotlib): pip install 'qwen-serve[bench]'",
              file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    p = StrictParser(prog="qwen-serve bench", description=__doc__.splitlines()[0],
                                epilog="\n".join(__doc__.splitlines()[2:]), formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="grpc://127.0.0.1:50050",
                   help="grpc://host:port | http://host:port | engine:/model/dir | synthetic[:ttft_ms=..,itl_ms=..]")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--mix", default="chat", help="chat, normal, long-tail, burst, shared-prefix")
    w.add_argument("--mix-file", type=Path, help="a custom mix (YAML or JSON)")
    w.add_argument("--trace", type=Path, help="JSONL: arrival_s|timestamp(ms), prompt_len, output_len")
    a = p.add_mutually_exclusive_group()
    a.add_argument("--rate", "--rates", dest="rates", default=None,
                   help="open loop, requests/s: 2, or a sweep 1,2,4 or 0.5:4:0.5")
    a.add_argument("--concurrency", default=None, help="closed loop: requests in flight (a sweep: 1,2,4)")
    p.add_argument("--num-requests", type=int, default=None, help="stop after this many requests")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as timeout")
    p.add_argument("--drain", type=float, default=30.0, help="seconds in-flight requests get after --duration")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every token length (e.g. 0.1 on a laptop)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply a trace's arrival times")
    p.add_argument("--max-model-len", type=int, default=None, help="cap prompt+output (default: ask the target)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: the Qwen vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="goodput: mean inter-token latency at most this")
    p.add_argument("--out", type=Path, default=None, help="write report.json and PNG plots here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--label", default="")
    p.add_argument("--input", dest="input_mode", choices=["text", "chat", "tokens"], default="text",
                   help="gRPC: raw text prompt, chat template, or token ids")
    p.add_argument("--api", choices=["completions", "chat"], default="completions", help="HTTP endpoint")
    p.add_argument("--model", default=None, help="HTTP: model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-continuous-usage", action="store_true",
                   help="HTTP: do not ask for usage in every chunk (servers that reject the option)")
    p.add_argument("--cold", action="store_true",
                   help="gRPC: a fresh cache_salt per request, so no request hits another's prefix cache")
    return p


def config_from_args(argv: list[str]) -> BenchConfig:
    """Parse the command line into a BenchConfig (argparse exits with 2 on bad usage)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        rates = arrivals.parse_rates(args.rates) if args.rates else []
        concurrencies = [int(x) for x in args.concurrency.split(",")] if args.concurrency else []
    except ValueError as e:
        parser.error(str(e))
    if args.num_requests is None and args.duration is None and args.trace is None:
        parser.error("give --num-requests or --duration so the run stops by itself")
    return BenchConfig(
        target=args.target, mix=args.mix, mix_file=args.mix_file, trace=args.trace, rates=rates,
        concurrencies=concurrencies, num_requests=args.num_requests, duration_s=args.duration,
        request_timeout_s=args.request_timeout, drain_s=args.drain, scale=args.scale, time_scale=args.time_scale,
        max_model_len=args.max_model_len, tokenizer=args.tokenizer, seed=args.seed,
        slo=Slo(args.slo_ttft_ms, args.slo_itl_ms), out_dir=args.out, progress=not args.no_progress,
        label=args.label,
        target_options={"input_mode": args.input_mode, "api": args.api, "model": args.model,
                        "api_key": args.api_key, "timeout_s": args.request_timeout,
                        "continuous_usage": not args.no_continuous_usage, "cache_salt_per_request": args.cold},
    )


async def _main_async(config: BenchConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await bench(config, stop=stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if stop.is_set():
        print("qwen-serve bench: interrupted; the report covers what ran", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    """`qwen-serve bench ...`: 0 when the run completed (errors are in the report), 130 on Ctrl-C,
    2 on bad usage or an unusable mix/trace file."""
    config = config_from_args(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(_main_async(config))
    except (WorkloadError, OSError) as e:
        print(f"qwen-serve bench: {e}", file=sys.stderr)
        return 2
