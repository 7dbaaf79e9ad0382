"""Real processes on loopback: a tiny Qwen3 checkpoint with the real vocabulary, and local clusters."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.launcher import LocalCluster
from qwenserve.v1 import router_pb2_grpc
from tests.conftest import SessionProcesses

TINY = {**TINY_CONFIG, "max_position_embeddings": 1024}
# Small KV pools keep four engine processes light on this machine.
WORKER_ENV = {"QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1", "QWENSERVE_KV_POOL_MIB": "16"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-e2e", TINY, seed=11)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_segments(session_processes: SessionProcesses) -> Iterator[None]:
    """No segment that this session's processes made outlives the session (others' segments do not count)."""
    before = session_processes.segments()
    yield
    left = session_processes.segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def make_cluster(model: Path, tmp: Path, **kwargs: object) -> LocalCluster:
    env = {**WORKER_ENV, **kwargs.pop("env", {})}  # type: ignore[dict-item]
    return LocalCluster(model=model, env=env, log_dir=tmp / "logs", **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two prefill and two decode workers, short leases."""
    with make_cluster(tiny_model, tmp_path_factory.mktemp("cluster"), prefill=2, decode=2,
                      extra_worker_args=["--lease-s", "2"]) as c:
        yield c


def router_stub(cluster: LocalCluster) -> tuple[grpc.aio.Channel, router_pb2_grpc.RouterStub]:
    channel = grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}")
    return channel, router_pb2_grpc.RouterStub(channel)


def metric(port: int, name: str) -> float:
    """Read one unlabelled sample from a service's /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    match = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not exported on :{port}"
    return float(match.group(1))
