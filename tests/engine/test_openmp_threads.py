"""OpenMP's worker threads (thread_pool.c): a thread hands its pool back, and an engine hands back the pool of the
thread that built it and, when idle, its loop's own, so that libgomp never counts more workers than cores and
throttles them (every parallel region's end then sleeps on a futex)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a pool of one thread has no workers to release")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settles_at(count: int, timeout: float = 5.0) -> bool:
    """Whether the process's thread count comes down to `count` (released workers exit on their own time)."""
    deadline = time.monotonic() + timeout
    while os_threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads() == count


def test_every_variant_releases_the_calling_threads_workers(variant_kernels: dict[str, CpuKernels]) -> None:
    for name, kernels in variant_kernels.items():
        seen: dict[str, object] = {}

        def work(kernels: CpuKernels = kernels, seen: dict[str, object] = seen) -> None:
            # A fresh thread: its pool is its own, whatever the test process's other threads hold.
            before = os_threads()
            torch.ones(2**22).sum()  # a parallel region: this thread's pool gets its workers
            seen["during"] = os_threads() - before
            seen["released"] = kernels.release_thread_pool()
            seen["after"] = settles_at(before)
            torch.ones(2**22).sum()  # the thread can still run parallel work: a new pool
            seen["again"] = os_threads() - before
            seen["released again"] = kernels.release_thread_pool()

        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=30)
        assert seen["during"] == torch.get_num_threads() - 1, (name, seen)
        assert seen["released"] and seen["after"], (name, seen)
        assert seen["again"] == seen["during"] and seen["released again"], (name, seen)


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
