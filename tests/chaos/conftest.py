"""One cluster for the chaos suite, with a real redis-server behind its rate limits, and what a test needs to
judge the aftermath: snapshots of gauges, file descriptors and shared-memory segments.

The cluster: tokenizer, one prefill, two decode workers (a fault of one decode worker has a survivor),
the router with Redis-backed limits on (fail open) and short stall and prefill deadlines, one thread per
engine, KV leases of LEASE_S seconds (short enough that a test waiting less than a lease sees a lease that
was not released).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.kv_transfer import leaked_segments
from qwenserve.launcher import LocalCluster
from tests.fuzz.deployment import Deployment
from tests.redis_server import REDIS_SERVER, RedisServer

log = logging.getLogger(__name__)

MODEL_NAME = "qwen3-chaos"
LEASE_S = 8.0
# The router's deadlines in this cluster (flags), short enough for a CI run, and its tokenizer call's default.
STALL_TIMEOUT_S = 5.0
PREFILL_TIMEOUT_S = 10.0
TOKENIZER_DEADLINE_S = 10.0  # the router's --tokenizer-timeout-s
# Open descriptors a surviving process may have gained (sockets in TIME_WAIT handling, lazily opened files).
FD_SLACK = 12
# The gauges that must come back to their baseline once the load has stopped.
GAUGES = {
    "router": ["qwenserve_router_in_flight_requests"],
    "prefill": ["qwenserve_kv_blocks_used", "qwenserve_handoff_leases_outstanding",
                "qwenserve_engine_running_requests"],
    "decode": ["qwenserve_kv_blocks_used", "qwenserve_engine_running_requests"],
}


@dataclass
class ChaosDeployment(Deployment):
    """The cluster and the Redis behind its rate limits."""

    redis: RedisServer | None = None

    def recover(self) -> None:
        """Undo what a test that failed midway may have left: stopped processes, a dead Redis; then make sure
        the cluster serves."""
        assert self.redis is not None
        if self.redis.running:
            self.redis.resume()
        else:
            self.redis.start()
        for child in self.cluster.children:
            if child.process is not None and child.process.poll() is None:
                os.kill(child.process.pid, signal.SIGCONT)
        self.ensure_serving()


@pytest.fixture(scope="session")
def chaos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {**TINY_CONFIG, "max_position_embeddings": 1024}
    return write_checkpoint(tmp_path_factory.mktemp("chaos-model") / MODEL_NAME, config, seed=13)


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


# -- the aftermath -----------------------------------------------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def segments_of(pid: int) -> set[str]:
    """The shared-memory segments process `pid` created (their names carry the creator's pid)."""
    return {name for name in leaked_segments() if name.rsplit("-", 3)[1] == str(pid)}


@dataclass
class Snapshot:
    """What must come back to where it was: per process (by child name) its pid, open fds and shm segments,
    and every gauge in GAUGES."""

    pids: dict[str, int]
    fds: dict[str, int]
    segments: dict[str, set[str]]
    gauges: dict[str, float] = field(default_factory=dict)

    @classmethod
    def take(cls, deployment: Deployment) -> Snapshot:
        pids = {name: deployment.pid(name) for name in deployment.names()}
        gauges = {}
        for name in pids:
            samples = deployment.samples(name)
            for gauge in GAUGES.get(name.split("-")[0], []):
                gauges[f"{name} {gauge}"] = samples.get(gauge, 0.0)
        fds = {n: open_fds(p) for n, p in pids.items()}
        return cls(pids, fds, {n: segments_of(p) for n, p in pids.items()}, gauges)

    def differences(self, now: Snapshot) -> list[str]:
        """How `now` differs from this baseline, in words: gauges not back, fds grown past FD_SLACK in
        processes that survived, segments a survivor gained, segments of dead processes still there."""
        out = [f"{key} is {value:g}, was {self.gauges.get(key, 0.0):g}"
               for key, value in now.gauges.items() if value > self.gauges.get(key, 0.0)]
        for name, pid in self.pids.items():
            if now.pids.get(name) == pid:
                if now.fds[name] > self.fds[name] + FD_SLACK:
                    out.append(f"{name} has {now.fds[name]} open fds, had {self.fds[name]}")
                if now.segments[name] != self.segments[name]:
                    out.append(f"{name}'s shm segments are {sorted(now.segments[name])}, were "
                               f"{sorted(self.segments[name])}")
            else:
                left = segments_of(pid)
                if left:
                    out.append(f"the dead {name} (pid {pid}) left shm segments {sorted(left)}")
                if len(now.segments[name]) > len(self.segments[name]):
                    out.append(f"the restarted {name} has {len(now.segments[name])} shm segments, "
                               f"its first life had {len(self.segments[name])}")
        return out


def wait_for_baseline(deployment: Deployment, baseline: Snapshot, within_s: float) -> list[str]:
    """Poll until nothing differs from `baseline` or `within_s` passes; what still differs then."""
    deadline = time.monotonic() + within_s
    while True:
        differences = baseline.differences(Snapshot.take(deployment))
        if not differences or time.monotonic() > deadline:
            return differences
        time.sleep(0.5)


def wait_until_quiet(deployment: Deployment, within_s: float = LEASE_S + 4.0) -> Snapshot:
    """A baseline taken when no request runs: every gauge in GAUGES at zero, or where a gauge stays after
    `within_s` (an earlier test's leak, which that test reports), there."""
    deadline = time.monotonic() + within_s
    while True:
        snapshot = Snapshot.take(deployment)
        busy = {k: v for k, v in snapshot.gauges.items() if v}
        if not busy or time.monotonic() > deadline:
            if busy:
                log.warning("the baseline is not idle: %s", busy)
            return snapshot
        time.sleep(0.5)


def wait_until_serving(deployment: Deployment, within_s: float = 30.0) -> list[str]:
    """Poll health and a normal request until both are fine or `within_s` passes (a circuit breaker may
    hold a restarted worker out for a few seconds); what still fails then."""
    deadline = time.monotonic() + within_s
    while True:
        trouble = deployment.health_problems() or deployment.canary_failures()
        if not trouble or time.monotonic() > deadline:
            return trouble
        time.sleep(1.0)
