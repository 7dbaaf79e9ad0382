"""The prefill worker over a real in-process engine and exporter: every failure is an error the router can act
on (never an answer without a first token or a handoff), and nothing it reserved outlives the request."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import EngineDeadError
from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVHandoffRefused
from qwenserve.v1 import common_pb2, prefill_pb2
from qwenserve.worker.errors import BadRequest, Overloaded, PrefillFailed, grpc_status
from qwenserve.worker.prefill_worker import PrefillWorker
from tests.support.checkpoints import tiny_checkpoint

MiB = 1 << 20


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMEngine]:
    path = tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", seed=3, max_position_embeddings=512)
    engine = LLMEngine.from_pretrained(Path(path), EngineConfig(kv_cache_memory_gb=0.02, num_threads=1))
    yield engine
    engine.shutdown()


def _exporter(kind: type[KVExporter], pool_bytes: int = MiB, max_bytes: int = 4 * MiB) -> KVExporter:
    """Private memory, gRPC handles: nothing in /dev/shm (no decode worker fetches in these tests)."""
    return kind(ExporterConfig(pool_bytes=pool_bytes, max_bytes=max_bytes, use_shm=False,
                               transport=common_pb2.KV_TRANSPORT_GRPC, control_endpoint="127.0.0.1:1")).start()


@pytest.fixture
def exporter() -> Iterator[KVExporter]:
    exporter = _exporter(KVExporter)
    yield exporter
    assert exporter.counters().outstanding == 0, "a handoff outlived its request"
    exporter.close()


def _request(prompt_len: int, request_id: str = "p") -> prefill_pb2.PrefillRequest:
    req = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=list(range(1, prompt_len + 1)))
    req.sampling.temperature = 0.0
    req.sampling.max_tokens = 8
    req.sampling.ignore_eos = True
    return req


async def test_a_handoff_that_fits_nowhere_is_resource_exhausted(engine: LLMEngine) -> None:
    small = 64 << 10
    exporter = _exporter(KVExporter, pool_bytes=small, max_bytes=small)
    try:
        too_long = small // engine.kv_layout().nbytes(1) + 8  # more than max_bytes can ever hold
        with pytest.raises(Overloaded, match="no room for the KV handoff") as info:
            await PrefillWorker(engine, exporter).prefill(_request(too_long))
        assert grpc_status(info.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert exporter.counters().outstanding == 0
    finally:
        exporter.close()


class _UnpublishableExporter(KVExporter):
    """A real exporter whose publish fails, as the inference-tensor bug once made every large one fail."""

    def _publish(self, entry: object, lease_s: float) -> object:
        raise RuntimeError("Inplace update to inference tensor outside InferenceMode")


async def test_a_handoff_that_cannot_be_published_is_an_internal_error_and_frees_its_memory(
    engine: LLMEngine,
) -> None:
    exporter = _exporter(_UnpublishableExporter)
    try:
        with pytest.raises(PrefillFailed, match="could not be published: RuntimeError") as info:
            await PrefillWorker(engine, exporter).prefill(_request(5))
        assert grpc_status(info.value)[0] == grpc.StatusCode.INTERNAL
        assert exporter.counters().outstanding == 0 and exporter.counters().aborted == 1
    finally:
        exporter.close()


async def test_a_request_the_engine_fails_is_an_internal_error_not_an_empty_answer(
    engine: LLMEngine, exporter: KVExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.step.sampler

    def sampler(logits, rows):
        if any(r.params.seed == 13 for r in rows):
            raise ValueError("this row cannot be sampled")
        return real(logits, rows)

    monkeypatch.setattr(engine.step, "sampler", sampler)
    req = _request(5)
    req.sampling.seed = 13
    with pytest.raises(PrefillFailed, match="sampling failed: ValueError: this row cannot be sampled"):
        await PrefillWorker(engine, exporter).prefill(req)
    monkeypatch.undo()
    response = await PrefillWorker(engine, exporter).prefill(_request(5, "next"))
    assert response.HasField("kv_handle") and exporter.release(response.kv_handle.handoff_id)


def test_each_kind_of_failure_has_one_status() -> None:
    assert grpc_status(EngineDeadError("loop failed"))[0] == grpc.StatusCode.UNAVAILABLE
    code, detail = grpc_status(KeyError("surprise"))
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in detail.message and detail.code == "internal_error"
    code, detail = grpc_status(Overloaded("no room for the KV handoff"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and (detail.code, detail.retryable) == ("overloaded", True)


async def test_the_handoff_is_named_at_random_and_bound_to_the_callers_token(
    engine: LLMEngine, exporter: KVExporter
) -> None:
    req = _request(5, "known-id")
    req.handoff_token = "the-routers-secret"
    handle = (await PrefillWorker(engine, exporter).prefill(req)).kv_handle
    assert re.fullmatch(r"known-id-[0-9a-f]{32}", handle.handoff_id)  # 128 random bits after the request id
    with pytest.raises(KVHandoffRefused), exporter.pinned(handle.handoff_id, token=""):
        pass
    with pytest.raises(KVHandoffRefused):
        exporter.release(handle.handoff_id, token="known-id")
    assert exporter.release(handle.handoff_id, token="the-routers-secret")


async def test_a_handoff_token_longer_than_any_router_makes_is_refused(engine: LLMEngine, exporter: KVExporter) -> None:
    req = _request(5)
    req.handoff_token = "x" * 10_000
    with pytest.raises(BadRequest, match="handoff_token"):
        await PrefillWorker(engine, exporter).prefill(req)
