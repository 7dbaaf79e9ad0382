"""A container probe (grpc, httpGet, tcpSocket) run from the host against a pod's IP, as a kubelet would."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qwenserve_devcluster.pod import Pod, PodConfigError


async def run_probe(pod: Pod, spec: dict[str, Any]) -> bool:
    """One run of a grpc, httpGet or tcpSocket probe against the pod's IP: whether it passed."""
    timeout = float(spec.get("timeoutSeconds", 1))
    address = pod.iface.ip
    try:
        if "grpc" in spec:
            port = pod.port(spec["grpc"]["port"])
            async with grpc.aio.insecure_channel(f"{address}:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in spec:
            get = spec["httpGet"]
            url = f"http://{address}:{pod.port(get['port'])}{get.get('path', '/')}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                    session.get(url) as response:
                return 200 <= response.status < 400
        if "tcpSocket" in spec:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(address, pod.port(spec["tcpSocket"]["port"])), timeout)
            writer.close()
            return True
    except (TimeoutError, grpc.aio.AioRpcError, aiohttp.ClientError, OSError):
        return False
    raise PodConfigError(f"pod {pod.name}: unsupported probe {sorted(spec)} (grpc, httpGet, tcpSocket are)")
