"""Router relay capacity on one core, with decode offering more tokens than the router can pass.

    .venv/bin/python bench/relay_bench.py [--streams 256] [--step-ms 10] [--stream-interval-ms 0,50,100]

A CPU decode worker here makes a few thousand tokens/s, far below what a router core relays, so
it cannot show the router's limit. This bench puts a token source in front of the real router: the
real Decode service (`DecodeServicer` + `DecodeWorker`, which coalesces what the engine made since
its last message, at most every --stream-interval-ms) over a stand-in engine that, like a GPU decode batch, emits one token for every running
stream each `--step-ms`. The router process is pinned to core 0, source and client share core 1.

Reported, in one run:
  direct   the client reading the source's Decode streams itself (no router): the baseline
  router   the same streams through the router: tokens/s delivered, the router's CPU use, tokens per
           router CPU-second (its capacity on one core), tokens per message on the client's side
The router relays as it does in production: incremental detokenization, stop strings, usage.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.engine.outputs import RequestOutput, TokenCounts
from qwenserve.launcher import wait_serving
from qwenserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from qwenserve.worker.decode_worker import DecodeWorker
from qwenserve_services.decode.server import DecodeServicer

sys.path.insert(0, str(Path(__file__).parent))
from disagg_bench import _cpu_seconds, _pin  # noqa: E402  (a sibling script: the same helpers)

VOCAB = 151_000  # ordinary tokens of the Qwen vocabulary: the source never emits special ids


class _ModelConfig:
    vocab_size = TINY_CONFIG["vocab_size"]


class StepEngine:
    """Stands in for LLMEngine.generate: every `step_s`, one new token for every running request."""

    model_config = _ModelConfig()
    max_model_len = 1 << 20

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._running: dict[str, tuple[asyncio.Queue[RequestOutput], list[int]]] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.steps = 0

    async def _tick(self) -> None:
        next_at = time.perf_counter()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            self.steps += 1
            for request_id, (queue, state) in list(self._running.items()):
                produced, limit, prompt_len, seed = state
                token = (seed * 7919 + produced * 104_729) % VOCAB
                state[0] = produced = produced + 1
                finished = produced >= limit
                queue.put_nowait(RequestOutput(
                    request_id, [token], None, finished, "length" if finished else None,
                    TokenCounts(prompt_len, produced, 0),
                ))
                if finished:
                    del self._running[request_id]

    async def generate(self, request_id: str, prompt: list[int], sampling: Any, **_: Any) -> AsyncIterator[RequestOutput]:
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick())
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._running[request_id] = (queue, [0, sampling.max_tokens or 16, len(prompt), hash(request_id) & 0xFFFF])
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self._running.pop(request_id, None)


async def serve_source(port: int, step_ms: float, interval_ms: float) -> None:
    server = grpc.aio.server()
    engine = StepEngine(step_ms / 1000)
    worker = DecodeWorker(engine, importer=None, stream_interval_s=interval_ms / 1000)
    decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


# --- the client -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _drive(call_one: Any, streams: int, duration_s: float) -> tuple[int, int, float]:
    """Keep `streams` requests open for `duration_s`; (tokens, messages, seconds)."""
    stop = time.perf_counter() + duration_s
    tokens = messages = 0

    async def worker(i: int) -> None:
        nonlocal tokens, messages
        n = 0
        while time.perf_counter() < stop:
            n += 1
            async for msg in call_one(i * 100_000 + n):
                tokens += len(msg.token_ids)
                messages += 1

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(i) for i in range(streams)])
    return tokens, messages, time.perf_counter() - t0


async def measure(args: argparse.Namespace, interval_ms: float, source: str, router: str, router_pid: int) -> None:
    prompt = list(range(1000, 1016))
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    print(f"decode --stream-interval-ms {interval_ms:g}")
    async with grpc.aio.insecure_channel(source) as sch, grpc.aio.insecure_channel(router) as rch:
        decode, front = decode_pb2_grpc.DecodeStub(sch), router_pb2_grpc.RouterStub(rch)

        def direct(n: int) -> Any:
            return decode.Decode(decode_pb2.DecodeRequest(
                request_id=f"d{n}", prompt_token_ids=prompt, sampling=sampling, local_prefill=True))

        def routed(n: int) -> Any:
            return front.Generate(router_pb2.GenerateRequest(
                prompt_token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling))

        baseline = 0.0
        for name, call in (("direct", direct), ("router", routed)):
            await _drive(call, min(args.streams, 16), 1.0)  # warm-up: channels, caches
            cpu0 = _cpu_seconds(router_pid)
            tokens, messages, seconds = await _drive(call, args.streams, args.duration)
            cpu = _cpu_seconds(router_pid) - cpu0
            line = (f"  {name:7s} {tokens / seconds:9,.0f} tokens/s delivered  {tokens / max(messages, 1):5.1f} "
                    "tokens/message")
            if name == "router":
                line += (f"  router CPU {cpu / seconds:4.0%} of a core -> {tokens / cpu:9,.0f} tokens per router "
                         f"CPU-second; router / direct {tokens / seconds / baseline:.2f}")
            else:
                baseline = tokens / seconds
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per request")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the source's decode step")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--stream-interval-ms", default="0,50,100",
                        help="the decode service's --stream-interval-ms values to compare (comma-separated)")
    parser.add_argument("--serve-source", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_source:
        asyncio.run(serve_source(args.serve_source, args.step_ms, float(args.stream_interval_ms)))
        return

    offered = args.streams / (args.step_ms / 1000)
    print(f"{args.streams} streams x {args.tokens} tokens, a step every {args.step_ms:g} ms: the source offers "
          f"{offered:,.0f} tokens/s. Router pinned to core 0; source and client on core 1.\n"
          "Capacity on one core = tokens per router CPU-second (target >= 50,000).\n")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(Path(tmp) / "tiny", TINY_CONFIG)
        tokenizer_port = _free_port()
        tokenizer = subprocess.Popen([sys.executable, "-m", "qwenserve.cli", "serve", "tokenizer",
                                      "--model", str(model), "--port", str(tokenizer_port), "--log-level", "warning"])
        try:
            for interval_ms in (float(v) for v in args.stream_interval_ms.split(",")):
                source_port, router_port = _free_port(), _free_port()
                source = subprocess.Popen(
                    [sys.executable, __file__, "--serve-source", str(source_port), "--step-ms",
                     str(args.step_ms), "--stream-interval-ms", str(interval_ms)],
                    stdout=subprocess.PIPE, text=True,
                )
                router = subprocess.Popen(
                    [sys.executable, "-m", "qwenserve.cli", "serve", "router", "--model", str(model),
                     "--port", str(router_port), "--decode", f"127.0.0.1:{source_port}", "--no-auth",
                     "--tokenizer", f"127.0.0.1:{tokenizer_port}", "--log-level", "warning"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                try:
                    assert source.stdout.readline().strip() == "ready"
                    _pin(router.pid, "0")
                    _pin(source.pid, "1")
                    _pin(os.getpid(), "1")
                    wait_serving(f"127.0.0.1:{router_port}", time.monotonic() + 60, router, "router")
                    asyncio.run(measure(args, interval_ms, f"127.0.0.1:{source_port}",
                                        f"127.0.0.1:{router_port}", router.pid))
                finally:
                    for p in (router, source):
                        p.terminate()
                    for p in (router, source):
                        p.wait(timeout=30)
        finally:
            tokenizer.terminate()
            tokenizer.wait(timeout=30)


if __name__ == "__main__":
    main()
