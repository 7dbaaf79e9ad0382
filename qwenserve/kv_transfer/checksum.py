"""Checksums of handoff bytes, written "<algorithm>:<hex>" as in `KVHandle.checksum`.

xxh3_64 (about 35 GB/s on one core here) is the default; crc32 from zlib (about 7 GB/s) is the
fallback where the `xxhash` package is missing. "none" skips hashing, for benchmarks only:
importers refuse it unless told otherwise.
"""

from __future__ import annotations

import zlib

import torch

from qwenserve.kv_transfer.errors import KVChecksumMismatch

try:
    import xxhash
except ImportError:  # the fallback keeps handoffs verifiable without the optional package
    xxhash = None

NO_CHECKSUM = "none"
DEFAULT_ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"


def _as_bytes_view(data: torch.Tensor | memoryview) -> memoryview:
    if isinstance(data, memoryview):
        return data
    flat = data.detach().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        raise ValueError("checksums are computed on host memory; move the tensor to the CPU first")
    return memoryview(flat.numpy())


def compute_checksum(data: torch.Tensor | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Checksum of the raw bytes of a contiguous CPU tensor or buffer, as "<algorithm>:<hex>"."""
    if algorithm == NO_CHECKSUM:
        return f"{NO_CHECKSUM}:"
    view = _as_bytes_view(data)
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise ValueError("xxh3_64 needs the `xxhash` package; install it or use crc32")
        return f"xxh3_64:{xxhash.xxh3_64_hexdigest(view)}"
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(view):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; use xxh3_64, crc32 or none")


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
    if actual != expected:
        raise KVChecksumMismatch(
            f"KV handoff bytes are corrupted: checksum {actual} != published {expected}"
        )
