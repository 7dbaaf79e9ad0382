"""The decode worker over a real in-process engine: coalescing for slow readers, validation, no leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.v1 import decode_pb2
from qwenserve.worker.decode_worker import DecodeWorker
from qwenserve.worker.errors import BadRequest

TINY = {**TINY_CONFIG, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMEngine]:
    path = write_checkpoint(tmp_path_factory.mktemp("m") / "tiny", TINY, seed=3)
    engine = LLMEngine.from_pretrained(Path(path), EngineConfig(kv_cache_memory_gb=0.02, num_threads=1))
    yield engine
    engine.shutdown()


def _request(max_tokens: int, prompt: list[int] | None = None) -> decode_pb2.DecodeRequest:
    req = decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=prompt or [1, 2, 3, 4], local_prefill=True)
    req.sampling.temperature = 0.0
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    return req


def test_a_slow_reader_gets_several_tokens_per_message_and_nothing_is_lost(engine: LLMEngine) -> None:
    worker = DecodeWorker(engine, importer=None)

    async def read_slowly() -> list[decode_pb2.DecodeResponse]:
        msgs = []
        async for msg in worker.decode(_request(40)):
            msgs.append(msg)
            await asyncio.sleep(0.05)
        return msgs

    msgs = asyncio.run(read_slowly())
    assert sum(len(m.token_ids) for m in msgs) == 40
    assert max(len(m.token_ids) for m in msgs) > 1
    assert [bool(m.finish_reason) for m in msgs].count(True) == 1 and msgs[-1].finish_reason
    assert msgs[-1].usage.completion_tokens == 40
    assert engine.wait_until_idle(10) and engine.stats().kv_blocks_used == 0


def test_a_reader_that_leaves_frees_the_requests_blocks(engine: LLMEngine) -> None:
    worker = DecodeWorker(engine, importer=None)

    async def leave_early() -> None:
        stream = worker.decode(_request(400))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(leave_early())
    assert engine.wait_until_idle(10) and engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (decode_pb2.DecodeRequest(prompt_token_ids=[1, 2]), "local_prefill"),
        (_request(5, prompt=[10**7]), "vocabulary"),
        (_request(10_000), "context"),
    ],
)
def test_invalid_requests_are_refused_before_any_work(engine: LLMEngine, request_, fragment: str) -> None:
    worker = DecodeWorker(engine, importer=None)

    async def consume() -> None:
        async for _ in worker.decode(request_):
            pass

    with pytest.raises(BadRequest, match=fragment):
        asyncio.run(consume())


def test_a_stream_interval_packs_tokens_into_fewer_messages(engine: LLMEngine) -> None:
    async def collect(interval_s: float) -> list[decode_pb2.DecodeResponse]:
        worker = DecodeWorker(engine, importer=None, stream_interval_s=interval_s)
        return [m async for m in worker.decode(_request(60))]

    immediate, packed = asyncio.run(collect(0.0)), asyncio.run(collect(0.05))
    assert sum(len(m.token_ids) for m in packed) == sum(len(m.token_ids) for m in immediate) == 60
    assert len(packed) < len(immediate)
