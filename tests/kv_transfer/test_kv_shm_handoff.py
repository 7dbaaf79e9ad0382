"""Shared-memory handoffs in one process: round trip, verification, release, memory accounting."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat

import pytest
import torch

from qwenserve.kv_transfer import (
    ImporterConfig,
    KVChecksumMismatch,
    KVHandoffExists,
    KVHandoffGone,
    KVImporter,
    KVLayout,
    KVLayoutInvalid,
    KVLayoutMismatch,
    KVPoolExhausted,
    compute_checksum,
    leaked_segments,
)
from qwenserve.kv_transfer.checksum import CHUNK_BYTES, STEP_BYTES
from qwenserve.kv_transfer.shm import SHM_DIR

MiB = 1 << 20


async def test_shm_round_trip_returns_exactly_the_exported_kv(make_exporter, importer, layout, make_kv):
    exporter = make_exporter()
    kv = make_kv(layout, 37)
    slot = exporter.reserve("h1", layout, 37)
    assert slot.tensor.shape == layout.token_shape(37) and slot.tensor.dtype == torch.float16
    slot.tensor.copy_(kv)
    handle = slot.publish(lease_s=30)

    assert handle.location.startswith(exporter.config.segment_prefix)
    assert handle.offset % 4096 == 0 and handle.length == layout.nbytes(37)
    assert handle.checksum.startswith("kvsum64x256k:")
    fetched = await importer.fetch(handle, layout)
    assert torch.equal(fetched, kv)
    assert exporter.release("h1", "imported") is True
    counters = exporter.counters()
    assert (counters.outstanding, counters.published, counters.released) == (0, 1, 1)
    assert counters.bytes_published == layout.nbytes(37)


async def test_slot_write_hashes_as_it_copies_and_out_fetch_verifies(make_exporter, importer, layout, make_kv):
    exporter = make_exporter()
    kv = make_kv(layout, 300)
    slot = exporter.reserve("h1", layout, 300)
    slot.write(kv)
    handle = slot.publish(lease_s=30)
    assert handle.checksum == compute_checksum(kv, exporter.config.checksum)
    out = torch.empty_like(kv)
    fetched = await importer.fetch(handle, layout, out=out)
    assert torch.equal(fetched.view(kv.dtype).view(kv.shape), kv) and torch.equal(out, kv)
    with pytest.raises(KVLayoutInvalid, match="cannot write"):
        exporter.reserve("h2", layout, 2).write(kv)
    exporter.release("h1")
    exporter.release("h2")


async def test_slot_gather_takes_a_paged_cache_and_hashes_as_it_lands(make_exporter, importer, layout, make_kv):
    exporter = make_exporter()
    cache = make_kv(layout, 400)  # an engine's cache seen as [L, 2, slots, H, D]
    rows = torch.cat([torch.arange(32, 64), torch.arange(300, 316), torch.arange(0, 16)])
    slot = exporter.reserve("h1", layout, rows.numel())
    slot.gather(cache, rows)
    expected = cache[:, :, rows]
    handle = slot.publish(lease_s=30)
    assert handle.checksum == compute_checksum(expected.contiguous(), exporter.config.checksum)
    assert torch.equal(await importer.fetch(handle, layout), expected)
    with pytest.raises(KVLayoutInvalid, match="cannot gather"):
        exporter.reserve("h2", layout, rows.numel()).gather(cache.float(), rows)
    exporter.release("h1")
    exporter.release("h2")


async def test_export_slot_is_a_view_over_the_shared_segment(make_exporter, layout):
    exporter = make_exporter()
    slot = exporter.reserve("h1", layout, 4)
    slot.tensor.fill_(1.5)
    handle = slot.publish(lease_s=30)
    with open(SHM_DIR / handle.location, "rb") as f:
        f.seek(handle.offset)
        raw = f.read(handle.length)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float16), torch.full((handle.length // 2,), 1.5,
                                                                                          dtype=torch.float16))
    exporter.release("h1")


async def test_segments_are_owner_only(make_exporter, layout):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    mode = os.stat(SHM_DIR / handle.location).st_mode
    assert stat.S_IMODE(mode) == 0o600
    exporter.release("h1")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
async def test_other_dtypes_round_trip(make_exporter, importer, layout, make_kv, dtype):
    layout = dataclasses.replace(layout, dtype=dtype)
    exporter = make_exporter()
    kv = make_kv(layout, 9)
    slot = exporter.reserve("h1", layout, 9)
    slot.tensor.copy_(kv)
    fetched = await importer.fetch(slot.publish(lease_s=30), layout)
    assert fetched.dtype == kv.dtype and torch.equal(fetched, kv)
    exporter.release("h1")


@pytest.mark.parametrize(("tokens", "checksum", "step"), [
    (16, "kvsum64x256k", STEP_BYTES),
    (20_000, "kvsum64x256k", CHUNK_BYTES),
    (20_000, "crc32", STEP_BYTES),
], ids=["one-step-on-the-loop", "in-steps-on-the-loop", "on-a-worker-thread"])
async def test_a_flipped_byte_is_refused_with_checksum_mismatch(make_exporter, layout, make_kv, tokens, checksum, step):
    exporter = make_exporter(checksum=checksum)
    importer = KVImporter(ImporterConfig(hash_step_bytes=step))
    slot = exporter.reserve("h1", layout, tokens)
    slot.tensor.copy_(make_kv(layout, tokens))
    handle = slot.publish(lease_s=30)
    assert handle.checksum.startswith(f"{checksum}:")
    verified = await importer.fetch(handle, layout)
    slot.tensor.view(-1).view(torch.uint8)[-1234] ^= 0x01
    with pytest.raises(KVChecksumMismatch, match="corrupted"):
        await importer.fetch(handle, layout)
    with pytest.raises(KVChecksumMismatch, match="corrupted"):  # the copying path verifies too
        await importer.fetch(handle, layout, out=torch.empty_like(slot.tensor))
    slot.tensor.view(-1).view(torch.uint8)[-1234] ^= 0x01
    assert torch.equal(await importer.fetch(handle, layout, out=torch.empty_like(slot.tensor)), verified)
    exporter.release("h1")
    await importer.close()


async def test_the_event_loop_runs_between_hashing_steps(make_exporter, layout, make_kv):
    exporter = make_exporter()
    importer = KVImporter(ImporterConfig(hash_step_bytes=CHUNK_BYTES))
    slot = exporter.reserve("h1", layout, 20_000)
    slot.write(make_kv(layout, 20_000))
    handle = slot.publish(lease_s=30)
    steps = -(-handle.length // CHUNK_BYTES)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await importer.fetch(handle, layout)
    assert ticks - before >= steps - 1  # another task ran between every two steps
    await importer.fetch(handle, layout, out=torch.empty_like(slot.tensor))
    task.cancel()
    exporter.release("h1")
    await importer.close()


async def test_a_tampered_checksum_is_refused(make_exporter, importer, layout):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    algorithm = handle.checksum.partition(":")[0]
    handle.checksum = f"{algorithm}:{'0' * 8}"
    with pytest.raises(KVChecksumMismatch):
        await importer.fetch(handle, layout)
    exporter.release("h1")


async def test_a_handle_without_checksum_is_refused_by_default(make_exporter, importer, layout):
    exporter = make_exporter(checksum="none")
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    with pytest.raises(KVChecksumMismatch, match="no checksum"):
        await importer.fetch(handle, layout)
    exporter.release("h1")


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "another-model"},
        {"num_kv_heads": 4},
        {"head_dim": 16},
        {"dtype": "bfloat16"},
        {"num_layers": 3},
    ],
)
async def test_an_incompatible_layout_is_refused(make_exporter, importer, layout, change):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    expected = dataclasses.replace(layout, **change)
    with pytest.raises(KVLayoutMismatch, match=next(iter(change))):
        await importer.fetch(handle, expected)
    exporter.release("h1")


async def test_a_different_block_size_is_compatible_because_handoffs_are_token_major(
    make_exporter, importer, layout, make_kv
):
    exporter = make_exporter()
    slot = exporter.reserve("h1", layout, 5)
    slot.tensor.copy_(make_kv(layout, 5))
    handle = slot.publish(lease_s=30)
    fetched = await importer.fetch(handle, dataclasses.replace(layout, block_size=32))
    assert torch.equal(fetched, make_kv(layout, 5))
    exporter.release("h1")


async def test_a_length_that_does_not_fit_the_token_count_is_refused(make_exporter, importer, layout):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    handle.num_tokens = 5
    with pytest.raises(KVLayoutMismatch, match="cannot hold"):
        await importer.fetch(handle, layout)
    exporter.release("h1")


async def test_release_is_idempotent_and_unknown_ids_are_not_errors(make_exporter, layout):
    exporter = make_exporter()
    exporter.reserve("h1", layout, 4).publish(lease_s=30)
    assert exporter.release("h1", "imported") is True
    assert exporter.release("h1", "imported") is False
    assert exporter.release("never-existed", "cancelled") is False
    assert exporter.counters().released == 1


async def test_a_released_handoff_is_gone_even_when_its_memory_is_reused(make_exporter, importer, layout, make_kv):
    exporter = make_exporter()
    old = exporter.reserve("old", layout, 8)
    old.tensor.copy_(make_kv(layout, 8, seed=1))
    old_handle = old.publish(lease_s=30)
    exporter.release("old")
    new = exporter.reserve("new", layout, 8)
    new.tensor.copy_(make_kv(layout, 8, seed=2))
    new_handle = new.publish(lease_s=30)
    assert (new_handle.location, new_handle.offset) == (old_handle.location, old_handle.offset)
    with pytest.raises(KVHandoffGone, match="freed"):
        await importer.fetch(old_handle, layout)
    assert torch.equal(await importer.fetch(new_handle, layout), make_kv(layout, 8, seed=2))
    exporter.release("new")


async def test_an_expired_handle_is_gone_without_touching_memory(make_exporter, importer, layout):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    handle.lease_expires_unix_ms -= 60_000
    with pytest.raises(KVHandoffGone, match="expired"):
        await importer.fetch(handle, layout)
    exporter.release("h1")


async def test_a_missing_segment_is_gone(importer, layout, make_exporter):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    handle.location = "qwenserve-kvtest-no-such-segment"
    with pytest.raises(KVHandoffGone, match="gone"):
        await importer.fetch(handle, layout)
    exporter.release("h1")


async def test_fetch_into_out_gives_a_private_copy(make_exporter, importer, layout, make_kv):
    exporter = make_exporter()
    kv = make_kv(layout, 8)
    slot = exporter.reserve("h1", layout, 8)
    slot.tensor.copy_(kv)
    handle = slot.publish(lease_s=30)
    out = torch.empty(layout.token_shape(8), dtype=layout.torch_dtype())
    fetched = await importer.fetch(handle, layout, out=out)
    assert fetched.data_ptr() == out.data_ptr() and torch.equal(out, kv)
    exporter.release("h1")
    slot.tensor.zero_()  # the exporter reusing its memory must not change the copy
    assert torch.equal(out, kv)


async def test_duplicate_handoff_ids_are_refused(make_exporter, layout):
    exporter = make_exporter()
    slot = exporter.reserve("h1", layout, 4)
    with pytest.raises(KVHandoffExists):
        exporter.reserve("h1", layout, 4)
    slot.abort()
    assert exporter.counters().aborted == 1 and exporter.counters().outstanding == 0


async def test_memory_beyond_max_bytes_is_refused_until_released(make_exporter):
    big = KVLayout("float32", 16, 4, 8, 128, "fp")  # 32 KiB per token
    exporter = make_exporter(pool_bytes=MiB, max_bytes=3 * MiB)
    in_pool = exporter.reserve("a", big, 30)
    overflow = exporter.reserve("b", big, 40)
    with pytest.raises(KVPoolExhausted, match="max_bytes"):
        exporter.reserve("c", big, 40)
    overflow.abort()
    exporter.reserve("c", big, 40).abort()
    in_pool.abort()
    assert exporter.counters().outstanding == 0


async def test_a_handoff_larger_than_the_pool_gets_its_own_segment_which_goes_with_release(
    make_exporter, importer, make_kv
):
    big = KVLayout("float32", 16, 4, 8, 128, "fp")
    exporter = make_exporter(pool_bytes=MiB)
    slot = exporter.reserve("big", big, 64)  # 2 MiB
    slot.tensor.copy_(make_kv(big, 64))
    handle = slot.publish(lease_s=30)
    assert handle.location in leaked_segments(exporter.config.segment_prefix)
    assert torch.equal(await importer.fetch(handle, big), make_kv(big, 64))
    exporter.release("big")
    await importer.release(handle)  # no control endpoint here: only forgets the mapping
    assert handle.location not in leaked_segments(exporter.config.segment_prefix)


async def test_a_handoff_bigger_than_the_pool_reserved_in_inference_mode_publishes_outside_it(
    make_exporter, importer, make_kv
):
    # An engine reserves and fills its handoff on its compute thread, inside torch.inference_mode(); publish
    # runs later on the event loop. An overflow region made there was once an inference tensor: unwritable.
    big = KVLayout("float32", 16, 4, 8, 128, "fp")
    exporter = make_exporter(pool_bytes=MiB)
    kv = make_kv(big, 64)  # 2 MiB
    with torch.inference_mode():
        slot = exporter.reserve("big", big, 64)
        slot.write(kv)
    handle = slot.publish(lease_s=30)
    assert torch.equal(await importer.fetch(handle, big), kv)
    exporter.release("big")
    await importer.release(handle)


@pytest.mark.parametrize("name", ["..", "a/b", "x" * 300, "no\nnewline", "a-directory", "an-empty-file"])
async def test_a_location_that_is_not_a_segment_is_gone_not_an_os_error(importer, layout, make_exporter, name):
    exporter = make_exporter()
    handle = exporter.reserve("h1", layout, 4).publish(lease_s=30)
    made = None  # something in /dev/shm this test creates, under its own prefix
    if name in ("a-directory", "an-empty-file"):
        made = SHM_DIR / f"{exporter.config.segment_prefix}-{name}"
        if name == "a-directory":
            made.mkdir()
        else:
            made.touch()
        name = made.name
    handle.location = name
    try:
        with pytest.raises(KVHandoffGone):
            await importer.fetch(handle, layout)
    finally:
        if made is not None and made.is_dir():
            made.rmdir()
        elif made is not None:
            made.unlink()
    exporter.release("h1")


async def test_closing_the_exporter_unlinks_its_segments(make_exporter, layout):
    exporter = make_exporter()
    exporter.reserve("h1", layout, 4).publish(lease_s=30)
    assert leaked_segments(exporter.config.segment_prefix)
    exporter.close()
    assert leaked_segments(exporter.config.segment_prefix) == []


async def test_an_import_leaves_no_openmp_workers_on_the_thread_that_hashed_it(make_exporter, importer, make_kv):
    """Hashing a large handoff starts OpenMP workers on the importing thread (the event loop's); kept, they would
    outnumber the cores beside the engine's and make libgomp sleep at the end of every parallel region of its
    decode steps. The import hands them back."""
    if importer.kernels is None or torch.get_num_threads() < 2:
        pytest.skip("needs the C kernels and two threads: hashing is serial otherwise")
    layout = KVLayout(dtype="float16", block_size=16, num_layers=4, num_kv_heads=8, head_dim=128,
                      model_fingerprint="fp-large")
    exporter = make_exporter(pool_bytes=32 * MiB)
    kv = make_kv(layout, 1024)  # 16 MiB: hashed by every thread
    slot = exporter.reserve("h1", layout, 1024)
    slot.write(kv)
    handle = slot.publish(lease_s=30)
    importer.kernels.release_thread_pool()  # whatever this thread started before
    before = len(os.listdir("/proc/self/task"))
    fetched = await importer.fetch(handle, layout)
    assert len(os.listdir("/proc/self/task")) == before  # counted before any other parallel work on this thread
    assert torch.equal(fetched, kv)
    exporter.release("h1")
