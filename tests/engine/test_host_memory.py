"""keep_freed_memory: a freed activation-sized block is reused instead of faulting fresh pages in; zeroed: a large
zeroed buffer that costs no memory until it is touched."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import pytest

# A fresh interpreter per case: a long test session's heap (and glibc's adaptive threshold) depends on every
# test before this one. Blocks come straight from malloc, the allocator PyTorch's CPU tensors use.
SCRIPT = """
import ctypes, json, resource, sys
from qwenserve.engine.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "on" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 20 * 2**20  # an activation of a few thousand tokens: over glibc's default 128 KiB mmap threshold
def cycle():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "rounds": [cycle() for _ in range(4)], "pages": size // resource.getpagesize()}))
"""


def _rounds(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], check=True, capture_output=True, text=True,
                         timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_freed_block_is_reused_without_faults() -> None:
    on = _rounds("on")
    assert on["applied"]
    assert on["rounds"][0] >= on["pages"] // 2  # the first touch of new memory faults, of course
    assert max(on["rounds"][1:]) < on["pages"] // 10, on
    # Without the settings the block is mapped for the call and unmapped on free: the next one faults again.
    off = _rounds("off")
    assert off["rounds"][1] >= off["pages"] // 2, off


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_zeroed_buffer_is_zeros_and_costs_no_memory_until_touched() -> None:
    import torch

    from qwenserve.engine.host_memory import zeroed

    before = _resident_bytes()
    cache = zeroed((4, 2, 1024, 16, 8, 128), torch.bfloat16, torch.device("cpu"))  # 1 GiB
    assert cache.shape == (4, 2, 1024, 16, 8, 128) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert _resident_bytes() - before < 64 * 2**20
    assert not cache[0, 0, :64].any() and not cache[-1, -1, -64:].any()
    cache[1, 1, 7] = 1.5
    assert float(cache[1, 1, 7].sum()) == 1.5 * 16 * 8 * 128 and not cache[1, 1, 8].any()


def _fresh(shape: tuple[int, ...]):  # noqa: ANN202 - a CPU tensor
    """A zeroed bf16 tensor on pages of its own that nothing has touched: an anonymous mapping (the heap of a long
    test process may hand `zeroed` memory that earlier tests touched)."""
    import math
    import mmap

    import numpy
    import torch

    memory = mmap.mmap(-1, math.prod(shape) * 2)
    return torch.from_numpy(numpy.frombuffer(memory, dtype=numpy.uint8)).view(torch.bfloat16).view(shape)


def _resident_pages(tensor) -> tuple[int, int]:  # noqa: ANN001 - a CPU tensor
    """Pages of the tensor's memory that are in RAM (mincore), and the pages it spans."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), len(vec)


@pytest.mark.skipif(platform.system() != "Linux" or tuple(map(int, platform.release().split(".")[:2])) < (5, 14),
                    reason="MADV_POPULATE_WRITE is Linux 5.14's")
def test_prefault_brings_every_page_in_and_changes_no_byte() -> None:

    from qwenserve.engine.host_memory import Prefault

    cache = _fresh((3, 2, 1400, 16, 4, 64))  # [layers, K/V, blocks, ...]
    cache[1, 0, 7].fill_(1.5)  # a block written before and while the pages fault in
    resident, pages = _resident_pages(cache)
    assert resident < pages
    prefault = Prefault(cache, block_dim=2, blocks_per_step=64)
    cache[2, 1, 1399].fill_(-2.0)
    assert prefault.done.wait(30)
    assert _resident_pages(cache) == (pages, pages)
    assert bool((cache[1, 0, 7] == 1.5).all()) and bool((cache[2, 1, 1399] == -2.0).all())
    cache[1, 0, 7].zero_()
    cache[2, 1, 1399].zero_()
    assert not bool(cache.any())


def test_a_stopped_prefault_has_ended_when_stop_returns() -> None:
    """An engine's shutdown stops it; a process that then exits finds no thread of it (the interpreter's exit ends
    daemon threads where they stand, which aborted one process in five here)."""
    import torch

    from qwenserve.engine.host_memory import Prefault, zeroed

    cache = zeroed((28, 2, 4096, 16, 8, 128), torch.bfloat16, torch.device("cpu"))  # 28 GiB of address space
    prefault = Prefault(cache, block_dim=2, blocks_per_step=1)
    prefault.stop()
    assert prefault.done.is_set()
    resident, pages = _resident_pages(cache)
    assert resident < pages // 28  # far from all 28 GiB


@pytest.mark.skipif(platform.system() != "Linux" or tuple(map(int, platform.release().split(".")[:2])) < (5, 14),
                    reason="MADV_POPULATE_WRITE is Linux 5.14's")
def test_a_prefault_waits_while_its_engine_is_busy() -> None:
    import threading

    from qwenserve.engine.host_memory import Prefault

    cache = _fresh((2, 2, 2000, 16, 4, 64))
    idle = threading.Event()  # an engine with work
    prefault = Prefault(cache, block_dim=2, blocks_per_step=100, when=idle)
    assert not prefault.done.wait(1.0)
    resident, pages = _resident_pages(cache)
    assert resident < pages // 2
    waiting = Prefault(_fresh((1, 2, 10, 16, 4, 64)), block_dim=2, when=threading.Event())
    waiting.stop()
    assert waiting.done.is_set()  # stopped while it waited for the engine to idle
    idle.set()
    assert prefault.done.wait(30)
    assert _resident_pages(cache) == (pages, pages)


@pytest.mark.skipif(platform.system() != "Linux" or tuple(map(int, platform.release().split(".")[:2])) < (5, 14),
                    reason="MADV_POPULATE_WRITE is Linux 5.14's")
def test_a_prefault_waits_while_the_machine_is_busy_though_its_engine_idles() -> None:
    """`up`'s prefill engine idles while its decode engine streams on the same cores: its pages wait for both."""
    import threading

    from qwenserve.engine.host_memory import Prefault, cpus_idle

    cache = _fresh((2, 2, 2000, 16, 4, 64))
    idle, machine = threading.Event(), threading.Event()
    idle.set()
    prefault = Prefault(cache, block_dim=2, blocks_per_step=100, when=idle, machine_idle=machine.is_set)
    assert not prefault.done.wait(1.5)
    resident, pages = _resident_pages(cache)
    assert resident < pages // 2
    machine.set()
    assert prefault.done.wait(30)
    assert _resident_pages(cache) == (pages, pages)
    assert isinstance(cpus_idle(0.01), bool)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # started and spinning
        assert not cpus_idle(0.2)  # every core busy
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
