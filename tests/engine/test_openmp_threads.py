"""OpenMP's worker threads (thread_pool.c): a thread hands its pool back, and an engine hands back the pool of the
thread that built it and, when idle, its loop's own, so that libgomp never counts more workers than cores and
throttles them (every parallel region's end then sleeps on a futex)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a pool of one thread has no workers to release")


# Run in a fresh interpreter, where no other thread comes or goes while the threads are counted: for each object
# named, the workers a parallel region starts, whether releasing frees them, and whether a later region starts them
# again.
COUNT_WORKERS = """
import json, os, sys, time
from pathlib import Path
import torch
from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.library import CpuKernels

def threads():
    return len(os.listdir("/proc/self/task"))

def settles_at(count):
    deadline = time.monotonic() + 5
    while threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads() == count

torch.set_num_threads(2)
for path in sys.argv[1:]:
    kernels = CpuKernels(loader._open(Path(path), "test"), path)
    before = threads()
    torch.ones(2**22).sum()
    seen = {"during": threads() - before, "released": kernels.release_thread_pool(), "after": settles_at(before)}
    torch.ones(2**22).sum()
    seen["again"] = threads() - before
    seen["released again"] = kernels.release_thread_pool()
    seen["after again"] = settles_at(before)
    print(json.dumps(seen))
"""


def test_every_variant_releases_the_calling_threads_workers(variant_kernels: dict[str, CpuKernels]) -> None:
    paths = [kernels.lib._name for kernels in variant_kernels.values()]
    run = subprocess.run([sys.executable, "-c", COUNT_WORKERS, *paths], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr
    results = [json.loads(line) for line in run.stdout.splitlines()]
    for name, seen in zip(variant_kernels, results, strict=True):
        assert seen == {"during": 1, "released": True, "after": True, "again": 1, "released again": True,
                        "after again": True}, (name, seen)


def test_an_engine_releases_its_builders_pool_and_its_loops_when_idle(
        make_engine: Callable[..., LLMEngine]) -> None:
    callers: list[str] = []
    release = CpuKernels.release_thread_pool

    def recorded(self: CpuKernels) -> bool:
        callers.append(threading.current_thread().name)
        return release(self)

    with mock.patch.object(CpuKernels, "release_thread_pool", recorded):
        engine = make_engine("qwen3_gqa4")
        if engine.kernels.cpu is None:
            pytest.skip("no C kernels here: nothing releases OpenMP's threads")
        assert threading.current_thread().name in callers, "the builder's workers were kept"
        callers.clear()
        outputs = engine.generate_sync([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(outputs[0]) == 4
        assert engine.wait_until_idle(timeout=30)
        deadline = time.monotonic() + 5
        while "qwenserve-engine" not in callers and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "qwenserve-engine" in callers, "the idle loop kept its workers"
