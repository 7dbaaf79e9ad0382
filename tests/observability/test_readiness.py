"""`/readyz` follows the gRPC health state: not ready while warming up, ready, not ready while draining."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qwenserve.grpc_server import GrpcServerConfig, serve
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(30)


def probe(port: int, path: str) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2).status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:
        return 0  # not listening yet


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(check):
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


async def test_ready_only_between_warm_up_and_drain() -> None:
    port, metrics_port = free_port(), free_port()
    warmed = asyncio.Event()
    config = GrpcServerConfig(port=port, metrics_port=metrics_port, grace_s=5.0)
    server = asyncio.create_task(
        serve(config, "probe-test", [], lambda s: None, warm_up=warmed.wait, stop_signals=(signal.SIGUSR1,))
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        await until(lambda: probe(metrics_port, "/healthz") == 200)
        # Warming up: alive, not ready, and gRPC health agrees.
        assert probe(metrics_port, "/readyz") == 503
        reply = await health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        warmed.set()
        await until(lambda: probe(metrics_port, "/readyz") == 200)
        reply = await health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        # A call in flight keeps the server draining for up to grace_s after the signal.
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await asyncio.to_thread(probe, metrics_port, "/readyz") == 503
        assert await asyncio.to_thread(probe, metrics_port, "/healthz") == 200
        assert not server.done()
        watch.cancel()
    await asyncio.wait_for(server, 10)
