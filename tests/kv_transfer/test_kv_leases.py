"""Leases: what is never acknowledged is reclaimed by the sweeper, and nothing outlives it."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from qwenserve.kv_transfer import KVHandoffGone, KVLayout, leaked_segments

MiB = 1 << 20


async def wait_until(condition, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_lease_never_acked_is_reclaimed_and_its_segment_disappears(make_exporter, importer, make_kv):
    big = KVLayout("float32", 16, 4, 8, 128, "fp")
    exporter = make_exporter(pool_bytes=MiB)
    slot = exporter.reserve("never-acked", big, 64)  # 2 MiB: a segment of its own
    slot.tensor.copy_(make_kv(big, 64))
    handle = slot.publish(lease_s=0.5)
    assert handle.location in leaked_segments(exporter.config.segment_prefix)

    await wait_until(lambda: exporter.counters().reclaimed == 1)
    assert exporter.counters().outstanding == 0
    assert handle.location not in leaked_segments(exporter.config.segment_prefix)
    with pytest.raises(KVHandoffGone):
        await importer.fetch(handle, big)
    assert exporter.release("never-acked") is False  # a late ack is harmless


async def test_an_expired_lease_in_the_pool_returns_its_memory(make_exporter, importer, layout):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 8).publish(lease_s=0.1)
    await wait_until(lambda: exporter.counters().reclaimed == 1)
    handle.lease_expires_unix_ms += 60_000  # even a handle that lies about its lease is refused
    with pytest.raises(KVHandoffGone, match="freed"):
        await importer.fetch(handle, layout)
    assert exporter._pool.reserved_bytes == 0


async def test_a_reservation_never_published_is_reclaimed(make_exporter, layout):
    exporter = make_exporter(reserve_timeout_s=0.1)
    slot = exporter.reserve("crashed-forward-pass", layout, 8)
    await wait_until(lambda: exporter.counters().reclaimed == 1)
    with pytest.raises(KVHandoffGone, match="freed"):
        slot.publish(lease_s=30)


async def test_a_lease_that_is_acked_in_time_is_not_reclaimed(make_exporter, layout):
    exporter = make_exporter()
    exporter.reserve("h1", layout, 8).publish(lease_s=30)
    assert exporter.sweep(now=time.monotonic() + 29) == 0
    assert exporter.release("h1") is True
    assert exporter.sweep(now=time.monotonic() + 31) == 0
    assert exporter.counters().reclaimed == 0


async def test_bytes_being_streamed_survive_lease_expiry_until_the_stream_ends(make_exporter, layout, make_kv):
    exporter = make_exporter(sweep_interval_s=3600)
    slot = exporter.reserve("h1", layout, 8)
    slot.tensor.copy_(make_kv(layout, 8))
    slot.publish(lease_s=30)
    with exporter.pinned("h1") as view:
        assert exporter.sweep(now=time.monotonic() + 31) == 1
        other = exporter.reserve("h2", layout, 8)  # must not reuse the pinned bytes
        other.tensor.zero_()
        assert torch.equal(torch.frombuffer(view, dtype=torch.float16).view(layout.token_shape(8)), make_kv(layout, 8))
    other.abort()
    assert exporter._pool.reserved_bytes == 0


def test_a_name_cancelled_before_it_is_reserved_is_refused_until_the_reservation_timeout(make_exporter, layout):
    """A router that gave up on a stopped prefill cancels the handoff by name; the worker, resumed, must not
    publish it for nobody (it would stay leased to its expiry)."""
    exporter = make_exporter(reserve_timeout_s=0.5)
    assert exporter.release("gave-up", "cancelled") is False
    with pytest.raises(KVHandoffGone, match="cancelled by its caller"):
        exporter.reserve("gave-up", layout, 8)
    assert exporter.counters().outstanding == 0
    exporter.reserve("gave-up", layout, 8).abort()  # refused once: a caller reusing the name later is served

    # Only a cancel remembers a name (an importer's late ack does not), and only until reserve_timeout_s.
    assert exporter.release("acked-late", "imported") is False
    exporter.reserve("acked-late", layout, 8).abort()
    exporter.release("expired", "cancelled")
    exporter.sweep(now=time.monotonic() + 1.0)
    exporter.reserve("expired", layout, 8).abort()
    assert exporter.counters().outstanding == 0
