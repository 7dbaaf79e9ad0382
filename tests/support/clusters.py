"""Local clusters: tokenizer, prefill, decode and router as processes on loopback (qwenserve.launcher)."""

from __future__ import annotations

from pathlib import Path

import grpc

from qwenserve.launcher import LocalCluster
from qwenserve.v1 import router_pb2_grpc

# Small KV pools and one thread keep four engine processes light on a two-core machine.
# fp32 throughout: the tests size KV caches and pools in fp32 bytes and compare tokens across processes (under
# --dtype auto each process chooses its bf16 products from its own start-up timing); the auto path has its own tests.
WORKER_ENV = {"QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1", "QWENSERVE_KV_POOL_MIB": "16",
              "QWENSERVE_DTYPE": "float32"}


def make_cluster(model: Path, tmp: Path, **kwargs: object) -> LocalCluster:
    """A LocalCluster with WORKER_ENV (under `kwargs['env']`) logging to tmp/logs; enter it to start it."""
    env = {**WORKER_ENV, **kwargs.pop("env", {})}  # type: ignore[dict-item]
    return LocalCluster(model=model, env=env, log_dir=tmp / "logs", **kwargs)  # type: ignore[arg-type]


def router_stub(cluster: LocalCluster) -> tuple[grpc.aio.Channel, router_pb2_grpc.RouterStub]:
    """A channel to the cluster's router and a stub on it (the caller closes the channel)."""
    channel = grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}")
    return channel, router_pb2_grpc.RouterStub(channel)
