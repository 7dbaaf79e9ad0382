"""keep_freed_memory: a freed activation-sized block is reused instead of faulting fresh pages in."""

from __future__ import annotations

import json
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
