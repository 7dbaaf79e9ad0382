"""One cluster for the chaos suite, with a real redis-server behind its rate limits (its settings, and the
snapshots that judge the aftermath, are in tests/chaos/deployment.py).

The cluster: tokenizer, one prefill, two decode workers (a fault of one decode worker has a survivor),
the router with Redis-backed limits on (fail open) and short stall and prefill deadlines, one thread per
engine, KV leases of LEASE_S seconds (short enough that a test waiting less than a lease sees a lease that
was not released).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.launcher import LocalCluster
from tests.chaos.deployment import (
    LEASE_S,
    MODEL_NAME,
    PREFILL_TIMEOUT_S,
    STALL_TIMEOUT_S,
    TOKENIZER_DEADLINE_S,
    ChaosDeployment,
)
from tests.support.checkpoints import tiny_checkpoint
from tests.support.redis_server import REDIS_SERVER, RedisServer


@pytest.fixture(scope="session")
def chaos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model under the name the chaos suite's requests ask for."""
    return tiny_checkpoint(tmp_path_factory.mktemp("chaos-model") / MODEL_NAME, seed=13)


@pytest.fixture(scope="package")
def deployment(chaos_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosDeployment]:
    if not os.path.exists(REDIS_SERVER):
        pytest.fail("redis-server is not installed (apt-get install redis-server); the chaos suite needs one")
    redis_server = RedisServer(tmp_path_factory.mktemp("chaos-redis"))
    redis_server.start()
    env = {
        "QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1", "QWENSERVE_KV_POOL_MIB": "16",
        "QWENSERVE_REDIS_URL": redis_server.url, "QWENSERVE_RATELIMIT_FAILURE_MODE": "open",
        "QWENSERVE_DEFAULT_TOKENS_PER_MINUTE": "100000000",
        "QWENSERVE_DEFAULT_REQUESTS_PER_MINUTE": "1000000",
    }
    cluster = LocalCluster(model=chaos_model, prefill=1, decode=2, env=env,
                           log_dir=tmp_path_factory.mktemp("chaos-logs"),
                           extra_worker_args=["--lease-s", str(LEASE_S)],
                           extra_router_args=["--stall-timeout-s", str(STALL_TIMEOUT_S),
                                              "--prefill-timeout-s", str(PREFILL_TIMEOUT_S),
                                              "--tokenizer-timeout-s", str(TOKENIZER_DEADLINE_S)])
    try:
        with cluster:
            yield ChaosDeployment(cluster, MODEL_NAME, redis=redis_server)
    finally:
        if redis_server.running:
            redis_server.resume()
            redis_server.kill()


@pytest.fixture(autouse=True)
def serving(deployment: ChaosDeployment) -> ChaosDeployment:
    """Each test starts on a cluster that serves, whatever the previous one did to it."""
    deployment.recover()
    return deployment
