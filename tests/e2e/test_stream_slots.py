"""The router's bound on requests in flight per decode worker (the latency preset's), through real processes:
a request beyond it waits before prefill, so its first token comes after a slot frees and its stream never
stalls; a wait that runs out is a retryable resource_exhausted; a client that leaves gives its slot back."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from pathlib import Path

import grpc

from qwenserve.launcher import LocalCluster
from qwenserve.v1 import router_pb2, router_pb2_grpc
from tests.support.clusters import make_cluster


def _request(i: int, max_tokens: int) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(prompt=f"Request {i}: tell me about the sea.")
    request.sampling.max_tokens = max_tokens
    request.sampling.ignore_eos = True
    request.sampling.temperature = 0.0
    return request


async def _times(stub: router_pb2_grpc.RouterStub, i: int, max_tokens: int) -> tuple[float, float, int, str]:
    """(first token, last message) as time.monotonic(), tokens received, the terminal error code."""
    first, tokens, code = None, 0, ""
    async for msg in stub.Generate(_request(i, max_tokens), timeout=120):
        if msg.token_ids and first is None:
            first = time.monotonic()
        tokens += len(msg.token_ids)
        if msg.finish_reason:
            code = msg.error.code
    return first or 0.0, time.monotonic(), tokens, code


def _queued(cluster: LocalCluster) -> float:
    """The router's qwenserve_router_queued_requests, summed over its models."""
    router = next(c for c in cluster.children if c.name == "router")
    text = urllib.request.urlopen(f"http://{cluster.host}:{router.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("qwenserve_router_queued_requests{"))


def test_a_request_beyond_the_bound_waits_before_prefill_then_streams_and_a_long_wait_is_refused(
        tiny_model: Path, tmp_path: Path) -> None:
    with make_cluster(tiny_model, tmp_path, prefill=1, decode=1,
                      extra_router_args=["--max-streams-per-decode-worker", "1", "--max-queue-wait-s", "3"]) as cluster:

        async def run() -> None:
            async with grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                # Two short answers at once: the second's first token comes only after the first has ended.
                a = asyncio.create_task(_times(stub, 0, 40))
                await asyncio.sleep(0.05)
                b = asyncio.create_task(_times(stub, 1, 40))
                (_, a_end, a_tokens, a_code), (b_first, _, b_tokens, b_code) = await asyncio.gather(a, b)
                assert a_tokens == b_tokens == 40 and a_code == b_code == ""
                assert b_first >= a_end - 0.05, "the second request started while the first still held the slot"

                # An answer holds the slot while its decode worker is stopped; one behind it waits, counted, and
                # is refused when the wait ends.
                decode = next(c for c in cluster.children if c.name.startswith("decode")).process
                assert decode is not None
                long_call = stub.Generate(_request(2, 1000), timeout=120)
                first = await long_call.read()
                assert first.token_ids
                decode.send_signal(signal.SIGSTOP)
                try:
                    waiting = asyncio.create_task(_times(stub, 3, 10))
                    await asyncio.sleep(1.0)
                    assert _queued(cluster) == 1
                    _, _, tokens, code = await waiting
                    assert tokens == 0 and code == "resource_exhausted"
                    assert _queued(cluster) == 0
                finally:
                    decode.send_signal(signal.SIGCONT)

                # The long answer's client leaves: its slot is free for the next request at once.
                long_call.cancel()
                _, _, tokens, code = await _times(stub, 4, 10)
                assert tokens == 10 and code == ""

        asyncio.run(run())

