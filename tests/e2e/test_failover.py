"""Workers die mid-flight: streams continue on another worker with exactly the tokens they would have had."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.launcher import LocalCluster
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.clusters import WORKER_ENV, make_cluster

STREAM_TOKENS = 300


def _request(ids: list[int], max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest()
    req.prompt_token_ids.ids.extend(ids)
    req.sampling.temperature = 0.0
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    return req


def _prompts() -> list[list[int]]:
    return [[(97 * i + 13 * j) % 150_000 for j in range(20 + 7 * i)] for i in range(8)]


def _reference(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # The workers' precision (WORKER_ENV): under `auto` a start-up probe picks bf16 or fp32 for the tiny model by a
    # few microseconds either way, and the tokens of the two differ.
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.1, num_threads=1,
                                                           dtype=WORKER_ENV["QWENSERVE_DTYPE"]))
    try:
        return engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        engine.shutdown()


async def _streams_with_kill(cluster: LocalCluster, prompts: list[list[int]], victim: str, max_tokens: int
                             ) -> list[tuple[list[int], router_pb2.GenerateResponse, float]]:
    """Start one stream per prompt, kill -9 `victim` once every stream has tokens, collect the results."""
    started = asyncio.Event()
    have_tokens: set[int] = set()
    killed_at: list[float] = []

    async def one(i: int, stub: router_pb2_grpc.RouterStub) -> tuple[list[int], router_pb2.GenerateResponse, float]:
        tokens: list[int] = []
        last = None
        async for msg in stub.Generate(_request(prompts[i], max_tokens), timeout=120):
            tokens.extend(msg.token_ids)
            last = msg
            if len(tokens) >= 2:
                have_tokens.add(i)
                if len(have_tokens) == len(prompts):
                    started.set()
        return tokens, last, time.monotonic()

    async def killer() -> None:
        await asyncio.wait_for(started.wait(), 60)
        cluster.child(victim).process.send_signal(signal.SIGKILL)
        killed_at.append(time.monotonic())

    async with grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        results = await asyncio.gather(*[one(i, stub) for i in range(len(prompts))], killer())
    return [(t, m, done - killed_at[0]) for t, m, done in results[:-1]]


def test_killing_a_decode_worker_mid_stream_loses_and_duplicates_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompts = _prompts()
    expected = _reference(tiny_model, prompts, STREAM_TOKENS)
    with make_cluster(tiny_model, tmp_path, prefill=1, decode=2) as cluster:
        results = asyncio.run(_streams_with_kill(cluster, prompts, "decode-0", STREAM_TOKENS))
        for (tokens, last, _), want in zip(results, expected, strict=True):
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert tokens == want
            assert last.usage.completion_tokens == STREAM_TOKENS

        # With the last decode worker gone too, every stream ends with one clean error, quickly.
        results = asyncio.run(_streams_with_kill(cluster, prompts, "decode-1", STREAM_TOKENS))
        for tokens, last, after_kill in results:
            assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert last.error.code == "no_decode_worker"
            assert after_kill < 2.0
            assert len(tokens) < STREAM_TOKENS


def test_a_killed_prefill_worker_is_retried_elsewhere_without_client_errors(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompts = _prompts()
    expected = _reference(tiny_model, prompts, 8)
    with make_cluster(tiny_model, tmp_path, prefill=2, decode=1) as cluster:
        cluster.child("prefill-0").process.send_signal(signal.SIGKILL)
        cluster.child("prefill-0").process.wait()

        async def run() -> list[list[int]]:
            async with grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)

                async def one(p: list[int]) -> list[int]:
                    msgs = [m async for m in stub.Generate(_request(p, 8), timeout=60)]
                    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                    return [t for m in msgs for t in m.token_ids]

                return list(await asyncio.gather(*[one(p) for p in prompts]))

        assert asyncio.run(run()) == expected
