"""Which worker gets a request: least outstanding work, prefix affinity, and a circuit breaker."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
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
    workers: dict[str, Worker] = field(init=False)

    def __post_init__(self) -> None:
        self.workers = {a: Worker(a) for a in self.addresses}

    def choose(self, prompt_ids: Sequence[int] = (), exclude: Iterable[str] = ()) -> Worker:
        """The worker for this request; raises NoWorkerAvailable when none is left."""
        now = time.monotonic()
        excluded = set(exclude)
        candidates = [w for w in self.workers.values() if w.address not in excluded and w.available(now)]
        if not candidates:
            raise NoWorkerAvailable(f"no worker available among {list(self.workers)}")
        least = min(candidates, key=lambda w: (w.outstanding, w.outstanding_tokens))
        if len(prompt_ids) >= self.affinity_tokens and len(candidates) > 1:
            key = repr(list(prompt_ids[: self.affinity_tokens])).encode()
            preferred = max(candidates, key=lambda w: hashlib.blake2b(key + w.address.encode()).digest())
            if preferred.outstanding - least.outstanding <= self.affinity_slack:
                return preferred
        return least

    def started(self, worker: Worker, tokens: int) -> None:
        worker.outstanding += 1
        worker.outstanding_tokens += tokens

    def finished(self, worker: Worker, tokens: int, failed: bool) -> None:
        """Bookkeeping when a call ends; `failed` counts towards opening the circuit.

        Only a fault of the worker is a failure (transport error, timeout, crash, a stream that ended
        without a finish); a client that left, a stop string or a request refused as invalid is not.
        """
        worker.outstanding = max(0, worker.outstanding - 1)
        worker.outstanding_tokens = max(0, worker.outstanding_tokens - tokens)
        if not failed:
            worker.consecutive_failures = 0
            return
        worker.consecutive_failures += 1
        if worker.consecutive_failures >= self.failure_threshold:
            worker.broken_until = time.monotonic() + self.break_seconds

    def mark_dead(self, worker: Worker) -> None:
        """The worker is unreachable: stop sending it work for a while."""
        worker.consecutive_failures = max(worker.consecutive_failures, self.failure_threshold)
        worker.broken_until = time.monotonic() + self.break_seconds
