"""A soak, run by hand: faults of every kind in turn, with clients leaving at random moments, for as long
as QWENSERVE_CHAOS_SOAK_S says; then the figures (requests, errors by kind, RSS and fd growth per process)
and the same judgement as the CI tests.

    QWENSERVE_CHAOS_SOAK_S=600 .venv/bin/python -m pytest tests/chaos/test_soak.py -s -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable

import pytest

from tests.chaos.accounting import BOUND_S, DOWN_S, SETTLE_S, STOP_S, unaccounted
from tests.chaos.deployment import (
    LEASE_S,
    ChaosDeployment,
    open_fds,
    rss_mib,
    wait_for_baseline,
    wait_until_quiet,
    wait_until_serving,
)
from tests.chaos.faults import kill_and_restart, redis_outage, stop_then_continue
from tests.chaos.load import Load

SOAK_S = float(os.environ.get("QWENSERVE_CHAOS_SOAK_S", "0"))
# Load between two faults.
QUIET_S = 10.0


def _faults(deployment: ChaosDeployment) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
    assert deployment.redis is not None
    redis = deployment.redis
    faults: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for name in ("decode-0", "prefill-0", "tokenizer", "decode-1"):
        stage = name.split("-")[0]
        faults.append((f"kill -9 {name}", lambda n=name: kill_and_restart(deployment, n, DOWN_S)))
        faults.append((f"SIGSTOP {name}",
                       lambda n=name, s=STOP_S[stage]: stop_then_continue(deployment, n, s)))
    faults.append(("Redis outage", lambda: redis_outage(redis)))
    return faults


@pytest.mark.skipif(not SOAK_S, reason="a soak is run by hand: QWENSERVE_CHAOS_SOAK_S=<seconds>")
def test_a_soak_of_faults_and_disconnects_accounts_for_every_request_and_stays_flat(
    serving: ChaosDeployment,
) -> None:
    baseline = wait_until_quiet(serving)
    rss_before = {name: rss_mib(pid) for name, pid in baseline.pids.items()}
    injected: list[str] = []

    async def soak() -> Load:
        faults = _faults(serving)
        async with Load(serving, 4, random.Random(1), disconnect_share=0.2, stop_share=0.2) as load:
            end = time.monotonic() + SOAK_S
            while time.monotonic() < end:
                await asyncio.sleep(QUIET_S)
                what, fault = faults[len(injected) % len(faults)]
                injected.append(what)
                await fault()
        return load

    load = asyncio.run(soak())
    print(f"\nsoak of {SOAK_S:.0f}s: {len(load.records)} requests, faults {injected}")
    print(f"outcomes: {dict(load.summary().most_common())}")
    for name, pid in baseline.pids.items():
        now_pid = serving.pid(name)
        life = "same process" if now_pid == pid else "restarted"
        print(f"  {name:<10} rss {rss_before[name]:7.1f} -> {rss_mib(now_pid):7.1f} MiB   "
              f"fds {baseline.fds[name]:4d} -> {open_fds(now_pid):4d}   ({life})")

    broken = unaccounted(load.records, max(BOUND_S.values()), must_succeed=False)
    assert not broken, "\n".join(broken[:20])
    assert not wait_until_serving(serving)
    differences = wait_for_baseline(serving, baseline, SETTLE_S + LEASE_S)
    assert not differences, differences
