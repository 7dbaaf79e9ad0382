"""keep_freed_memory: a step's activations reuse freed heap memory instead of faulting fresh pages in."""

from __future__ import annotations

import platform
import resource

import pytest
import torch
import torch.nn.functional as F

from qwenserve.engine.host_memory import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_repeated_steps_stop_faulting() -> None:
    assert keep_freed_memory()
    x, w = torch.randn(512, 1024), torch.randn(6144, 1024)
    pages = 512 * 6144 * 4 // resource.getpagesize()  # the 12 MiB MLP activation of a 0.6B model at 512 tokens

    def step() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        y = F.linear(x, w)
        z = y * 2  # two live activations, as in a layer
        del y, z
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    rounds = [step() for _ in range(8)]
    # Without the settings every round faults in at least one activation's pages again (measured: 3072).
    assert max(rounds[-3:]) < pages // 10, rounds
