"""A decode call that ends early gives its handoff back, and only once the engine has let go of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVImporter, add_kv_transfer_service
from qwenserve.v1 import decode_pb2
from qwenserve.worker.decode_worker import DecodeWorker

TINY = {**TINY_CONFIG, "max_position_embeddings": 512}
PROMPT = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMEngine]:
    path = write_checkpoint(tmp_path_factory.mktemp("m") / "tiny", TINY, seed=3)
    engine = LLMEngine.from_pretrained(Path(path), EngineConfig(kv_cache_memory_gb=0.02, num_threads=1))
    yield engine
    engine.shutdown()


@asynccontextmanager
async def _exporter() -> AsyncIterator[KVExporter]:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    exporter = KVExporter(ExporterConfig(pool_bytes=1 << 20, control_endpoint=f"127.0.0.1:{port}")).start()
    add_kv_transfer_service(server, exporter)
    await server.start()
    try:
        yield exporter
    finally:
        await server.stop(None)
        exporter.close()


def _handoff_request(engine: LLMEngine, exporter: KVExporter, rid: str) -> decode_pb2.DecodeRequest:
    req = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT)
    req.sampling.temperature = 0.0
    req.sampling.max_tokens = 50
    req.sampling.ignore_eos = True
    req.prefilled.first_token_id = 7
    req.prefilled.kv_handle.CopyFrom(exporter.reserve(rid, engine.kv_layout(), len(PROMPT)).publish(lease_s=60))
    return req


async def _until_released(exporter: KVExporter, timeout_s: float = 10.0) -> None:
    give_up = time.monotonic() + timeout_s
    while exporter.counters().outstanding and time.monotonic() < give_up:
        await asyncio.sleep(0.01)
    assert exporter.counters().outstanding == 0, "the handoff was left to its lease"


async def test_a_call_cancelled_while_importing_releases_its_handoff(engine: LLMEngine) -> None:
    async with _exporter() as exporter:
        importer = KVImporter()
        try:
            stream = DecodeWorker(engine, importer).decode(_handoff_request(engine, exporter, "cancel-import"))
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # the call is inside its import
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            await stream.aclose()
            await _until_released(exporter)
        finally:
            await importer.close()


async def test_a_reader_that_leaves_after_the_first_tokens_releases_the_handoff_once(engine: LLMEngine) -> None:
    async with _exporter() as exporter:
        importer = KVImporter()
        try:
            stream = DecodeWorker(engine, importer).decode(_handoff_request(engine, exporter, "leave-early"))
            msg = await anext(stream)
            while not msg.token_ids:
                msg = await anext(stream)
            await stream.aclose()
            await _until_released(exporter)
            assert exporter.counters().released == 1
            assert not engine.holds("leave-early") or engine.wait_until_idle(10)
        finally:
            await importer.close()
