"""Clients that leave at random moments (before the answer starts, mid-stream, just before the end) and
requests that end on a stop string cost nothing: no worker is taken out of rotation, every other request
succeeds, and KV blocks, leases, fds and shm segments are back at baseline well within a lease.
"""

from __future__ import annotations

import asyncio

from tests.chaos.accounting import BOUND_S, SETTLE_S, report, unaccounted, under_load
from tests.chaos.deployment import ChaosDeployment, wait_for_baseline, wait_until_quiet, wait_until_serving
from tests.chaos.load import Load, Record
from tests.support.answers import DISCONNECTED

LOAD_S = 15.0


def _failovers(deployment: ChaosDeployment) -> float:
    samples = deployment.samples("router")
    return sum(v for k, v in samples.items() if k.startswith("qwenserve_router_failovers_total"))


def test_clients_leaving_at_random_moments_and_stop_strings_cost_nothing(serving: ChaosDeployment) -> None:
    baseline = wait_until_quiet(serving)
    failovers = _failovers(serving)

    async def keep_going() -> None:
        await asyncio.sleep(LOAD_S)

    def left_and_stopped(load: Load) -> tuple[list[Record], list[Record]]:
        return ([r for r in load.records if r.answer.status == DISCONNECTED],
                [r for r in load.records if r.with_stops and r.answer.finishes == ["stop"]])

    def enough(load: Load) -> bool:
        left, stopped = left_and_stopped(load)
        return len(left) >= 20 and len(stopped) >= 5

    load = asyncio.run(under_load(serving, keep_going, seed=3, clients=4, until=enough, disconnect_share=0.5,
                                  stop_share=0.3))
    summary = report("disconnects and stop strings", load)
    print(summary)
    left, stopped = left_and_stopped(load)
    assert len(left) >= 20 and len(stopped) >= 5, f"the run did not do what it is for: {summary}"

    broken = unaccounted(load.records, BOUND_S["decode"], must_succeed=True)
    assert not broken, f"{summary}\n" + "\n".join(broken[:15])
    assert _failovers(serving) == failovers, "a worker was taken out of rotation although none failed"
    differences = wait_for_baseline(serving, baseline, SETTLE_S)
    assert not differences, f"not back at baseline {SETTLE_S:.0f}s after the load ({summary}): {differences}"
    trouble = wait_until_serving(serving, within_s=0.0)
    assert not trouble, trouble
