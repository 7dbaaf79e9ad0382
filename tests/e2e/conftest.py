"""Fixtures of the end-to-end tests: a local cluster of the tiny model, and the shared-memory leak check."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.launcher import LocalCluster
from tests.support.clusters import make_cluster
from tests.support.processes import SessionProcesses


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_segments(session_processes: SessionProcesses) -> Iterator[None]:
    """No segment that this session's processes made outlives the session (others' segments do not count)."""
    before = session_processes.segments()
    yield
    left = session_processes.segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two prefill and two decode workers, short leases."""
    with make_cluster(tiny_model, tmp_path_factory.mktemp("cluster"), prefill=2, decode=2,
                      extra_worker_args=["--lease-s", "2"]) as c:
        yield c
