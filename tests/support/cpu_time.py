"""Where a test run's CPU goes: `-p tests.support.cpu_time` appends, per test (setup, call and teardown together),
its wall seconds and the CPU seconds of the worker's process and of the children it reaped meanwhile (a module's
clusters are reaped at its last test's teardown) to $QWENSERVE_TEST_CPU_LOG, a line each: node id, wall, CPU.

Wall time beside other pytest-xdist workers says little on two cores; CPU time says what a test costs them all."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Generator

import pytest


def _cpu_seconds() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    path = os.environ.get("QWENSERVE_TEST_CPU_LOG")
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    if path:
        with open(path, "a") as log:
            log.write(f"{item.nodeid}\t{time.monotonic() - wall:.2f}\t{_cpu_seconds() - cpu:.2f}\n")
