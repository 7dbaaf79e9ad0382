"""Redis dies under a running router: requests follow the fail-open / fail-closed setting, the router stays
up, and limits come back with Redis."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.launcher import LocalCluster
from tests.support.checkpoints import tiny_checkpoint
from tests.support.ports import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


class RedisProcess:
    """A redis-server on a fixed port that the test can kill and bring back."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run([REDIS_CLI, "-p", str(self.port), "ping"],
                             capture_output=True, text=True).stdout.strip() != "PONG":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.kill()


def _chat(http_port: int) -> tuple[int, dict]:
    body = json.dumps({"model": "qwen3-outage", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_a_dead_redis_follows_the_failure_mode_and_the_router_stays_up(
    redis_process: RedisProcess, tmp_path: Path, mode: str
) -> None:
    model = tiny_checkpoint(tmp_path / "qwen3-outage", seed=5)
    router_args = ["--redis-url", redis_process.url, "--ratelimit-failure-mode", mode, "--no-auth"]
    env = {"QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1",
           "QWENSERVE_DEFAULT_TOKENS_PER_MINUTE": "1000000", "QWENSERVE_DEFAULT_REQUESTS_PER_MINUTE": "10000"}
    with LocalCluster(model=model, prefill=1, decode=1, env=env, extra_router_args=router_args,
                      log_dir=tmp_path / "logs") as cluster:
        assert _chat(cluster.http_port)[0] == 200
        redis_process.kill()
        started = time.monotonic()
        status, body = _chat(cluster.http_port)
        assert time.monotonic() - started < 10  # short timeouts, no hang
        if mode == "open":
            assert status == 200
        else:
            assert status == 503
            assert body["error"]["message"]
        assert cluster.child("router").process.poll() is None

        redis_process.start()  # the same port: the limiter reconnects on its own
        deadline = time.monotonic() + 15
        while (status := _chat(cluster.http_port)[0]) != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert status == 200
