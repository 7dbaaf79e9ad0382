"""Shared pieces of the load-generator experiments (bench/experiment_*.py): a local cluster per setting,
one bench run against it, and a compact line of figures. Run by hand, not by pytest."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qwenserve.default_model import ensure_default_model
from qwenserve.launcher import LocalCluster
from qwenserve.loadgen.cli import BenchConfig, RunOutcome, bench
from qwenserve.loadgen.stats import Summary

# Small KV pools and one torch thread per engine: four processes share this machine's two cores.
WORKER_ENV = {"QWENSERVE_KV_CACHE_GB": "0.25", "QWENSERVE_THREADS": "1", "QWENSERVE_KV_POOL_MIB": "64"}


def common_args(parser: argparse.ArgumentParser, duration: float, scale: float) -> None:
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the built-in small Qwen3)")
    parser.add_argument("--duration", type=float, default=duration, help="seconds of traffic per setting")
    parser.add_argument("--scale", type=float, default=scale, help="token lengths multiplied by this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="report.json + plots per setting under here")


def model_path(arg: Path | None) -> Path:
    return arg or ensure_default_model()


@contextmanager
def cluster(model: Path, prefill: int, decode: int, env: dict[str, str], **more: Any) -> Iterator[LocalCluster]:
    """A `qwen-serve up` on loopback with the given worker environment (and LocalCluster settings); logs in a
    temporary folder."""
    logs = Path(tempfile.mkdtemp(prefix="qwenserve-bench-"))
    with LocalCluster(model=model, prefill=prefill, decode=decode, env={**WORKER_ENV, **env}, log_dir=logs,
                      **more) as c:
        yield c


def run(config: BenchConfig) -> RunOutcome:
    """One bench run (a single rate or concurrency), its table printed."""
    [outcome] = asyncio.run(bench(config))
    return outcome


def figures(label: str, s: Summary) -> str:
    """One comparable line per setting."""
    return (f"{label:<28} n={s.requests:<4} ok={s.successes:<4} req/s={s.request_throughput:6.2f} "
            f"out tok/s={s.output_throughput:7.1f} TTFT p50={s.ttft_ms.p50:8.1f} p99={s.ttft_ms.p99:8.1f} ms "
            f"ITL p50={s.itl_ms.p50:6.1f} p99={s.itl_ms.p99:7.1f} ms goodput={s.goodput:5.2f} req/s "
            f"({s.good}/{s.requests})")
