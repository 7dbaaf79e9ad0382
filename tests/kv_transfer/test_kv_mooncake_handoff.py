"""The Mooncake Transfer Engine adapter over TCP on loopback (skipped where Mooncake is missing)."""

from __future__ import annotations

import pytest
import torch

from qwenserve.kv_transfer import (
    KVChecksumMismatch,
    KVHandoffGone,
    KVLayout,
    KVTransport,
    mooncake_unavailable_reason,
)

pytestmark = pytest.mark.skipif(mooncake_unavailable_reason() is not None, reason=str(mooncake_unavailable_reason()))

MiB = 1 << 20


async def test_mooncake_round_trip_reads_the_exporters_memory(grpc_exporter, importer, make_kv):
    layout = KVLayout("bfloat16", 16, 4, 4, 64, "fp")
    exporter = await grpc_exporter(transport=KVTransport.KV_TRANSPORT_MOONCAKE, pool_bytes=4 * MiB)
    kv = make_kv(layout, 300)
    slot = exporter.reserve("m1", layout, 300)
    slot.tensor.copy_(kv)
    handle = slot.publish(lease_s=30)
    assert handle.transport == KVTransport.KV_TRANSPORT_MOONCAKE

    assert torch.equal(await importer.fetch(handle, layout), kv)
    assert await importer.release(handle, "imported") is True
    with pytest.raises(KVHandoffGone, match="freed"):
        await importer.fetch(handle, layout)


async def test_mooncake_corruption_is_refused(grpc_exporter, importer, layout, make_kv):
    exporter = await grpc_exporter(transport=KVTransport.KV_TRANSPORT_MOONCAKE)
    slot = exporter.reserve("m1", layout, 16)
    slot.tensor.copy_(make_kv(layout, 16))
    handle = slot.publish(lease_s=30)
    slot.tensor.view(-1)[5] += 1
    with pytest.raises(KVChecksumMismatch):
        await importer.fetch(handle, layout)
    await importer.release(handle, "failed")
