"""Checksums of handoff bytes, written "<algorithm>:<hex>" as in `KVHandle.checksum`.

The default, "xxh3_64x256k", is the xxh3_64 of the little-endian xxh3_64 digests of consecutive
256 KiB chunks. Chunks let every core hash its own share (one core reads about 32 GB/s here, two
about 44) and let the exporter hash each chunk right after copying it, while it is still in cache
(`fused_copy`): the exporter's hash then costs almost nothing beyond the copy, and the importer's
verification is one parallel read. Plain "xxh3_64" (whole buffer, one core) and "crc32" (zlib,
the fallback where the `xxhash` package is missing) are still produced and verified on request.
"none" skips hashing, for benchmarks only: importers refuse it unless told otherwise.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from qwenserve.kv_transfer.errors import KVChecksumMismatch

try:
    import xxhash
except ImportError:  # the fallback keeps handoffs verifiable without the optional package
    xxhash = None

NO_CHECKSUM = "none"
CHUNKED = "xxh3_64x256k"
#: Large enough that the per-call overhead vanishes, small enough to stay in L2 after a copy.
CHUNK_BYTES = 256 << 10
DEFAULT_ALGORITHM = CHUNKED if xxhash is not None else "crc32"
#: Below this a second thread costs more than it saves.
_PARALLEL_MIN_BYTES = 8 << 20
_threads = max(1, min(4, os.cpu_count() or 1))
_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(_threads, thread_name_prefix="kv-checksum")
    return _executor


def _as_array(data: torch.Tensor | memoryview) -> np.ndarray:
    if isinstance(data, memoryview):
        return np.frombuffer(data, dtype=np.uint8)
    if data.device.type != "cpu":
        raise ValueError("checksums are computed on host memory; move the tensor to the CPU first")
    if not data.is_contiguous():
        raise ValueError("checksums are computed on contiguous bytes; the tensor is strided")
    return data.detach().reshape(-1).view(torch.uint8).numpy()


def _ranges(nbytes: int) -> list[tuple[int, int]]:
    """Contiguous runs of whole chunks, one per thread (each thread reads sequentially)."""
    chunks = -(-nbytes // CHUNK_BYTES)
    parts = _threads if nbytes >= _PARALLEL_MIN_BYTES else 1
    per = -(-chunks // parts)
    return [(i * per, min(chunks, (i + 1) * per)) for i in range(parts) if i * per < chunks]


def _combine(digests: list[np.ndarray]) -> str:
    return f"{CHUNKED}:{xxhash.xxh3_64_hexdigest(np.concatenate(digests).astype('<u8').tobytes())}"


def _run(job: Callable[[int, int], np.ndarray], nbytes: int) -> list[np.ndarray]:
    """job(first_chunk, end_chunk) -> those chunks' digests, over every thread's range."""
    ranges = _ranges(nbytes)
    if len(ranges) == 1:
        return [job(*ranges[0])]
    return list(_pool().map(lambda r: job(*r), ranges))


def _chunked(dst: np.ndarray, src: np.ndarray | None = None) -> str:
    """The chunked checksum of `dst`; with `src`, each chunk is first copied from there (then hashed
    while still in cache)."""

    def job(first: int, end: int) -> np.ndarray:
        out = np.empty(end - first, dtype=np.uint64)
        for i in range(first, end):
            chunk = slice(i * CHUNK_BYTES, (i + 1) * CHUNK_BYTES)
            if src is not None:
                np.copyto(dst[chunk], src[chunk])
            out[i - first] = xxhash.xxh3_64_intdigest(dst[chunk])
        return out

    return _combine(_run(job, dst.nbytes))


def fused_copy(dst: torch.Tensor, src: torch.Tensor, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Copy src into dst (same number of bytes, both contiguous on the CPU) and return dst's checksum.

    For the chunked algorithm each chunk is hashed straight after it is copied, in parallel across
    cores, so the bytes are read from memory once; other algorithms copy, then hash."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"fused_copy: {src.nbytes} bytes into {dst.nbytes}")
    if algorithm != CHUNKED or xxhash is None:
        dst.copy_(src)
        return compute_checksum(dst, algorithm)
    return _chunked(_as_array(dst), _as_array(src))


def compute_checksum(data: torch.Tensor | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Checksum of the raw bytes of a contiguous CPU tensor or buffer, as "<algorithm>:<hex>"."""
    if algorithm == NO_CHECKSUM:
        return f"{NO_CHECKSUM}:"
    buf = _as_array(data)
    if algorithm in (CHUNKED, "xxh3_64"):
        if xxhash is None:
            raise ValueError(f"{algorithm} needs the `xxhash` package; install it or use crc32")
        if algorithm == CHUNKED:
            return _chunked(buf)
        return f"xxh3_64:{xxhash.xxh3_64_hexdigest(buf)}"
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(buf):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; use {CHUNKED}, xxh3_64, crc32 or none")


def verify_checksum(data: torch.Tensor | memoryview, expected: str, *, allow_none: bool = False) -> None:
    """Raise KVChecksumMismatch unless the bytes hash to `expected`."""
    algorithm, _, _ = expected.partition(":")
    if algorithm == NO_CHECKSUM:
        if allow_none:
            return
        raise KVChecksumMismatch(
            "KV handoff carries no checksum; the importer requires one (set require_checksum=False "
            "on the importer only for benchmarks)"
        )
    try:
        actual = compute_checksum(data, algorithm)
    except ValueError as e:
        raise KVChecksumMismatch(f"cannot verify KV handoff checksum {expected!r}: {e}") from e
    check_checksum(actual, expected)


def check_checksum(actual: str, expected: str) -> None:
    """Raise KVChecksumMismatch unless a checksum computed on arrival equals the published one."""
    if actual != expected:
        raise KVChecksumMismatch(
            f"KV handoff bytes are corrupted: checksum {actual} != published {expected}"
        )
