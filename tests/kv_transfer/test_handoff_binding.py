"""Handoffs bound to a token: ids nobody can guess, and a Fetch or Release without the token refused, counted,
and harmless to the handoff (its rightful importer still gets it; otherwise its lease frees it)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from qwenserve.handoff_binding import new_handoff_id, new_handoff_token
from qwenserve.kv_transfer import (
    KVExporter,
    KVHandoffGone,
    KVHandoffRefused,
    KVImporter,
    KVLayout,
    KVTransport,
    add_kv_transfer_service,
)
from qwenserve.telemetry.metrics import HandoffMetrics, handoff_metrics
from qwenserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

TOKEN = new_handoff_token()


class _Served:
    """An exporter behind a loopback KVTransfer server, with a metrics group of its own."""

    def __init__(self, exporter: KVExporter, metrics: HandoffMetrics, channel: grpc.aio.Channel) -> None:
        self.exporter = exporter
        self.metrics = metrics
        self.stub = kv_transfer_pb2_grpc.KVTransferStub(channel)

    def refusals(self, rpc: str, reason: str) -> float:
        return self.metrics.refusals.labels(rpc, reason)._value.get()

    async def fetch(self, handoff_id: str, token: str) -> bytes:
        chunks = [c.data async for c in self.stub.Fetch(
            kv_transfer_pb2.FetchRequest(handoff_id=handoff_id, handoff_token=token))]
        return b"".join(chunks)

    async def release(self, handoff_id: str, token: str, reason: str = "imported") -> bool:
        request = kv_transfer_pb2.ReleaseRequest(handoff_id=handoff_id, reason=reason, handoff_token=token)
        return (await self.stub.Release(request)).released


@pytest.fixture
async def served(make_exporter: Callable[..., KVExporter]) -> AsyncIterator[Callable[..., _Served]]:
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def start(transport: int = KVTransport.KV_TRANSPORT_GRPC) -> _Served:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        exporter = make_exporter(transport=transport, control_endpoint=f"127.0.0.1:{port}",
                                 use_shm=transport == KVTransport.KV_TRANSPORT_SHM)
        metrics = handoff_metrics(CollectorRegistry())
        add_kv_transfer_service(server, exporter, metrics=metrics)
        await server.start()
        servers.append(server)
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        return _Served(exporter, metrics, channels[-1])

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(grace=None)


def _publish(exporter: KVExporter, layout: KVLayout, kv: torch.Tensor, lease_s: float = 30.0,
             binding: str = TOKEN) -> tuple[str, object]:
    handoff_id = new_handoff_id("req-1")
    slot = exporter.reserve(handoff_id, layout, kv.shape[2], binding=binding)
    slot.tensor.copy_(kv)
    return handoff_id, slot.publish(lease_s=lease_s)


def test_handoff_ids_and_tokens_carry_128_random_bits() -> None:
    ids = {new_handoff_id("req-1") for _ in range(2000)}
    assert len(ids) == 2000
    for handoff_id in list(ids)[:20]:
        assert re.fullmatch(r"req-1-[0-9a-f]{32}", handoff_id)  # 32 hex digits: 128 bits
    tokens = {new_handoff_token() for _ in range(2000)}
    assert len(tokens) == 2000 and all(len(t) >= 22 for t in tokens)  # 22 base64 characters: 128 bits


def test_shm_segment_names_carry_128_random_bits(make_exporter) -> None:
    exporter = make_exporter()
    (region,) = exporter._pool.regions
    assert re.fullmatch(rf"{re.escape(exporter.config.segment_prefix)}-\d+-[0-9a-f]{{32}}-\d+", region.name)


@pytest.mark.parametrize("presented, reason", [("", "missing"), ("not-the-token", "wrong")])
async def test_a_fetch_without_the_bound_token_is_refused_counted_and_leaves_the_handoff(
    served, layout, make_kv, presented, reason
) -> None:
    s = await served()
    kv = make_kv(layout, 8)
    handoff_id, handle = _publish(s.exporter, layout, kv)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.fetch(handoff_id, presented)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert TOKEN not in err.value.details()
    assert s.refusals("Fetch", reason) == 1
    assert s.exporter.counters().outstanding == 1

    importer = KVImporter()
    try:
        assert torch.equal(await importer.fetch(handle, layout, token=TOKEN), kv)  # the rightful importer
        assert await importer.release(handle, "imported", token=TOKEN) is True
    finally:
        await importer.close()
    assert s.exporter.counters().outstanding == 0


@pytest.mark.parametrize("presented, reason", [("", "missing"), ("not-the-token", "wrong")])
async def test_a_release_without_the_bound_token_frees_nothing_and_the_lease_still_expires(
    served, layout, make_kv, presented, reason
) -> None:
    s = await served()
    # Long enough that both refusals come while it is held, on a CI machine busy with other tests.
    handoff_id, _ = _publish(s.exporter, layout, make_kv(layout, 4), lease_s=2.0)
    for why in ("imported", "cancelled"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.release(handoff_id, presented, why)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert s.refusals("Release", reason) == 2
    counts = s.exporter.counters()
    assert counts.outstanding == 1 and counts.released == 0

    give_up = time.monotonic() + 10
    while s.exporter.counters().reclaimed == 0:
        assert time.monotonic() < give_up, "the refused handoff's lease never expired"
        await asyncio.sleep(0.02)
    assert s.exporter.counters().outstanding == 0


async def test_the_importer_presents_its_token_and_a_wrong_one_is_refused_not_raised_on_release(
    served, layout, make_kv
) -> None:
    s = await served()
    kv = make_kv(layout, 4)
    _, handle = _publish(s.exporter, layout, kv)
    importer = KVImporter()
    try:
        with pytest.raises(KVHandoffRefused):
            await importer.fetch(handle, layout, token="guess")
        assert await importer.release(handle, "imported", token="guess") is False
        assert s.exporter.counters().outstanding == 1
        assert torch.equal(await importer.fetch(handle, layout, token=TOKEN), kv)
        assert await importer.release(handle, "imported", token=TOKEN) is True
    finally:
        await importer.close()
    assert s.refusals("Fetch", "wrong") == 1 and s.refusals("Release", "wrong") == 1


async def test_a_shm_handoff_is_released_only_with_its_token(served, layout, make_kv) -> None:
    s = await served(KVTransport.KV_TRANSPORT_SHM)
    kv = make_kv(layout, 4)
    handoff_id, handle = _publish(s.exporter, layout, kv)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.release(handoff_id, "")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    importer = KVImporter()
    try:
        assert torch.equal(await importer.fetch(handle, layout, token=TOKEN), kv)
        assert await importer.release(handle, "imported", token=TOKEN) is True
    finally:
        await importer.close()
    assert s.exporter.counters().outstanding == 0


async def test_a_caller_that_gave_up_cancels_by_token_before_or_after_the_handoff_is_made(
    served, layout, make_kv
) -> None:
    s = await served()
    # Before: the reservation that comes later is refused.
    early = new_handoff_token()
    assert await s.release("", early, "cancelled") is False
    with pytest.raises(KVHandoffGone, match="cancelled"):
        s.exporter.reserve(new_handoff_id("req-2"), layout, 4, binding=early)
    # After: the handoff bound to the token goes; one bound to another token stays.
    _publish(s.exporter, layout, make_kv(layout, 4))
    other_id, _ = _publish(s.exporter, layout, make_kv(layout, 4), binding=new_handoff_token())
    assert await s.release("", TOKEN, "cancelled") is True
    counts = s.exporter.counters()
    assert counts.outstanding == 1 and counts.released == 1
    assert s.exporter.release(other_id, "cancelled") is True  # the owner's own process needs no token


def test_the_exporter_checks_the_token_on_pin_and_release(make_exporter, layout, make_kv) -> None:
    exporter = make_exporter()
    handoff_id, _ = _publish(exporter, layout, make_kv(layout, 4))
    with pytest.raises(KVHandoffRefused) as err, exporter.pinned(handoff_id, token="nope"):
        pass
    assert err.value.reason == "wrong"
    with pytest.raises(KVHandoffRefused) as err:
        exporter.release(handoff_id, token="")
    assert err.value.reason == "missing"
    with exporter.pinned(handoff_id, token=TOKEN) as view:
        assert len(view) == layout.nbytes(4)
    assert exporter.release(handoff_id, token=TOKEN) is True


def test_an_unbound_handoff_is_named_by_its_id_alone(make_exporter, layout, make_kv) -> None:
    exporter = make_exporter()
    handoff_id, _ = _publish(exporter, layout, make_kv(layout, 4), binding="")
    with exporter.pinned(handoff_id, token="") as view:
        assert len(view) == layout.nbytes(4)
    assert exporter.release(handoff_id, token="anything") is True
