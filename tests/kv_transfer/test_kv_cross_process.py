"""Shared memory across real processes: the exporter is a separate Python process."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from qwenserve.kv_transfer import KVHandle, KVLayout, leaked_segments, reap_orphaned_segments

CHILD = Path(__file__).parent / "exporter_process.py"
LAYOUT = KVLayout("float16", 16, 2, 2, 8, "fp-test")  # as in exporter_process.py


@pytest.fixture
def start_exporter_process(segment_prefix: str) -> Iterator:
    children: list[subprocess.Popen] = []

    def start(num_tokens: int, seed: int) -> tuple[subprocess.Popen, KVHandle]:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), segment_prefix, str(num_tokens), str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        children.append(child)
        line = child.stdout.readline()
        assert line, f"exporter process exited early with {child.wait(timeout=10)}"
        return child, KVHandle.FromString(base64.b64decode(line))

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)
    reap_orphaned_segments(segment_prefix, min_age_s=0)  # only matters if a test failed midway


async def test_kv_exported_by_another_process_is_mapped_verified_and_released(
    start_exporter_process, importer, make_kv, segment_prefix
):
    child, handle = start_exporter_process(num_tokens=100, seed=7)
    assert leaked_segments(segment_prefix) == [handle.location]
    assert f"-{child.pid}-" in handle.location

    fetched = await importer.fetch(handle, LAYOUT)
    assert torch.equal(fetched, make_kv(LAYOUT, 100, seed=7))
    assert await importer.release(handle, "imported") is True

    out, _ = child.communicate("quit\n", timeout=20)
    counters = json.loads(out.strip().splitlines()[-1])
    assert counters["released"] == 1 and counters["outstanding"] == 0 and counters["reclaimed"] == 0
    assert child.returncode == 0
    assert leaked_segments(segment_prefix) == []


async def test_sigterm_of_the_exporter_unlinks_its_segments(start_exporter_process, segment_prefix):
    child, handle = start_exporter_process(num_tokens=8, seed=1)
    assert leaked_segments(segment_prefix) == [handle.location]
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=20) == -signal.SIGTERM
    assert leaked_segments(segment_prefix) == []


async def test_segments_of_a_killed_exporter_are_reaped_and_live_ones_are_not(
    start_exporter_process, segment_prefix
):
    killed, killed_handle = start_exporter_process(num_tokens=8, seed=1)
    alive, alive_handle = start_exporter_process(num_tokens=8, seed=2)
    killed.kill()
    killed.wait(timeout=20)
    assert killed_handle.location in leaked_segments(segment_prefix)  # SIGKILL runs no cleanup

    assert reap_orphaned_segments(segment_prefix, min_age_s=0) == [killed_handle.location]
    assert leaked_segments(segment_prefix) == [alive_handle.location]
    alive.communicate("quit\n", timeout=20)
    assert leaked_segments(segment_prefix) == []
