"""Host memory as a CPU engine wants it: the C heap's freed memory kept for reuse (a CPU step allocates the same
large activations every time), large zeroed buffers that cost nothing until used (`zeroed`), and a KV cache's pages
faulted in ahead of use by a background thread (`Prefault`).

glibc returns freed blocks of more than a few MiB to the kernel (munmap, or trimming the heap's top), so the
next step's activations of the same size start on fresh pages and fault on first touch, a visible share of
a prefill step on a CPU. Fixing the mmap threshold at its
32 MiB maximum and never trimming keeps those blocks in the heap; the process's resident size then stays at
its high-water mark, which for a server that repeats the same steps is what it needs anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import threading
import time
from collections.abc import Callable

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


_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
_PR_SET_NAME = 15  # linux/prctl.h
# The prefault thread's name, in /proc/PID/task/TID/comm too: the one thread of a process that runs below its nice.
PREFAULT_THREAD = "kv-prefault"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Prefault:
    """Faults in a CPU KV cache's pages from a daemon thread at the lowest priority (nice 19), a step of blocks at a
    time in the order the block pool hands them out (block 0 first, every layer's slice of it), each step only while
    `when` is set.

    A cache from `zeroed` costs nothing at start, but the first write to each page then waits for the kernel to
    find and zero it, and in a VM for the host to back it: 12% of a 2,000-token prefill into fresh blocks on this
    project's Xeon, every prompt until the pool has gone round once. MADV_POPULATE_WRITE does that work ahead,
    in the time the engine idles (beside a 32-request burst on two cores, the populating of `up`'s two engines
    cost the burst more than the faults it saved), and never changes a byte (a block being written meanwhile keeps its data).
    Where the call is missing (Linux before 5.14, other systems) nothing is done and the pages fault on use."""

    def __init__(self, cache: torch.Tensor, block_dim: int, blocks_per_step: int = 64,
                 when: threading.Event | None = None, machine_idle: Callable[[], bool] | None = None) -> None:
        """`when`: populate only while it is set (an engine's idle event), one step at a time; `machine_idle`: and
        only when it says the machine is idle too (`cpus_idle`: another process's engine may be busy on it)."""
        self._stop = threading.Event()
        self._when = when
        self._machine_idle = machine_idle
        # Plain addresses, taken here: the thread never holds the cache or calls into PyTorch, so the interpreter's
        # exit (which ends daemon threads where they stand) never finds it inside C++.
        self._steps = _populate_steps(cache, block_dim, blocks_per_step)
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=PREFAULT_THREAD, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the thread: it returns between two calls, each at most one step of one plane."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            _name_os_thread(PREFAULT_THREAD)
            madvise = _madvise()
            if madvise is None:
                return
            for ranges in self._steps:
                while not self._may_populate():
                    if self._stop.wait(0.5):
                        return
                for start, length in ranges:
                    if self._stop.is_set():
                        return
                    if madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                        log.debug("MADV_POPULATE_WRITE refused (errno %d): KV pages fault on first use",
                                  ctypes.get_errno())
                        return
        finally:
            self.done.set()


    def _may_populate(self) -> bool:
        if self._when is not None and not self._when.is_set():
            return False
        return self._machine_idle is None or self._machine_idle()


def cpus_idle(seconds: float = 0.1, share: float = 0.75) -> bool:
    """Whether the machine's CPUs were idle at least `share` of the last `seconds` (/proc/stat; True where it cannot
    be read). `up` runs a prefill and a decode engine on the same cores: one's pages populated while the other
    decodes took a core and memory bandwidth from its steps (a W4A16 decode stream's ITL p50 35-37 ms, 30-32 without
    the prefault)."""
    try:
        first = _cpu_times()
        time.sleep(seconds)
        second = _cpu_times()
    except (OSError, ValueError, IndexError):
        return True
    busy, idle = (b - a for a, b in zip(first, second, strict=True))
    return busy + idle <= 0 or idle >= share * (busy + idle)


def _cpu_times() -> tuple[int, int]:
    """(busy, idle) jiffies of all CPUs since boot: /proc/stat's first line, idle and iowait counted idle."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle, idle


def _populate_steps(cache: torch.Tensor, block_dim: int, blocks_per_step: int) -> list[list[tuple[int, int]]]:
    """Page-aligned (address, length) ranges, one list per step of blocks, each with every plane's slice of them."""
    planes = cache.flatten(0, block_dim - 1) if block_dim > 0 else cache.unsqueeze(0)  # [planes, blocks, ...]
    count, blocks = planes.shape[0], planes.shape[1]
    size = planes.element_size()
    base, plane_bytes, block_stride = planes.data_ptr(), planes.stride(0) * size, planes.stride(1) * size
    block_bytes = planes[0, 0].numel() * size
    steps = []
    for first in range(0, blocks, blocks_per_step):
        ranges = []
        for plane in range(count):
            address = base + plane * plane_bytes + first * block_stride
            start = address // _PAGE * _PAGE
            end = address + (min(blocks_per_step, blocks - first) - 1) * block_stride + block_bytes
            ranges.append((start, end - start))
        steps.append(ranges)
    return steps


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` where the kernel shows it (comm; Python 3.11 names only its own object)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _madvise():  # noqa: ANN202 - a ctypes function
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise
