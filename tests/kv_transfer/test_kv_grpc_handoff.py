"""Handoffs through a real grpc.aio KVTransfer server on loopback: Fetch streams, Release acks."""

from __future__ import annotations

import socket

import pytest
import torch

from qwenserve.kv_transfer import (
    ImporterConfig,
    KVChecksumMismatch,
    KVHandle,
    KVHandleInvalid,
    KVHandoffGone,
    KVImporter,
    KVLayout,
    KVLayoutMismatch,
    KVTransport,
)
from qwenserve.protocol import kv_layout_to_proto

MiB = 1 << 20


async def test_grpc_round_trip_streams_many_chunks_and_release_frees(grpc_exporter, make_kv):
    layout = KVLayout("bfloat16", 16, 4, 4, 64, "fp")  # 4 KiB per token
    exporter = await grpc_exporter()
    kv = make_kv(layout, 300)  # 1.2 MiB: about 19 chunks of 64 KiB
    slot = exporter.reserve("g1", layout, 300)
    slot.tensor.copy_(kv)
    handle = slot.publish(lease_s=30)
    assert handle.transport == KVTransport.KV_TRANSPORT_GRPC and handle.location == handle.control_endpoint

    importer = KVImporter(ImporterConfig(chunk_bytes=64 * 1024))
    try:
        fetched = await importer.fetch(handle, layout)
        assert torch.equal(fetched, kv)
        assert await importer.release(handle, "imported") is True
        assert await importer.release(handle, "imported") is False  # idempotent
    finally:
        await importer.close()
    assert exporter.counters().outstanding == 0 and exporter.counters().released == 1


async def test_grpc_fetch_of_a_released_handoff_is_gone(grpc_exporter, importer, layout):
    exporter = await grpc_exporter()
    handle = exporter.reserve("g1", layout, 4).publish(lease_s=30)
    assert await importer.release(handle) is True
    with pytest.raises(KVHandoffGone, match="no longer has"):
        await importer.fetch(handle, layout)


async def test_grpc_corruption_is_refused(grpc_exporter, importer, layout, make_kv):
    exporter = await grpc_exporter()
    slot = exporter.reserve("g1", layout, 16)
    slot.tensor.copy_(make_kv(layout, 16))
    handle = slot.publish(lease_s=30)
    slot.tensor.view(-1)[3] += 1
    with pytest.raises(KVChecksumMismatch):
        await importer.fetch(handle, layout)
    await importer.release(handle, "failed")


async def test_grpc_layout_mismatch_is_refused_before_any_bytes_move(grpc_exporter, importer, layout):
    exporter = await grpc_exporter()
    handle = exporter.reserve("g1", layout, 4).publish(lease_s=30)
    other = KVLayout(layout.dtype, layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim, "x")
    with pytest.raises(KVLayoutMismatch, match="model_fingerprint"):
        await importer.fetch(handle, other)
    await importer.release(handle, "failed")


async def test_shm_handoff_is_acked_through_the_control_endpoint(grpc_exporter, importer, layout, make_kv):
    exporter = await grpc_exporter(transport=KVTransport.KV_TRANSPORT_SHM)
    slot = exporter.reserve("s1", layout, 8)
    slot.tensor.copy_(make_kv(layout, 8))
    handle = slot.publish(lease_s=30)
    assert torch.equal(await importer.fetch(handle, layout), make_kv(layout, 8))
    assert await importer.release(handle, "imported") is True
    assert exporter.counters().released == 1 and exporter.counters().outstanding == 0


async def test_release_to_an_unreachable_exporter_gives_up_without_raising(layout):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    handle = KVHandle(handoff_id="h", control_endpoint=f"127.0.0.1:{dead_port}", layout=kv_layout_to_proto(layout))
    importer = KVImporter(ImporterConfig(release_attempts=2, release_timeout_s=0.3))
    try:
        assert await importer.release(handle, "imported") is False
    finally:
        await importer.close()


@pytest.mark.parametrize(
    ("field", "address"),
    [("location", "unix:/run/some.sock"), ("location", "dns:///example.com:1"), ("control_endpoint", "a\nb:1"),
     ("control_endpoint", "no-port"), ("location", "x" * 300 + ":1")],
)
async def test_a_handle_naming_an_address_that_is_not_host_port_is_refused_before_connecting(
    grpc_exporter, importer, layout, field, address
):
    exporter = await grpc_exporter()
    handle = exporter.reserve("g1", layout, 4).publish(lease_s=30)
    good = KVHandle()
    good.CopyFrom(handle)
    setattr(handle, field, address)
    with pytest.raises(KVHandleInvalid, match=field):
        await importer.fetch(handle, layout)
    assert address not in importer._channels
    assert await importer.release(good) is True


async def test_a_transport_the_importer_does_not_use_is_refused_and_opens_nothing(grpc_exporter, layout):
    exporter = await grpc_exporter()
    handle = exporter.reserve("g1", layout, 4).publish(lease_s=30)
    handle.transport = KVTransport.KV_TRANSPORT_MOONCAKE
    importer = KVImporter(ImporterConfig(transports=frozenset({KVTransport.KV_TRANSPORT_SHM})))
    try:
        with pytest.raises(KVHandleInvalid, match="only over KV_TRANSPORT_SHM"):
            await importer.fetch(handle, layout)
        assert importer._mooncake is None
        assert await importer.release(handle) is True
    finally:
        await importer.close()


async def test_channels_to_exporters_are_bounded_and_the_oldest_is_closed(layout):
    importer = KVImporter(ImporterConfig(max_channels=2, release_attempts=1, release_timeout_s=0.2))
    try:
        for port in (1, 2, 3):
            handle = KVHandle(handoff_id="h", control_endpoint=f"127.0.0.1:{port}", layout=kv_layout_to_proto(layout))
            assert await importer.release(handle) is False
        assert list(importer._channels) == ["127.0.0.1:2", "127.0.0.1:3"]
    finally:
        await importer.close()
    assert not importer._closing
