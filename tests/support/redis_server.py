"""A real redis-server that tests may kill, pause and restart (rate limits, metering, chaos)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.support.ports import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """One redis-server process on a fixed port, so a restarted server keeps the same URL."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port("127.0.0.1")
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers PING."""
        if self.running:
            return
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--logfile",
                str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: the abrupt outage a crashed or evicted Redis pod looks like."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted but never answered (a hung or partitioned Redis)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def flush(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            client.flushall()
        finally:
            client.close()
