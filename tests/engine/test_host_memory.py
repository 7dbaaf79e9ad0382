"""keep_freed_memory: a freed activation-sized block is reused instead of faulting fresh pages in; zeroed: a large
zeroed buffer that costs no memory until it is touched."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

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
