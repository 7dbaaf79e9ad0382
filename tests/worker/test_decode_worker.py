"""The decode worker over a real in-process engine: coalescing for slow readers, validation, no leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.kv_transfer import (
    ExporterConfig,
    ImporterConfig,
    KVExporter,
    KVImporter,
    KVTransport,
    add_kv_transfer_service,
)
from qwenserve.protocol import kv_layout_to_proto
from qwenserve.request_limits import RequestOutOfLimits
from qwenserve.v1 import decode_pb2
from qwenserve.worker.decode_worker import DecodeWorker
from qwenserve.worker.errors import BadRequest, HandoffRefused
from tests.support.checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMEngine]:
    path = tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", seed=3, max_position_embeddings=512)
    engine = LLMEngine.from_pretrained(Path(path), EngineConfig(kv_cache_memory_gb=0.02, num_threads=1))
    yield engine
    engine.shutdown()


def _request(max_tokens: int, prompt: list[int] | None = None) -> decode_pb2.DecodeRequest:
    req = decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=prompt or [1, 2, 3, 4], local_prefill=True)
    req.sampling.temperature = 0.0
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    return req


def _with(request: decode_pb2.DecodeRequest, path: str, value: object) -> decode_pb2.DecodeRequest:
    """`request` with one field set (repeated fields get `value` appended)."""
    *parents, name = path.split(".")
    msg = request
    for parent in parents:
        msg = getattr(msg, parent)
    field = getattr(msg, name)
    if hasattr(field, "append"):
        field.append(value)
    else:
        setattr(msg, name, value)
    return request


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
        (_with(_request(5), "sampling.stop_token_ids", 4294967295), "stop_token_ids: token id 4294967295"),
        (_with(_request(5), "sampling.temperature", float("inf")), "temperature: must be a finite number"),
        (_with(_request(5), "sampling.repetition_penalty", float("nan")), "repetition_penalty"),
        (_with(_request(5), "request_id", "line\nbreak"), "request_id"),
        (_with(_request(5), "request_id", "é"), "request_id"),
        (_with(_request(5), "request_id", "x" * 300), "request_id"),
        (_with(_request(5), "cache_salt", "s" * 5000), "cache_salt"),
        (_with(_request(5), "resume_token_ids", 10**7), "resume token id"),
    ],
)
def test_invalid_requests_are_refused_before_any_work(engine: LLMEngine, request_, fragment: str) -> None:
    worker = DecodeWorker(engine, importer=None)

    async def consume() -> None:
        async for _ in worker.decode(request_):
            pass

    with pytest.raises((BadRequest, RequestOutOfLimits), match=fragment):
        asyncio.run(consume())


def test_a_stream_interval_packs_tokens_into_fewer_messages(engine: LLMEngine) -> None:
    async def collect(interval_s: float) -> list[decode_pb2.DecodeResponse]:
        worker = DecodeWorker(engine, importer=None, stream_interval_s=interval_s)
        return [m async for m in worker.decode(_request(60))]

    immediate, packed = asyncio.run(collect(0.0)), asyncio.run(collect(0.05))
    assert sum(len(m.token_ids) for m in packed) == sum(len(m.token_ids) for m in immediate) == 60
    assert len(packed) < len(immediate)


def _prefilled(engine: LLMEngine, location: str, transport: int) -> decode_pb2.DecodeRequest:
    """A request whose handle is well formed for this engine but names `location` over `transport`."""
    req = _request(5)
    start = req.prefilled
    start.first_token_id = 7
    handle = start.kv_handle
    handle.handoff_id, handle.transport, handle.location, handle.offset = "h", transport, location, 4096
    handle.layout.CopyFrom(kv_layout_to_proto(engine.kv_layout()))
    handle.num_tokens = 4
    handle.length = engine.kv_layout().nbytes(4)
    handle.checksum = "kvsum64x256k:00"
    handle.lease_expires_unix_ms = 2**62
    return req


@pytest.mark.parametrize(
    ("location", "transport", "fragment"),
    [("..", KVTransport.KV_TRANSPORT_SHM, "not a /dev/shm segment name"),
     ("qwenserve-kv-no-such-segment", KVTransport.KV_TRANSPORT_SHM, "is gone"),
     ("127.0.0.1:1", KVTransport.KV_TRANSPORT_MOONCAKE, "fetches only over"),
     ("unix:/tmp/x.sock", KVTransport.KV_TRANSPORT_GRPC, "not host:port")],
)
async def test_a_handle_that_cannot_be_used_is_refused_and_opens_nothing(
    engine: LLMEngine, location: str, transport: int, fragment: str
) -> None:
    importer = KVImporter(ImporterConfig(transports=frozenset({KVTransport.KV_TRANSPORT_SHM,
                                                               KVTransport.KV_TRANSPORT_GRPC})))
    try:
        with pytest.raises(HandoffRefused, match=fragment):
            async for _ in DecodeWorker(engine, importer).decode(_prefilled(engine, location, transport)):
                pass
        assert importer._mooncake is None and not importer._channels
    finally:
        await importer.close()


async def test_a_refused_handoff_is_released_at_once_not_left_to_its_lease(engine: LLMEngine) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    exporter = KVExporter(ExporterConfig(pool_bytes=1 << 20, control_endpoint=f"127.0.0.1:{port}")).start()
    add_kv_transfer_service(server, exporter)
    await server.start()
    importer = KVImporter()
    try:
        req = _prefilled(engine, "", KVTransport.KV_TRANSPORT_SHM)
        req.prefilled.kv_handle.CopyFrom(exporter.reserve("h", engine.kv_layout(), 3).publish(lease_s=30))
        with pytest.raises(HandoffRefused, match="holds 3 tokens, the prompt has 4"):
            async for _ in DecodeWorker(engine, importer).decode(req):
                pass
        assert exporter.counters().outstanding == 0 and exporter.counters().released == 1
    finally:
        await importer.close()
        await server.stop(None)
        exporter.close()
