"""until_stopped: a reconcile pass the timer abandons, or is cancelled out of, never leaves a failed task behind (kopf
re-raises any failed task of its loop as the operator's own failure when it stops), and one it waits for reports its
error as before."""

from __future__ import annotations

import asyncio

import pytest

from qwenserve_operator.handlers import until_stopped
from qwenserve_operator.kube import KubeClosed


async def _fails_once(release: asyncio.Event) -> None:
    await release.wait()
    raise KubeClosed()


async def _start(release: asyncio.Event, stopped: asyncio.Event) -> tuple[asyncio.Task[None], asyncio.Task[None]]:
    before = asyncio.all_tasks()
    outer = asyncio.ensure_future(until_stopped(_fails_once(release), stopped))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    (inner,) = [t for t in asyncio.all_tasks() - before if t.get_coro().__name__ == "run"]  # the pass
    return outer, inner


async def test_a_pass_that_fails_as_its_timer_is_cancelled_leaves_no_failed_task() -> None:
    release = asyncio.Event()
    outer, inner = await _start(release, asyncio.Event())
    release.set()  # the pass fails in the same turn of the loop as its timer is cancelled
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.sleep(0.01)
    assert inner.done() and not inner.cancelled() and inner.exception() is None


async def test_a_pass_the_timer_waits_for_raises_its_error_and_a_stopped_one_is_dropped() -> None:
    release = asyncio.Event()
    outer, _ = await _start(release, asyncio.Event())
    release.set()
    with pytest.raises(KubeClosed):
        await outer

    stopped = asyncio.Event()
    outer, inner = await _start(asyncio.Event(), stopped)
    stopped.set()
    await outer  # returns: the pass is abandoned
    assert inner.cancelled()
