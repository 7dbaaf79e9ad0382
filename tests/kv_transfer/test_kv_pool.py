"""The extent allocator behind the exporter's memory pool, and the checksum helpers."""

from __future__ import annotations

import pytest
import torch

from qwenserve.kv_transfer import KVChecksumMismatch, compute_checksum, verify_checksum
from qwenserve.kv_transfer.checksum import CHUNK_BYTES, KVSUM, fused_copy
from qwenserve.kv_transfer.pool import PAGE, ExtentAllocator


def test_extents_are_page_aligned_and_freed_space_coalesces():
    extents = ExtentAllocator(8 * PAGE)
    a = extents.allocate(1)
    b = extents.allocate(PAGE + 1)
    c = extents.allocate(PAGE)
    assert (a, b, c) == (0, PAGE, 3 * PAGE)
    assert extents.allocate(5 * PAGE) is None  # only 4 pages left
    extents.free(b, PAGE + 1)
    extents.free(a, 1)
    assert extents.allocate(3 * PAGE) == 0  # a and b merged into 3 pages
    extents.free(0, 3 * PAGE)
    extents.free(c, PAGE)
    assert extents.used == 0 and extents.allocate(8 * PAGE) == 0


def test_a_double_free_is_an_error():
    extents = ExtentAllocator(4 * PAGE)
    offset = extents.allocate(PAGE)
    extents.free(offset, PAGE)
    with pytest.raises(ValueError, match="double free"):
        extents.free(offset, PAGE)


@pytest.mark.parametrize("algorithm", [KVSUM, "crc32"])
def test_checksums_detect_a_single_bit_flip(algorithm):
    data = torch.arange(4096, dtype=torch.int32)
    checksum = compute_checksum(data, algorithm)
    assert checksum.startswith(f"{algorithm}:")
    verify_checksum(data, checksum)
    data[100] ^= 1 << 20
    with pytest.raises(KVChecksumMismatch):
        verify_checksum(data, checksum)


def test_an_unknown_checksum_algorithm_is_a_mismatch_not_a_crash():
    with pytest.raises(KVChecksumMismatch, match="sha9"):
        verify_checksum(torch.zeros(4), "sha9:00")


@pytest.mark.parametrize("algorithm", [KVSUM, "crc32"])
@pytest.mark.parametrize("nbytes", [1, CHUNK_BYTES - 1, CHUNK_BYTES, 3 * CHUNK_BYTES + 5, 40 * CHUNK_BYTES + 3])
def test_fused_copy_copies_and_hashes_like_a_copy_then_a_hash(nbytes, algorithm):
    # 40 chunks and more cross the sizes where the chunks are split across threads and the copy streams.
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    checksum = fused_copy(dst, src, algorithm)
    assert torch.equal(dst, src)
    assert checksum == compute_checksum(src, algorithm)
    for position in {0, nbytes // 2, nbytes - 1}:
        dst[position] ^= 0x10
        with pytest.raises(KVChecksumMismatch, match="corrupted"):
            verify_checksum(dst, checksum)
        dst[position] ^= 0x10
    verify_checksum(dst, checksum)


@pytest.mark.parametrize("algorithm", [KVSUM, "crc32"])
def test_chunked_checksum_depends_on_chunk_order(algorithm):
    a = torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8)
    b = torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8)
    assert compute_checksum(torch.cat([a, b]), algorithm) != compute_checksum(torch.cat([b, a]), algorithm)


def test_checksums_refuse_strided_tensors_and_mismatched_copies():
    with pytest.raises(ValueError, match="contiguous"):
        compute_checksum(torch.zeros(8, 8)[:, 0], KVSUM)
    with pytest.raises(ValueError, match="bytes into"):
        fused_copy(torch.zeros(4), torch.zeros(5))
