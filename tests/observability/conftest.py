"""A real local cluster whose services export metrics and send their spans to an OTLP receiver process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.launcher import LocalCluster
from tests.support.clusters import make_cluster
from tests.support.spans import SpanReceiver

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def span_receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SpanReceiver, int]]:
    """An OTLP/gRPC collector in its own process, and the port it listens on."""
    path = tmp_path_factory.mktemp("otlp") / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.otlp_receiver", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield SpanReceiver(path), port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def traced_cluster(
    tiny_model: Path, span_receiver: tuple[SpanReceiver, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """One tokenizer, prefill, decode and router; every service exports spans over OTLP to the receiver."""
    _, port = span_receiver
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with make_cluster(tiny_model, tmp_path_factory.mktemp("obs"), prefill=1, decode=1, env=env) as cluster:
        yield cluster

