"""Checksums of handoff bytes, written "<algorithm>:<hex>" as in `KVHandle.checksum`.

The default, "kvsum64x256k", is our own: per chunk of up to 256 KiB, read as 64-byte stripes of eight
little-endian 64-bit words w[s][j] (a last partial stripe padded with zeros),

    d = w[s][j] ^ (KEY0[j] + s * KEY_STEP)
    acc[j] = ACC0[j] + sum over s of  lo32(d) * hi32(d) + w[s][j ^ 1]        (all mod 2^64)
    digest = fold(length, acc[0..7]),   checksum = fold(total length, digest of every chunk in order)

where fold(h0, x...) is h = mix64(h ^ x) over the xs, from h = h0 ^ LENGTH_SEED (mix64 is a bijection).
Any one changed word changes lane j ^ 1 by exactly its difference, so it never goes unnoticed; keys that move
with every stripe, and the ordered fold, make moved stripes and chunks count. Its inner step (an xor, a
32x32->64 multiply and two adds per 64 bytes) runs far faster than memory, so with the C kernel
(cpu_kernels/kv_checksum.c) hashing costs the read of the bytes, and a copy that hashes what it moves
(`fused_copy`) costs the copy: large copies stream past the cache, which skips reading each destination line
before it is overwritten. Chunks let every core take a share. The kernels are a value the caller hands in
(`kernels`: a cpu_kernels CpuKernels, the exporter's and importer's); without them NumPy computes the same digests
(slower; tested equal).

The one standard fallback, "crc32" (zlib's), is computed and verified on request. "none" skips hashing, for
benchmarks only: importers refuse it unless told otherwise.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.kv_transfer.errors import KVChecksumMismatch

NO_CHECKSUM = "none"
KVSUM = "kvsum64x256k"
DEFAULT_ALGORITHM = KVSUM
#: Large enough that the per-call overhead vanishes, small enough to stay in L2 after a copy.
CHUNK_BYTES = 256 << 10
#: Below this a second thread costs more than it saves.
_PARALLEL_MIN_BYTES = 8 << 20
#: Copies this large leave the cache before anyone reads them: stream them past it.
_STREAM_MIN_BYTES = 4 << 20
_MAX_THREADS = 4
#: `kvsum_steps` hashes this much between yields: 0.4-0.7 ms at memory speed here. Each step costs ~30 us
#: more (a fork and join of the threads, and the slower thread waited for): 8 MiB steps cost 64 MiB 20%.
STEP_BYTES = 32 << 20
_executor: ThreadPoolExecutor | None = None

_MASK64 = (1 << 64) - 1
_KEY0 = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x2545F4914F6CDD1D,
                  0x5851F42D4C957F2D, 0x14057B7EF767814F, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F], dtype=np.uint64)
_ACC0 = np.arange(1, 9, dtype=np.uint64)
_KEY_STEP = np.uint64(0xE7037ED1A0B428DB)
_LENGTH_SEED = 0x8EBC6AF09C88C6E3
_LOW32 = np.uint64(0xFFFFFFFF)
_SWAP_PAIRS = np.array([1, 0, 3, 2, 5, 4, 7, 6])


def _mix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK64
    return h ^ (h >> 33)


def _fold(length: int, values: np.ndarray) -> int:
    h = length ^ _LENGTH_SEED
    for value in values.tolist():
        h = _mix64(h ^ value)
    return h


def _kvsum_chunk_numpy(chunk: np.ndarray) -> int:
    """One chunk's kvsum digest, the reference the C kernel is tested against."""
    words = np.zeros(-(-chunk.nbytes // 64) * 8, dtype="<u8")
    words.view(np.uint8)[: chunk.nbytes] = chunk
    w = words.reshape(-1, 8)
    d = w ^ (_KEY0 + np.arange(w.shape[0], dtype=np.uint64)[:, None] * _KEY_STEP)
    acc = _ACC0 + ((d & _LOW32) * (d >> np.uint64(32))).sum(0, dtype=np.uint64)
    acc += w[:, _SWAP_PAIRS].sum(0, dtype=np.uint64)
    return _fold(chunk.nbytes, acc)


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="kv-checksum")
    return _executor


def _threads() -> int:
    """The cores this process may run on (asked each time: a worker may be pinned after import), at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cores))


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
    parts = _threads() if nbytes >= _PARALLEL_MIN_BYTES else 1
    per = -(-chunks // parts)
    return [(i * per, min(chunks, (i + 1) * per)) for i in range(parts) if i * per < chunks]


def _run(job: Callable[[int, int], np.ndarray], nbytes: int) -> np.ndarray:
    """job(first_chunk, end_chunk) -> those chunks' digests, over every thread's range, in order."""
    ranges = _ranges(nbytes)
    if not ranges:
        return np.empty(0, dtype=np.uint64)
    if len(ranges) == 1:
        return job(*ranges[0])
    return np.concatenate(list(_pool().map(lambda r: job(*r), ranges)))


def _kvsum_chunks(dst: np.ndarray, src: np.ndarray | None, digests: np.ndarray, first: int, end: int,
                  stream: bool, kernels: CpuKernels | None) -> None:
    """Chunks [first, end) of `dst` hashed into digests[first:end]; with `src`, copied from there as they are."""
    nbytes = dst.nbytes
    start, stop = first * CHUNK_BYTES, min(nbytes, end * CHUNK_BYTES)
    if kernels is not None:  # one call; its OpenMP threads split the chunks, with the GIL released
        threads = _threads() if stop - start >= _PARALLEL_MIN_BYTES else 1
        kernels.lib.kv_checksum_chunks((dst if src is None else src).ctypes.data + start,
                                       None if src is None else dst.ctypes.data + start, stop - start, CHUNK_BYTES,
                                       digests.ctypes.data + 8 * first, stream, threads)
        return

    def job(lo: int, hi: int) -> np.ndarray:
        out = np.empty(hi - lo, dtype=np.uint64)
        for i in range(lo, hi):
            chunk = slice(i * CHUNK_BYTES, min(nbytes, (i + 1) * CHUNK_BYTES))
            if src is not None:
                np.copyto(dst[chunk], src[chunk])
            out[i - lo] = _kvsum_chunk_numpy(dst[chunk])
        return out

    digests[first:end] = _run(lambda lo, hi: job(first + lo, first + hi), stop - start)


def _kvsum_fold(digests: np.ndarray, nbytes: int, kernels: CpuKernels | None) -> str:
    if kernels is not None:
        return f"{KVSUM}:{kernels.lib.kv_checksum_combine(digests.ctypes.data, digests.size, nbytes):016x}"
    return f"{KVSUM}:{_fold(nbytes, digests):016x}"


def _kvsum(dst: np.ndarray, src: np.ndarray | None, kernels: CpuKernels | None) -> str:
    """The kvsum of `dst`; with `src`, each chunk is copied from there into `dst` as it is hashed."""
    digests = np.empty(-(-dst.nbytes // CHUNK_BYTES), dtype=np.uint64)
    _kvsum_chunks(dst, src, digests, 0, digests.size, dst.nbytes >= _STREAM_MIN_BYTES, kernels)
    return _kvsum_fold(digests, dst.nbytes, kernels)


def kvsum_steps(dst: torch.Tensor | memoryview, src: torch.Tensor | memoryview | None = None,
                step_bytes: int = STEP_BYTES, *, kernels: CpuKernels | None = None) -> Generator[None, None, str]:
    """The kvsum of `dst` (with `src`: copied from there first, as `fused_copy` does), `step_bytes` at a time.

    A generator that yields between steps and returns the checksum: an event loop can hash a large handoff
    itself, letting other callbacks run in between, where a hop to a worker thread and back costs two thread
    wake-ups. Steps are whole chunks, so the digests are those of a single pass."""
    out, source = _as_array(dst), None if src is None else _as_array(src)
    if source is not None and source.nbytes != out.nbytes:
        raise ValueError(f"kvsum_steps: {source.nbytes} bytes into {out.nbytes}")
    digests = np.empty(-(-out.nbytes // CHUNK_BYTES), dtype=np.uint64)
    per_step = max(1, step_bytes // CHUNK_BYTES)
    for first in range(0, digests.size, per_step):
        if first:
            yield
        _kvsum_chunks(out, source, digests, first, min(digests.size, first + per_step),
                      out.nbytes >= _STREAM_MIN_BYTES, kernels)
    return _kvsum_fold(digests, out.nbytes, kernels)


def hashes_at_memory_speed(algorithm: str, kernels: CpuKernels | None) -> bool:
    """Whether `algorithm` is computed at memory speed (by the C kernel, with `kernels`), or not at all."""
    return algorithm == NO_CHECKSUM or (algorithm == KVSUM and kernels is not None)


def fused_copy(dst: torch.Tensor, src: torch.Tensor, algorithm: str = DEFAULT_ALGORITHM, *,
               kernels: CpuKernels | None = None) -> str:
    """Copy src into dst (same number of bytes, both contiguous on the CPU) and return dst's checksum.

    With kvsum each chunk is hashed as it is copied, in parallel across cores, so the bytes are read from
    memory once; crc32 copies, then hashes."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"fused_copy: {src.nbytes} bytes into {dst.nbytes}")
    if algorithm == KVSUM:
        return _kvsum(_as_array(dst), _as_array(src), kernels)
    dst.copy_(src)
    return compute_checksum(dst, algorithm)


def gather_copy(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, algorithm: str = DEFAULT_ALGORITHM, *,
                kernels: CpuKernels | None = None) -> str:
    """dst[p, t] = src[p, rows[t]] for dst [P, T, ...] and src [P, S, ...] (both contiguous on the CPU, one
    dtype); returns dst's checksum.

    An engine's KV leaves its paged cache this way (P = layers x 2, S = cache slots, rows = the request's
    slots): with kvsum and the C kernel each chunk is hashed as it is written, so the exported bytes are
    never read back; otherwise a gather, then a hash."""
    if dst.dim() < 2 or src.dim() != dst.dim() or src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"gather_copy: cannot gather rows of {tuple(src.shape)} into {tuple(dst.shape)}")
    if src.dtype != dst.dtype or rows.dim() != 1 or rows.numel() != dst.shape[1]:
        raise ValueError(f"gather_copy: {dst.shape[1]} rows of {dst.dtype} wanted; got {rows.numel()} rows "
                         f"of {src.dtype}")
    rows = rows.to(torch.int64).contiguous()
    if rows.numel():
        low, high = torch.aminmax(rows)
        if int(low) < 0 or int(high) >= src.shape[1]:
            raise ValueError(f"gather_copy: a row index is outside [0, {src.shape[1]})")
    if algorithm != KVSUM or kernels is None or not (dst.is_contiguous() and src.is_contiguous()):
        torch.index_select(src, 1, rows, out=dst)
        return compute_checksum(dst, algorithm, kernels=kernels)
    out = _as_array(dst)
    digests = np.empty(-(-out.nbytes // CHUNK_BYTES), dtype=np.uint64)
    row_bytes = dst[0, 0].nbytes if dst.shape[1] else 0
    if out.nbytes:
        kernels.lib.kv_gather_checksum(src.data_ptr(), dst.shape[0], src[0].nbytes, rows.data_ptr(), dst.shape[1],
                                       row_bytes, out.ctypes.data, CHUNK_BYTES, digests.ctypes.data,
                                       out.nbytes >= _STREAM_MIN_BYTES,
                                       _threads() if out.nbytes >= _PARALLEL_MIN_BYTES else 1)
    return _kvsum_fold(digests, out.nbytes, kernels)


def compute_checksum(data: torch.Tensor | memoryview, algorithm: str = DEFAULT_ALGORITHM, *,
                     kernels: CpuKernels | None = None) -> str:
    """Checksum of the raw bytes of a contiguous CPU tensor or buffer, as "<algorithm>:<hex>"."""
    if algorithm == NO_CHECKSUM:
        return f"{NO_CHECKSUM}:"
    buf = _as_array(data)
    if algorithm == KVSUM:
        return _kvsum(buf, None, kernels)
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(buf):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; use {KVSUM}, crc32 or none")


def verify_checksum(data: torch.Tensor | memoryview, expected: str, *, allow_none: bool = False,
                    kernels: CpuKernels | None = None) -> None:
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
        actual = compute_checksum(data, algorithm, kernels=kernels)
    except ValueError as e:
        raise KVChecksumMismatch(f"cannot verify KV handoff checksum {expected!r}: {e}") from e
    check_checksum(actual, expected)


def check_checksum(actual: str, expected: str) -> None:
    """Raise KVChecksumMismatch unless a checksum computed on arrival equals the published one."""
    if actual != expected:
        raise KVChecksumMismatch(
            f"KV handoff bytes are corrupted: checksum {actual} != published {expected}"
        )
