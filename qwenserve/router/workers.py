"""Which worker gets a request: least outstanding work, ties to the one started least recently, prefix
affinity, and a circuit breaker.

Workers come and go (pods found by discovery.py): a removed worker gets no new requests at once, and
drains: once its last outstanding call has finished, `on_drained(address)` says its channel can close.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


class NoWorkerAvailable(RuntimeError):
    """Every worker of a stage is excluded or circuit-broken."""


@dataclass(slots=True)
class Worker:
    """One stage worker as the router sees it."""

    address: str
    outstanding: int = 0
    # Outstanding work in tokens (prompt tokens for prefill, budget for decode).
    outstanding_tokens: int = 0
    consecutive_failures: int = 0
    broken_until: float = 0.0
    draining: bool = False  # removed from the pool: finishing its calls, getting no new ones
    last_started: int = 0  # the pool's count of started calls when this worker last got one (0: never)

    def available(self, now: float) -> bool:
        return now >= self.broken_until


@dataclass(slots=True)
class WorkerPool:
    """The workers of one stage; a pure choice plus explicit bookkeeping calls.

    Affinity: requests whose prompts start with the same tokens prefer the same worker (rendezvous
    hashing over the first `affinity_tokens` ids), so its prefix cache hits, unless that worker carries
    more than `affinity_slack` requests over the least loaded one.
    """

    addresses: Sequence[str]
    failure_threshold: int = 3
    break_seconds: float = 5.0
    affinity_tokens: int = 64
    affinity_slack: int = 2
    # Called with a removed worker's address once it has no outstanding calls left.
    on_drained: Callable[[str], None] | None = None
    workers: dict[str, Worker] = field(init=False)  # the ones that get new requests
    starts: int = field(init=False, default=0)  # calls started on any worker, to order ties
    draining: dict[str, Worker] = field(init=False, default_factory=dict)  # removed, calls still running

    def __post_init__(self) -> None:
        self.workers = {a: Worker(a) for a in self.addresses}

    def add(self, address: str) -> Worker:
        """A new worker (or one removed and back before it drained, with its calls and failures as they are)."""
        worker = self.workers.get(address) or self.draining.pop(address, None) or Worker(address)
        worker.draining = False
        self.workers[address] = worker
        return worker

    def remove(self, address: str) -> None:
        """Send the worker no new requests; it drains (on_drained now if it is idle already)."""
        worker = self.workers.pop(address, None)
        if worker is None:
            return
        worker.draining = True
        self.draining[address] = worker
        self._drained_if_idle(worker)

    def _drained_if_idle(self, worker: Worker) -> None:
        if worker.draining and worker.outstanding == 0 and self.draining.pop(worker.address, None) is not None:
            if self.on_drained is not None:
                self.on_drained(worker.address)

    def choose(self, prompt_ids: Sequence[int] = (), exclude: Iterable[str] = ()) -> Worker:
        """The worker for this request; raises NoWorkerAvailable when none is left."""
        now = time.monotonic()
        excluded = set(exclude)
        candidates = [w for w in self.workers.values() if w.address not in excluded and w.available(now)]
        if not candidates:
            raise NoWorkerAvailable(f"no worker available among {list(self.workers)}")
        # Ties go to the worker that started a call least recently: with sequential requests every worker is
        # idle at each choice, and the first one would otherwise get them all.
        least = min(candidates, key=lambda w: (w.outstanding, w.outstanding_tokens, w.last_started))
        if len(prompt_ids) >= self.affinity_tokens and len(candidates) > 1:
            key = repr(list(prompt_ids[: self.affinity_tokens])).encode()
            preferred = max(candidates, key=lambda w: hashlib.blake2b(key + w.address.encode()).digest())
            if preferred.outstanding - least.outstanding <= self.affinity_slack:
                return preferred
        return least

    def num_available(self) -> int:
        """Workers that would be chosen now (for the router's gauge and alerts)."""
        now = time.monotonic()
        return sum(1 for w in self.workers.values() if w.available(now))

    def started(self, worker: Worker, tokens: int) -> None:
        worker.outstanding += 1
        worker.outstanding_tokens += tokens
        self.starts += 1
        worker.last_started = self.starts

    def finished(self, worker: Worker, tokens: int, failed: bool) -> None:
        """Bookkeeping when a call ends; `failed` counts towards opening the circuit.

        Only a fault of the worker is a failure (transport error, timeout, crash, a stream that ended
        without a finish); a client that left, a stop string or a request refused as invalid is not.
        """
        worker.outstanding = max(0, worker.outstanding - 1)
        worker.outstanding_tokens = max(0, worker.outstanding_tokens - tokens)
        if not failed:
            worker.consecutive_failures = 0
        else:
            worker.consecutive_failures += 1
            if worker.consecutive_failures >= self.failure_threshold:
                worker.broken_until = time.monotonic() + self.break_seconds
        self._drained_if_idle(worker)

    def mark_dead(self, worker: Worker) -> None:
        """The worker is unreachable: stop sending it work for a while."""
        worker.consecutive_failures = max(worker.consecutive_failures, self.failure_threshold)
        worker.broken_until = time.monotonic() + self.break_seconds
