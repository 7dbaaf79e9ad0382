"""A LocalCluster that a suite keeps serving: its clients, its health on every surface, its gauges, and
restarts of one stage or of the whole cluster.

The fuzz suite starts one of these per module, the chaos suite one in all; `ensure_serving()` before each
test brings a cluster that an earlier test left broken back to life, so that one bug cannot hide another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from qwenserve import supervision
from qwenserve.launcher import Child, LocalCluster, wait_serving
from qwenserve.v1 import router_pb2, router_pb2_grpc
from tests.support.answers import Answer, grpc_generate, http_post

log = logging.getLogger(__name__)

# A normal request must be answered within this (tiny model, a few tokens, a loaded 2-core machine).
CANARY_BOUND_S = 20.0


@dataclass
class Deployment:
    """One running cluster and what its clients need to reach it."""

    cluster: LocalCluster
    model_name: str
    api_key: str | None = None

    # -- reaching it -----------------------------------------------------------------------------

    @property
    def http_base(self) -> str:
        return f"http://{self.cluster.host}:{self.cluster.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.cluster.host}:{self.cluster.router_port}"

    def http_headers(self) -> dict[str, str]:
        """What a well-behaved HTTP client sends."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def normal_request(self, max_tokens: int = 4) -> router_pb2.GenerateRequest:
        request = router_pb2.GenerateRequest(prompt="Hello, my name is")
        request.sampling.max_tokens = max_tokens
        request.sampling.temperature = 0.0
        return request

    async def canary(self, session: aiohttp.ClientSession, stub: router_pb2_grpc.RouterStub) -> list[Answer]:
        """A normal completion over HTTP and a normal Generate over gRPC."""
        body = json.dumps({"model": self.model_name, "prompt": "Hello, my name is", "max_tokens": 4}).encode()
        return [
            await http_post(session, f"{self.http_base}/v1/completions", body, self.http_headers(),
                            CANARY_BOUND_S),
            await grpc_generate(stub, self.normal_request(), self.grpc_metadata(), CANARY_BOUND_S),
        ]

    def canary_failures(self) -> list[str]:
        """The canary's answers that did not succeed, in words (empty: the cluster serves)."""

        async def run() -> list[Answer]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                    grpc.aio.insecure_channel(self.grpc_address) as channel:
                return await self.canary(session, router_pb2_grpc.RouterStub(channel))

        return [a.describe() for a in asyncio.run(run()) if not a.succeeded]

    # -- health ----------------------------------------------------------------------------------

    def health_problems(self) -> list[str]:
        """Every stage alive, gRPC health SERVING, /healthz and /readyz 200; what is not, in words."""
        problems = []
        for child in self.cluster.children:
            if child.process is None or child.process.poll() is not None:
                code = None if child.process is None else child.process.returncode
                problems.append(f"{child.name} is not running (exit code {code})")
                continue
            status = grpc_health(child.address)
            if status != "SERVING":
                problems.append(f"{child.name}: gRPC health is {status}")
            for path in ("/healthz", "/readyz"):
                code = http_status(f"http://{self.cluster.host}:{child.metrics_port}{path}")
                if code != 200:
                    problems.append(f"{child.name}: {path} answered {code}")
        return problems

    def ensure_serving(self) -> None:
        """Restart the whole cluster if it is unhealthy or does not serve a normal request."""
        trouble = self.health_problems() or self.canary_failures()
        if not trouble:
            return
        log.warning("restarting the cluster, which a previous test left broken: %s", trouble)
        self.cluster.stop()
        for child in self.cluster.children:
            self._spawn(child)
        self.cluster.wait_healthy(timeout_s=120)

    # -- gauges and processes --------------------------------------------------------------------

    def samples(self, name: str) -> dict[str, float]:
        """Every sample of the child `name`'s /metrics page, keyed as Prometheus prints them
        (`metric{label="value"}`)."""
        url = f"http://{self.cluster.host}:{self.cluster.child(name).metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def pid(self, name: str) -> int:
        process = self.cluster.child(name).process
        assert process is not None
        return process.pid

    def names(self, prefix: str = "") -> list[str]:
        return [c.name for c in self.cluster.children if c.name.startswith(prefix)]

    def respawn(self, name: str) -> None:
        """Start the killed child `name` again, on the same ports. Call it from the main thread: the child
        gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG)."""
        child = self.cluster.child(name)
        assert child.process is not None and child.process.poll() is not None, f"{name} is still running"
        self._spawn(child)

    def wait_serving(self, name: str, timeout_s: float = 90.0) -> None:
        """Wait until the child `name` says SERVING; RuntimeError if it exits or the time passes first."""
        child = self.cluster.child(name)
        wait_serving(child.address, time.monotonic() + timeout_s, child.process, name)

    def _spawn(self, child: Child) -> None:
        """Start `child` again as LocalCluster.start does: it dies with this process and prefill runs at a lower
        priority (both armed by the child itself, qwenserve/supervision.py)."""
        nice = self.cluster.prefill_nice if child.name.startswith("prefill") else 0
        log_dir = self.cluster.log_dir or Path("/tmp")
        with open(log_dir / f"{child.name}.log", "ab") as out:
            child.process = subprocess.Popen(
                child.argv, env={**os.environ, **self.cluster.env, **child.env, **supervision.child_env(nice)},
                stdout=out, stderr=subprocess.STDOUT,
            )


def grpc_health(address: str, timeout_s: float = 3.0) -> str:
    """The server-wide gRPC health status at `address`, or the error code's name."""
    with grpc.insecure_channel(address) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code().name  # type: ignore[attr-defined]
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def http_status(url: str, timeout_s: float = 3.0) -> int | str:
    """The status of a GET, or the error's name when none came back."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return type(e).__name__
