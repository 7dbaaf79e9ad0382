"""Fixtures for the load generator's tests: a synthetic target's settings, a tiny checkpoint, a real cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.default_model import write_checkpoint
from qwenserve.launcher import LocalCluster
from qwenserve.tokenizer import Tokenizer
from tests.support.checkpoints import TINY
from tests.support.clusters import WORKER_ENV


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.builtin()


@pytest.fixture(scope="session")
def loadgen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-loadgen", TINY, seed=5)


@pytest.fixture(scope="module")
def loadgen_cluster(loadgen_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One prefill and one decode worker on the tiny model, the way `qwen-serve up` runs them."""
    logs = tmp_path_factory.mktemp("loadgen-cluster") / "logs"
    with LocalCluster(model=loadgen_model, prefill=1, decode=1, env=dict(WORKER_ENV), log_dir=logs) as cluster:
        yield cluster
