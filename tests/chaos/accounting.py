"""Judging a chaos run: every request accounted for, a fault injected while the load runs, the aftermath."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from tests.chaos.deployment import PREFILL_TIMEOUT_S, STALL_TIMEOUT_S, TOKENIZER_DEADLINE_S
from tests.chaos.load import MAX_TOKENS, Load, Record
from tests.support.answers import DISCONNECTED
from tests.support.deployment import Deployment

# gRPC codes that blame the client: a valid request must never get one, faults or not.
CLIENT_ERRORS = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION", "NOT_FOUND", "UNAUTHENTICATED",
                 "PERMISSION_DENIED"}
# How soon the router must notice a faulty stage: its deadline for that stage, plus slack. Decode has a
# replica: a stalled stream fails over. Tokenizer and prefill have none: a call to them ends at its
# deadline, or falls back to prefilling on the decode worker.
NOTICE_S = {"decode": STALL_TIMEOUT_S + 10.0, "prefill": PREFILL_TIMEOUT_S + 10.0,
            "tokenizer": TOKENIZER_DEADLINE_S + 10.0}
# How long a request may take, start to terminal event: noticing the fault, then its tokens on a CPU that a
# restarting stage and other tests may starve (4 tokens/s).
BOUND_S = {stage: notice + 0.25 * MAX_TOKENS for stage, notice in NOTICE_S.items()}
# A stopped stage stays stopped longer than it takes to notice: a request that waits for SIGCONT is caught.
STOP_S = {stage: notice + 5.0 for stage, notice in NOTICE_S.items()}
# A killed stage stays dead this long under load before it is restarted.
DOWN_S = 3.0
# Gauges must be back within this; shorter than a lease, so a lease left to expire is a leak. A killed or
# stopped decode worker cannot release the leases of the imports it had begun: those expire.
SETTLE_S = 4.0
# Load before the fault, and after the cluster has recovered.
WARM_S = 2.0
AFTER_S = 3.0


def unaccounted(records: list[Record], bound_s: float, must_succeed: bool) -> list[str]:
    """Requests that broke the rules, in words: no terminal event, more than one, later than `bound_s`, an
    error that blames the client; with `must_succeed`, any error at all. Requests the client left are
    excluded (they have nothing to account for)."""
    if not records:
        return ["no request was sent"]
    t0 = min(r.started for r in records)
    out = []
    for record in records:
        a = record.answer
        if a.status == DISCONNECTED:
            continue
        blames_client = 400 <= a.http_status < 500 or a.status in CLIENT_ERRORS
        if not a.ended or a.problems:
            why = "no single terminal event"
        elif a.elapsed_s > bound_s:
            why = f"longer than {bound_s:.0f}s"
        elif not (a.succeeded or a.clean_error):
            why = "neither a success nor a clean error"
        elif blames_client:
            why = "a valid request refused as a client error"
        elif must_succeed and not a.succeeded:
            why = "failed although a replica was left"
        else:
            continue
        out.append(f"{record.kind} started at +{record.started - t0:.1f}s: {why}: {a.describe()}")
    return out


def waited_for_the_stage(records: list[Record], continued_at: float, notice_s: float) -> list[str]:
    """Requests still open when a stopped stage was continued although they had started `notice_s` before:
    they waited for the stage instead of failing over or ending."""
    return [f"{r.kind} started {continued_at - r.started:.0f}s before SIGCONT and ended "
            f"{r.ended_at - continued_at:.1f}s after it: {r.answer.describe()}"
            for r in records
            if r.answer.status != DISCONNECTED and r.started + notice_s < continued_at < r.ended_at]


async def under_load(deployment: Deployment, fault: Callable[[], Awaitable[None]], *, seed: int,
                     clients: int = 4, until: Callable[[Load], bool] | None = None, until_s: float = 60.0,
                     **load_options: float) -> Load:
    """Run `clients` clients, inject `fault` after WARM_S, keep the load AFTER_S longer, return the load. With
    `until`, the fault's part lasts until `until(load)` holds too (at most `until_s` more seconds): a loaded machine
    gets through fewer requests in the fault's time."""
    async with Load(deployment, clients, random.Random(seed), **load_options) as load:
        await asyncio.sleep(WARM_S)
        load.fault_started = time.monotonic()
        await fault()
        deadline = time.monotonic() + until_s
        while until is not None and not until(load) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        load.fault_ended = time.monotonic()
        await asyncio.sleep(AFTER_S)
    return load


def report(what: str, load: Load) -> str:
    """One line for a run: requests and outcomes."""
    took = load.fault_ended - load.fault_started
    return (f"{what} (over in {took:.0f}s): {len(load.records)} requests, "
            f"outcomes {dict(load.summary().most_common())}")
