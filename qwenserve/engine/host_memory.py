"""Host memory as a CPU engine wants it: the C heap's freed memory kept for reuse (a CPU step allocates the same
large activations every time), and large zeroed buffers that cost nothing until used (`zeroed`).

glibc returns freed blocks of more than a few MiB to the kernel (munmap, or trimming the heap's top), so the
next step's activations of the same size start on fresh pages and fault on first touch, a visible share of
a prefill step on a CPU. Fixing the mmap threshold at its
32 MiB maximum and never trimming keeps those blocks in the heap; the process's resident size then stays at
its high-water mark, which for a server that repeats the same steps is what it needs anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math

import numpy
import torch

log = logging.getLogger(__name__)

# mallopt parameters from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's upper bound on 64-bit hosts
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Apply the settings above; False where the C library has no mallopt (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    if not ok:
        log.info("mallopt refused the heap settings; activations will be page-faulted afresh each step")
    return ok


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), but on the CPU as pages the kernel zeroes when each is first touched (calloc, which maps
    fresh memory for a large block): a KV cache of gigabytes is then ready at once. torch.zeros writes every page
    at start: 3.5 s of a 6.8 s engine start for a 4 GB cache here, and 23 s when prefill and decode start side by
    side, each faulting its own pages on two cores."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(numpy.zeros(count, dtype=numpy.uint8)).view(dtype).view(shape)
