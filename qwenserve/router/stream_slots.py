"""A bound on the requests in flight per decode worker, enforced before the prompt is prefilled.

A decode worker whose batch is full makes an imported request wait for a slot after its first token has
already gone out: the stream stalls mid-answer. With a bound here (the latency preset sets it to decode's
max_num_seqs) the wait happens before prefill instead, where it shows as time to first token, and a stream
once started is never held up. Waiters are served as the engines admit: by tier priority, a level better per
`aging_s` waited, then in arrival order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Waiter:
    priority: int
    since: float  # time.monotonic() it began waiting
    grant: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class StreamSlots:
    """`per_worker` slots for each decode worker `workers()` counts (at least one worker's worth, so a stage
    scaled to zero is left to the cold-start hold); 0: no bound."""

    def __init__(self, per_worker: int, workers: Callable[[], int], aging_s: float = 5.0) -> None:
        self.per_worker = per_worker
        self.aging_s = aging_s
        self._workers = workers
        self.in_use = 0
        self._waiters: list[_Waiter] = []

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def capacity(self) -> int:
        return self.per_worker * max(1, self._workers())

    async def acquire(self, timeout_s: float, priority: int = 0) -> bool:
        """Take a slot, waiting up to `timeout_s` behind waiters served before it; False when the wait ran out.
        A caller cancelled while waiting leaves no trace."""
        if not self.per_worker:
            return True
        if not self._waiters and self.in_use < self.capacity():
            self.in_use += 1
            return True
        waiter = _Waiter(priority, time.monotonic())
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter.grant, timeout=max(0.0, timeout_s))
            return True
        except TimeoutError:
            self._abandon(waiter)
            return False
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def release(self) -> None:
        """Give a slot back: a waiter gets it if there is room (workers may have left meanwhile)."""
        if not self.per_worker:
            return
        self.in_use -= 1
        self.wake()

    def wake(self) -> None:
        """Hand free slots to waiters (also when a decode worker joins and the capacity grows)."""
        now = time.monotonic()
        while self._waiters and self.in_use < self.capacity():
            waiter = min(self._waiters, key=lambda w: (self._level(w, now), w.since))
            self._waiters.remove(waiter)
            self.in_use += 1
            waiter.grant.set_result(None)

    def _level(self, waiter: _Waiter, now: float) -> float:
        return waiter.priority - ((now - waiter.since) / self.aging_s if self.aging_s > 0 else 0.0)

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter that stopped waiting: out of the queue, or its slot handed on if it was granted just then."""
        if waiter.grant.done() and not waiter.grant.cancelled():
            self.release()
        elif waiter in self._waiters:
            self._waiters.remove(waiter)
