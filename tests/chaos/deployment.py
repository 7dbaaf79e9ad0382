"""The chaos suite's deployment (its settings, and the Redis behind its rate limits) and what a test needs to
judge the aftermath: snapshots of gauges, file descriptors and shared-memory segments."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from qwenserve.kv_transfer import leaked_segments
from tests.support.deployment import Deployment
from tests.support.redis_server import RedisServer

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
