"""A models file whose primary has no reachable decode worker at start: the router's HTTP port opens anyway, its gRPC
health says SERVING, the primary's requests go to its fallback from the first one, and a tenant not allowed the
fallback is told so.

One deployment runs as a local cluster (tokenizer + decode); the router's models file serves it as "qwen-fallback"
and names a primary, "qwen-primary", that shares its tokenizer and whose decode address nothing listens on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qwenserve.default_model import write_checkpoint
from qwenserve.launcher import LocalCluster
from tests.support.checkpoints import TINY
from tests.support.clusters import make_cluster
from tests.support.ports import free_port

KEYS = {"tenants": {"anyone": None, "primary-only": {"models": ["qwen-primary"]}},
        "keys": [{"tenant": "anyone", "key": "sk-anyone"}, {"tenant": "primary-only", "key": "sk-primary-only"}]}


@pytest.fixture(scope="module")
def fallback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("fallback-start")
    cluster = make_cluster(write_checkpoint(root / "qwen3-fallback", TINY, seed=47), root / "cluster", prefill=0,
                           decode=1)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@dataclass(frozen=True)
class RouterPorts:
    http: int
    grpc: int


@pytest.fixture(scope="module")
def router(fallback: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterPorts]:
    """The router over the models file, started while the primary's decode is unreachable; its ports."""
    root = tmp_path_factory.mktemp("fallback-router")
    tokenizer, model = fallback.child("tokenizer").address, str(fallback.model)
    models = {"models": [
        {"name": "qwen-primary", "model": model, "tokenizer": tokenizer, "decode": [f"127.0.0.1:{free_port()}"],
         "fallback": "qwen-fallback"},
        {"name": "qwen-fallback", "model": model, "tokenizer": tokenizer,
         "decode": [fallback.child("decode-0").address]},
    ]}
    (root / "models.yaml").write_text(yaml.safe_dump(models))
    (root / "keys.json").write_text(json.dumps(KEYS))
    ports = RouterPorts(http=free_port(), grpc=free_port())
    log_path = root / "router.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "qwenserve.cli", "serve", "router", "--models-file", str(root / "models.yaml"),
             "--port", str(ports.grpc), "--http-port", str(ports.http), "--api-keys-file", str(root / "keys.json")],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_http(ports.http, process, log_path)
        yield ports
    finally:
        process.terminate()
        process.wait(30)


def _wait_for_http(port: int, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.3)


def _complete(port: int, key: str) -> tuple[int, dict]:
    body = {"model": "qwen-primary", "prompt": "The sea is", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_http_port_opens_and_the_first_request_goes_to_the_fallback(router: RouterPorts) -> None:
    started = time.monotonic()
    status, body = _complete(router.http, "sk-anyone")
    assert status == 200 and body["model"] == "qwen-fallback", body
    assert time.monotonic() - started < 15
    status, body = _complete(router.http, "sk-anyone")
    assert status == 200 and body["model"] == "qwen-fallback", body


def test_grpc_health_says_serving_once_a_model_can_answer(router: RouterPorts) -> None:
    # The fallback's router has started: the router serves (before, health stayed NOT_SERVING for as long as the
    # primary's decode was unreachable, and a Kubernetes Service would have sent this router nothing).
    deadline = time.monotonic() + 15
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while (status := health.Check(health_pb2.HealthCheckRequest(), timeout=5).status) != \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, status
            time.sleep(0.2)


def test_a_tenant_not_allowed_the_fallback_is_told_which_model(router: RouterPorts) -> None:
    _complete(router.http, "sk-anyone")  # the primary's worker has been tried (and its circuit opened) by now
    status, body = _complete(router.http, "sk-primary-only")
    assert status == 403 and body["error"]["code"] == "model_not_allowed", body
    assert "qwen-fallback" in body["error"]["message"], body
