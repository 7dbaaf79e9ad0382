"""A real local cluster whose services export metrics and send their spans to an OTLP receiver process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qwenserve.default_model import write_checkpoint
from qwenserve.launcher import LocalCluster
from tests.e2e.conftest import TINY, make_cluster

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an OTLP receiver sees it (ids in hex; parent "" for a root)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any] = field(hash=False)


class SpanReceiver:
    """Reads the spans the OTLP receiver process has written so far."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def snapshot(self) -> list[ReceivedSpan]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        return [ReceivedSpan(**json.loads(line)) for line in lines if line.endswith("}")]

    def wait_for(self, ready: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15.0) -> list[ReceivedSpan]:
        """The spans so far, once `ready(spans)` holds (fails the test after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if ready(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                pytest.fail(f"spans never arrived as expected; have {names}")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def span_receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SpanReceiver, int]]:
    """An OTLP/gRPC collector in its own process, and the port it listens on."""
    path = tmp_path_factory.mktemp("otlp") / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.observability.otlp_receiver", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield SpanReceiver(path), port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def obs_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-obs", TINY, seed=7)


@pytest.fixture(scope="module")
def traced_cluster(
    obs_model: Path, span_receiver: tuple[SpanReceiver, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """One tokenizer, prefill, decode and router; every service exports spans over OTLP to the receiver."""
    _, port = span_receiver
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with make_cluster(obs_model, tmp_path_factory.mktemp("obs"), prefill=1, decode=1, env=env) as cluster:
        yield cluster


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of a service's /metrics page, parsed by prometheus_client's own parser."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)
