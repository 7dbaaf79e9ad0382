"""HTTP front vs gRPC Generate: requests/s and time to first token through the same router.

    .venv/bin/python bench/http_bench.py [--requests 64] [--concurrency 1,8] [--max-tokens 1,16]

Starts a LocalCluster (the built-in tiny model, no auth, in-process limiter), then for each
(max_tokens, concurrency) runs the same streamed completions through gRPC `Router.Generate`
(grpc.aio) and through `POST /v1/completions` with SSE (aiohttp client), alternating rounds so
that drift hits both alike. TTFT is taken at the first message (gRPC) / first data chunk (HTTP)
carrying a token. Overhead = HTTP - gRPC at the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp
import grpc

from qwenserve.launcher import LocalCluster
from qwenserve.v1 import router_pb2, router_pb2_grpc

PROMPT = "The quick brown fox jumps over the lazy dog. Tell me more about it"


async def grpc_one(stub: router_pb2_grpc.RouterStub, max_tokens: int) -> tuple[float, float]:
    request = router_pb2.GenerateRequest(prompt=PROMPT)
    request.sampling.max_tokens = max_tokens
    request.sampling.temperature = 0
    request.sampling.ignore_eos = True
    start = time.perf_counter()
    ttft = None
    async for msg in stub.Generate(request):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - start
        if msg.finish_reason:
            break
    return ttft or float("nan"), time.perf_counter() - start


async def http_one(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float, float]:
    body = {"model": None, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    ttft = None
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            if ttft is None and json.loads(data)["choices"]:
                ttft = time.perf_counter() - start
    return ttft or float("nan"), time.perf_counter() - start


async def run_round(one, requests: int, concurrency: int) -> tuple[list[float], float]:
    """`requests` calls with `concurrency` in flight; returns the TTFTs and the wall time."""
    queue = list(range(requests))
    ttfts: list[float] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            ttft, _ = await one()
            ttfts.append(ttft)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, time.perf_counter() - start


async def bench(cluster: LocalCluster, args: argparse.Namespace) -> list[dict]:
    url = f"http://127.0.0.1:{cluster.http_port}/v1/completions"
    rows = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.router_port}") as channel, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        stub = router_pb2_grpc.RouterStub(channel)
        for max_tokens in args.max_tokens:
            # Warm up both paths (connections, prefix cache, first-call costs).
            await run_round(lambda m=max_tokens: grpc_one(stub, m), 4, 2)
            await run_round(lambda m=max_tokens: http_one(session, url, m), 4, 2)
            for concurrency in args.concurrency:
                results = {"grpc": ([], 0.0), "http": ([], 0.0)}
                for _ in range(args.rounds):
                    for name, one in (("grpc", lambda m=max_tokens: grpc_one(stub, m)),
                                      ("http", lambda m=max_tokens: http_one(session, url, m))):
                        ttfts, wall = await run_round(one, args.requests // args.rounds, concurrency)
                        results[name] = (results[name][0] + ttfts, results[name][1] + wall)
                row = {"max_tokens": max_tokens, "concurrency": concurrency}
                for name, (ttfts, wall) in results.items():
                    row[f"{name}_rps"] = len(ttfts) / wall
                    row[f"{name}_ttft_p50_ms"] = statistics.median(ttfts) * 1000
                    row[f"{name}_ttft_p90_ms"] = statistics.quantiles(ttfts, n=10)[-1] * 1000
                row["ttft_overhead_p50_ms"] = row["http_ttft_p50_ms"] - row["grpc_ttft_p50_ms"]
                row["rps_ratio"] = row["http_rps"] / row["grpc_rps"]
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per front per configuration")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds the requests are split into")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the built-in tiny model)")
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        from qwenserve.default_model import ensure_default_model

        args.model = ensure_default_model()
    env = {"QWENSERVE_NO_AUTH": "1"}
    with LocalCluster(model=args.model, env=env, log_dir=args.log_dir) as cluster:
        rows = asyncio.run(bench(cluster, args))
    print("\nmax_tok conc | grpc rps  http rps  ratio | grpc ttft p50  http ttft p50  overhead (ms)")
    for r in rows:
        print(f"{r['max_tokens']:>7} {r['concurrency']:>4} | {r['grpc_rps']:8.1f} {r['http_rps']:9.1f} "
              f"{r['rps_ratio']:6.2f} | {r['grpc_ttft_p50_ms']:13.2f} {r['http_ttft_p50_ms']:14.2f} "
              f"{r['ttft_overhead_p50_ms']:13.2f}")


if __name__ == "__main__":
    main()
