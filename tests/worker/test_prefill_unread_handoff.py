"""A prefill call whose deadline passed while its handoff was being published frees the handoff at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from qwenserve.kv_layout import KVLayout
from qwenserve.kv_transfer import ExporterConfig, KVExporter
from qwenserve.v1 import prefill_pb2, prefill_pb2_grpc
from qwenserve_services.prefill.server import PrefillServicer

LAYOUT = KVLayout(dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=32,
                  model_fingerprint="test")


class _BusyWorker:
    """Publishes a handoff after holding the event loop past the caller's deadline, as a stopped process or
    a long synchronous step does: no cancellation reaches the handler before it returns."""

    def __init__(self, exporter: KVExporter) -> None:
        self.exporter = exporter
        self.engine = SimpleNamespace()

    async def prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        await asyncio.sleep(0.05)
        time.sleep(1.0)  # the caller's deadline passes meanwhile
        handle = self.exporter.reserve(request.request_id, LAYOUT, 4).publish(lease_s=60)
        return prefill_pb2.PrefillResponse(request_id=request.request_id, first_token_id=1, kv_handle=handle)


async def test_a_handoff_published_after_the_callers_deadline_is_freed_at_once() -> None:
    exporter = KVExporter(ExporterConfig(pool_bytes=1 << 20, control_endpoint="127.0.0.1:1")).start()
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(_BusyWorker(exporter)), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(prefill_pb2.PrefillRequest(request_id="late"), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        give_up = time.monotonic() + 10
        while (exporter.counters().released == 0) and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        counts = exporter.counters()
        assert counts.released == 1 and counts.outstanding == 0, counts
    finally:
        await server.stop(None)
        exporter.close()
