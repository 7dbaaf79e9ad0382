"""Fixtures every test folder may use: the processes this test session started (whose shared-memory segments
the leak checks count; tests/support/processes.py says why), and the tiny checkpoint most tests serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checkpoints import tiny_checkpoint
from tests.support.processes import SessionProcesses


@pytest.fixture(scope="session")
def session_processes() -> Iterator[SessionProcesses]:
    watcher = SessionProcesses().start()
    yield watcher
    watcher.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 (tests/support/checkpoints.py), written once per session."""
    return tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-tiny")
