"""The kvsum64x256k handoff checksum: the C kernel (every build) equals the NumPy definition, the value is
stable across releases, and what corruption looks like is caught."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from qwenserve.cpu_kernels import builder, loader
from qwenserve.kv_transfer import KVChecksumMismatch, compute_checksum, verify_checksum
from qwenserve.kv_transfer import checksum as kvsum
from qwenserve.kv_transfer.checksum import CHUNK_BYTES, KVSUM, fused_copy, gather_copy, kvsum_steps

needs_kernels = pytest.mark.skipif(loader.load() is None, reason="the C kernels cannot be built here")
SIZES = [0, 1, 63, 64, 65, 4095, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 69, 5 * CHUNK_BYTES + 17]


def reference(data: np.ndarray) -> str:
    """The definition, chunk by chunk in NumPy and Python, with no threads and no kernel."""
    digests = [kvsum._kvsum_chunk_numpy(data[i : i + CHUNK_BYTES]) for i in range(0, data.nbytes, CHUNK_BYTES)]
    return f"{KVSUM}:{kvsum._fold(data.nbytes, np.array(digests, dtype=np.uint64)):016x}"


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_the_checksum_of_known_bytes_never_changes():
    # Prefill and decode of different releases must agree: a change of definition needs a new name.
    data = torch.arange(3 * CHUNK_BYTES + 100, dtype=torch.int64).remainder(251).to(torch.uint8)
    assert compute_checksum(data, KVSUM) == reference(data.numpy()) == f"{KVSUM}:4d58cce8639f0d80"


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("nbytes", SIZES)
def test_checksum_and_fused_copy_equal_the_definition(nbytes: int, kernels: bool):
    lib = loader.load() if kernels else None
    src = random_bytes(nbytes, nbytes)
    expected = reference(src.numpy())
    assert compute_checksum(src, KVSUM, kernels=lib) == expected
    # A destination off the 64-byte grid takes the ordinary stores; an aligned one past the streaming size,
    # the non-temporal ones.
    for offset in (0, 1):
        dst = torch.zeros(nbytes + 64, dtype=torch.uint8)[offset : offset + nbytes]
        assert fused_copy(dst, src, KVSUM, kernels=lib) == expected
        assert torch.equal(dst, src)


@needs_kernels
def test_streamed_copies_across_threads_equal_the_definition(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kvsum, "_PARALLEL_MIN_BYTES", CHUNK_BYTES)
    monkeypatch.setattr(kvsum, "_STREAM_MIN_BYTES", CHUNK_BYTES)
    src = random_bytes(9 * CHUNK_BYTES + 3, 9)
    dst = torch.zeros_like(src)
    lib = loader.load()
    assert fused_copy(dst, src, KVSUM, kernels=lib) == reference(src.numpy()) == compute_checksum(dst, KVSUM, kernels=lib)
    assert torch.equal(dst, src)


def finish(steps) -> tuple[str, int]:
    """A kvsum_steps generator's checksum and how many times it yielded."""
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, yields
        yields += 1


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("step", [CHUNK_BYTES, 3 * CHUNK_BYTES, 100, 64 * CHUNK_BYTES])
def test_hashing_in_steps_gives_the_checksum_of_one_pass(step: int, kernels: bool, monkeypatch: pytest.MonkeyPatch):
    lib = loader.load() if kernels else None
    monkeypatch.setattr(kvsum, "_PARALLEL_MIN_BYTES", 2 * CHUNK_BYTES)  # several threads within a step
    monkeypatch.setattr(kvsum, "_STREAM_MIN_BYTES", 4 * CHUNK_BYTES)
    for nbytes in (0, 17, CHUNK_BYTES, 10 * CHUNK_BYTES + 5):
        src = random_bytes(nbytes, nbytes)
        chunks = -(-nbytes // CHUNK_BYTES)
        per_step = max(1, step // CHUNK_BYTES)
        expected_yields = max(0, -(-chunks // per_step) - 1)
        assert finish(kvsum_steps(src, step_bytes=step, kernels=lib)) == (reference(src.numpy()), expected_yields)
        dst = torch.zeros_like(src)
        assert finish(kvsum_steps(dst, src, step, kernels=lib))[0] == reference(src.numpy())
        assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="bytes into"):
        finish(kvsum_steps(torch.zeros(5, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8)))


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "numpy"])
@pytest.mark.parametrize(("planes", "slots", "rows", "row_shape", "dtype"), [
    (4, 300, 150, (8, 16), torch.float16),  # 256-byte rows: hashed as they are copied
    (6, 2000, 1200, (2, 64), torch.float32),  # 512-byte rows crossing chunk boundaries, several chunks
    (2, 90, 40, (3, 5), torch.float16),  # 30-byte rows: gathered, then hashed
    (2, 10, 0, (4, 16), torch.float32),  # nothing to gather
])
def test_a_gather_hashes_what_it_writes(planes, slots, rows, row_shape, dtype, kernels,
                                        monkeypatch: pytest.MonkeyPatch):
    lib = loader.load() if kernels else None
    generator = torch.Generator().manual_seed(rows)
    src = torch.randn(planes, slots, *row_shape, generator=generator).to(dtype)
    index = torch.randperm(slots, generator=generator)[:rows]
    index[: rows // 2] = torch.arange(rows // 2) + 7  # a run of adjacent slots, moved as one piece
    expected = torch.index_select(src, 1, index)
    for parallel, stream in ((1 << 40, 1 << 40), (2 * CHUNK_BYTES, 2 * CHUNK_BYTES)):
        monkeypatch.setattr(kvsum, "_PARALLEL_MIN_BYTES", parallel)
        monkeypatch.setattr(kvsum, "_STREAM_MIN_BYTES", stream)
        for offset in (0, 2):  # a destination off the 64-byte grid is gathered, then hashed
            dst = torch.zeros(expected.numel() + 64, dtype=dtype)[offset : offset + expected.numel()]
            dst = dst.view(expected.shape)
            assert gather_copy(dst, src, index, kernels=lib) == reference(expected.contiguous().view(-1).view(torch.uint8).numpy())
            assert torch.equal(dst, expected)


def test_a_gather_refuses_what_does_not_fit():
    src, dst = torch.zeros(2, 10, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="outside"):
        gather_copy(dst, src, torch.tensor([0, 1, 10]))
    with pytest.raises(ValueError, match="rows"):
        gather_copy(dst, src, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cannot gather"):
        gather_copy(torch.zeros(2, 3, 5), src, torch.tensor([0, 1, 2]))
    assert gather_copy(dst, src, torch.tensor([0, 1, 2]), "crc32").startswith("crc32:")


@needs_kernels
@pytest.mark.parametrize("march", [
    "generic",
    pytest.param("x86-64-v3", marks=pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86")),
])
def test_every_build_of_the_kernel_gives_the_same_digests(march: str, tmp_path: Path):
    flags = ["-O3", "-std=gnu11", "-fPIC", "-shared"] + ([] if march == "generic" else [f"-march={march}"])
    target = tmp_path / f"{march}.so"
    # Its own source alone: the whole library took ~12 s of a core per build.
    builder.build(shutil.which("cc") or shutil.which("gcc") or "cc", flags, target,
                  sources=(builder.SOURCES[0].with_name("kv_checksum.c"),))
    lib = ctypes.CDLL(str(target))
    lib.kv_checksum_chunks.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 2
    src = random_bytes(3 * CHUNK_BYTES + 77, 3).numpy()
    expected = [kvsum._kvsum_chunk_numpy(src[i : i + CHUNK_BYTES]) for i in range(0, src.nbytes, CHUNK_BYTES)]
    for stream in (0, 1):
        dst, digests = np.zeros(src.nbytes, dtype=np.uint8), np.zeros(4, dtype=np.uint64)
        lib.kv_checksum_chunks(src.ctypes.data, dst.ctypes.data, src.nbytes, CHUNK_BYTES, digests.ctypes.data, stream, 2)
        assert digests.tolist() == expected and np.array_equal(dst, src)
    lib.kv_checksum_chunks(src.ctypes.data, None, src.nbytes, CHUNK_BYTES, digests.ctypes.data, 0, 1)
    assert digests.tolist() == expected


def test_corruption_of_every_kind_is_caught():
    data = random_bytes(3 * CHUNK_BYTES, 7)
    checksum = compute_checksum(data, KVSUM)
    gen = torch.Generator().manual_seed(1)
    for position in torch.randint(0, data.numel(), (64,), generator=gen).tolist():
        for bit in (0, 7):
            data[position] ^= 1 << bit
            with pytest.raises(KVChecksumMismatch, match="corrupted"):
                verify_checksum(data, checksum)
            data[position] ^= 1 << bit
    verify_checksum(data, checksum)

    def swapped(width: int, i: int, j: int) -> bool:
        """Whether swapping two `width`-byte pieces changes the checksum."""
        copy = data.clone()
        pieces = copy.view(-1, width)
        assert not torch.equal(pieces[i], pieces[j])
        pieces[[i, j]] = pieces[[j, i]].clone()
        return compute_checksum(copy, KVSUM) != checksum

    assert swapped(64, 5, 9)  # two stripes of a chunk
    assert swapped(64, 5, CHUNK_BYTES // 64 + 5)  # the same stripe of two chunks
    assert swapped(8, 0, 1)  # two words of a stripe
    assert swapped(CHUNK_BYTES, 0, 2)  # two chunks

    def changed(edit) -> bool:
        copy = data.clone()
        edit(copy)
        return compute_checksum(copy, KVSUM) != checksum

    assert changed(lambda d: d[:CHUNK_BYTES].zero_())  # a chunk lost
    assert compute_checksum(torch.cat([data, torch.zeros(1, dtype=torch.uint8)]), KVSUM) != checksum  # length
    assert compute_checksum(torch.zeros(64, dtype=torch.uint8), KVSUM) != compute_checksum(
        torch.zeros(65, dtype=torch.uint8), KVSUM
    )
