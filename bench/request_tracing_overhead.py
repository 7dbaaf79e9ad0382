"""What tracing costs per request through a real local cluster: tracing off vs on (OTLP export).

    .venv/bin/python bench/request_tracing_overhead.py [--requests 20] [--rounds 5] [--max-tokens 16]

Two clusters of the tiny model run side by side (same machine, same load); rounds alternate between
them so drift hits both alike. "off" is the default configuration (no OTEL_* variables): its
per-request cost is the handful of no-op span checks measured by bench/telemetry_overhead.py.
"on" exports every span over OTLP/gRPC to a collector process that writes them to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.launcher import LocalCluster
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc

TINY = {**TINY_CONFIG, "max_position_embeddings": 1024}
WORKER_ENV = {"QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1", "QWENSERVE_KV_POOL_MIB": "16"}
ROOT = Path(__file__).resolve().parents[1]


async def round_ms(address: str, n: int, max_tokens: int) -> list[float]:
    """Milliseconds per request for `n` sequential requests."""
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(n):
            request = router_pb2.GenerateRequest(
                prompt=f"Benchmark request {i}: how much does tracing cost?",
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
            t0 = time.perf_counter()
            async for _ in stub.Generate(request, timeout=60):
                pass
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(Path(tmp) / "tiny", TINY, seed=3)
        collector = subprocess.Popen([sys.executable, "-m", "tests.observability.otlp_receiver", f"{tmp}/spans"],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        port = int(collector.stdout.readline())  # type: ignore[union-attr]
        traced = {**WORKER_ENV, "OTEL_TRACES_EXPORTER": "otlp",
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
                  "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}
        clusters = {"off": LocalCluster(model=model, env=dict(WORKER_ENV), log_dir=Path(tmp) / "off"),
                    "on": LocalCluster(model=model, env=traced, log_dir=Path(tmp) / "on")}
        try:
            for cluster in clusters.values():
                cluster.start()
            times: dict[str, list[float]] = {name: [] for name in clusters}
            for cluster in clusters.values():  # warm both (first requests compile, allocate)
                asyncio.run(round_ms(f"{cluster.host}:{cluster.router_port}", 3, args.max_tokens))
            for r in range(args.rounds):
                order = list(clusters) if r % 2 == 0 else list(reversed(clusters))
                for name in order:
                    c = clusters[name]
                    times[name] += asyncio.run(round_ms(f"{c.host}:{c.router_port}", args.requests, args.max_tokens))
        finally:
            for cluster in clusters.values():
                cluster.stop()
            collector.terminate()
            collector.wait(10)
        spans = len((Path(tmp) / "spans").read_text().splitlines()) if (Path(tmp) / "spans").exists() else 0
    print(f"{'tracing':<8} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8}  ({len(times['off'])} requests each, "
          f"{args.max_tokens} tokens)")
    for name, ms in times.items():
        ms.sort()
        print(f"{name:<8} {statistics.median(ms):>10.2f} {ms[int(0.9 * len(ms))]:>8.2f} {statistics.fmean(ms):>8.2f}")
    ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    print(f"on / off median: {ratio:.3f}; spans exported with tracing on: {spans}")


if __name__ == "__main__":
    main()
