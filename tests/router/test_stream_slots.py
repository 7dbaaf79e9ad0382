"""The router's bound on requests in flight per decode worker: who waits, who is served next, and that a waiter
who leaves (a timeout, a client gone) takes no slot with it."""

from __future__ import annotations

import asyncio

from qwenserve.router.stream_slots import StreamSlots


def test_requests_beyond_the_bound_wait_and_are_served_in_arrival_order_as_slots_free() -> None:
    async def run() -> list[int]:
        slots = StreamSlots(2, lambda: 1)
        served: list[int] = []
        assert await slots.acquire(1.0) and await slots.acquire(1.0)

        async def wait(i: int) -> None:
            assert await slots.acquire(5.0)
            served.append(i)

        waiters = []
        for i in range(3):
            waiters.append(asyncio.create_task(wait(i)))
            await asyncio.sleep(0.01)
        assert slots.waiting == 3 and slots.in_use == 2 and not served
        for expected in ([0], [0, 1], [0, 1, 2]):
            slots.release()
            await asyncio.sleep(0.01)
            assert served == expected
        await asyncio.gather(*waiters)
        assert slots.in_use == 2 and slots.waiting == 0
        return served

    assert asyncio.run(run()) == [0, 1, 2]


def test_the_bound_is_per_decode_worker_and_a_worker_joining_lets_waiters_in() -> None:
    async def run() -> None:
        workers = [1]
        slots = StreamSlots(1, lambda: workers[0])
        assert await slots.acquire(1.0)
        waiter = asyncio.create_task(slots.acquire(5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        workers[0] = 2
        slots.wake()
        assert await asyncio.wait_for(waiter, 1.0)
        assert slots.in_use == 2 == slots.capacity()

    asyncio.run(run())


def test_a_stage_with_no_worker_still_admits_one_workers_worth_for_the_cold_start_hold() -> None:
    async def run() -> None:
        slots = StreamSlots(3, lambda: 0)
        assert slots.capacity() == 3
        assert all([await slots.acquire(0.0) for _ in range(3)])
        assert not await slots.acquire(0.05)

    asyncio.run(run())


def test_a_wait_that_runs_out_or_is_cancelled_leaves_no_trace() -> None:
    async def run() -> None:
        slots = StreamSlots(1, lambda: 1)
        assert await slots.acquire(1.0)
        assert not await slots.acquire(0.05)  # timed out
        assert slots.waiting == 0 and slots.in_use == 1
        gone = asyncio.create_task(slots.acquire(5.0))  # a client that leaves while waiting
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert slots.waiting == 0 and slots.in_use == 1
        slots.release()
        assert slots.in_use == 0
        assert await slots.acquire(0.0)  # the slot is free again

    asyncio.run(run())


def test_a_slot_granted_just_as_its_waiter_is_cancelled_is_handed_on() -> None:
    async def run() -> None:
        slots = StreamSlots(1, lambda: 1)
        assert await slots.acquire(1.0)
        first = asyncio.create_task(slots.acquire(5.0))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(slots.acquire(5.0))
        await asyncio.sleep(0.01)
        slots.release()  # grants `first`, which is cancelled before it runs again
        first.cancel()
        [kept] = await asyncio.gather(first, return_exceptions=True)
        if kept is True:  # asyncio.wait_for returns a result that came with the cancellation: it holds the slot
            assert not second.done()
            slots.release()
        assert await asyncio.wait_for(second, 1.0)  # the slot went on to the next waiter, not lost
        assert slots.in_use == 1 and slots.waiting == 0

    asyncio.run(run())


def test_a_higher_tier_waiter_goes_first_and_a_long_wait_ages_a_lower_one_ahead() -> None:
    async def run() -> None:
        slots = StreamSlots(1, lambda: 1, aging_s=0.2)
        assert await slots.acquire(1.0)
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            assert await slots.acquire(5.0, priority)
            order.append(name)

        free = asyncio.create_task(wait("free", 2))
        await asyncio.sleep(0.01)
        paid = asyncio.create_task(wait("paid", 0))
        await asyncio.sleep(0.01)
        slots.release()
        await asyncio.sleep(0.01)
        assert order == ["paid"]  # arrived later, served first
        slots.release()
        await asyncio.gather(free, paid)
        # Aging: a free-tier request that has waited two levels' worth is ahead of a paid one just arrived.
        old = asyncio.create_task(wait("old free", 2))
        await asyncio.sleep(0.5)
        new = asyncio.create_task(wait("new paid", 0))
        await asyncio.sleep(0.01)
        slots.release()
        await asyncio.sleep(0.01)
        assert order[-1] == "old free"
        slots.release()
        await asyncio.gather(old, new)

    asyncio.run(run())


def test_no_bound_admits_everyone_at_once() -> None:
    async def run() -> None:
        slots = StreamSlots(0, lambda: 1)
        assert all([await slots.acquire(0.0) for _ in range(100)])
        slots.release()
        assert slots.waiting == 0

    asyncio.run(run())
