"""Worker choice: least outstanding work, prefix affinity within a slack, circuit breaking."""

from __future__ import annotations

import pytest

from qwenserve.router.workers import NoWorkerAvailable, WorkerPool


def test_least_outstanding_worker_is_chosen() -> None:
    pool = WorkerPool(["a", "b", "c"])
    pool.started(pool.workers["a"], 10)
    pool.started(pool.workers["b"], 10)
    assert pool.choose().address == "c"


def _serve_one(pool: WorkerPool, prompt: list[int] | None = None) -> str:
    """Choose, start and finish one call, as a request sent after the last one ended; the worker's address."""
    worker = pool.choose(prompt or [])
    pool.started(worker, 8)
    pool.finished(worker, 8, failed=False)
    return worker.address


def test_sequential_requests_take_turns_over_idle_workers() -> None:
    pool = WorkerPool(["a", "b", "c"])
    assert [_serve_one(pool) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_ties_in_load_go_to_the_worker_started_least_recently() -> None:
    pool = WorkerPool(["a", "b", "c"])
    pool.started(pool.workers["b"], 8)  # b busy, a and c idle: a gets the next, then c, then a again
    assert [_serve_one(pool) for _ in range(3)] == ["a", "c", "a"]
    pool.add("d")  # a new worker has never started a call: it is first among the idle ones
    assert _serve_one(pool) == "d"


def test_sequential_requests_with_a_shared_prefix_keep_their_affinity() -> None:
    pool = WorkerPool(["a", "b", "c"], affinity_tokens=4)
    prefix = [7, 7, 7, 7]
    assert len({_serve_one(pool, prefix + [i]) for i in range(6)}) == 1


def test_same_prefix_goes_to_the_same_worker_while_load_is_balanced() -> None:
    pool = WorkerPool(["a", "b", "c", "d"], affinity_tokens=4)
    prompt = [1, 2, 3, 4, 5, 6]
    first = pool.choose(prompt).address
    assert all(pool.choose(prompt[:4] + [9, 9]).address == first for _ in range(5))


def test_affinity_yields_when_the_preferred_worker_is_overloaded() -> None:
    pool = WorkerPool(["a", "b"], affinity_tokens=2, affinity_slack=1)
    prompt = [5, 6, 7]
    preferred = pool.workers[pool.choose(prompt).address]
    for _ in range(2):
        pool.started(preferred, 1)
    assert pool.choose(prompt).address != preferred.address


def test_repeated_failures_open_the_circuit_and_exclusions_are_respected() -> None:
    pool = WorkerPool(["a", "b"], failure_threshold=2, break_seconds=60)
    a = pool.workers["a"]
    for _ in range(2):
        pool.started(a, 1)
        pool.finished(a, 1, failed=True)
    assert pool.choose().address == "b"
    with pytest.raises(NoWorkerAvailable):
        pool.choose(exclude=["b"])


def test_success_resets_the_failure_count() -> None:
    pool = WorkerPool(["a"], failure_threshold=2)
    a = pool.workers["a"]
    pool.finished(a, 0, failed=True)
    pool.finished(a, 0, failed=False)
    pool.finished(a, 0, failed=True)
    assert pool.choose().address == "a"


def test_an_added_worker_is_chosen_and_a_removed_one_is_not() -> None:
    pool = WorkerPool(["a"])
    pool.started(pool.workers["a"], 1)
    pool.add("b")
    assert pool.choose().address == "b"
    pool.remove("b")
    assert pool.choose().address == "a"
    with pytest.raises(NoWorkerAvailable):
        pool.choose(exclude=["a"])


def test_a_removed_worker_drains_its_calls_before_it_is_reported_drained() -> None:
    drained: list[str] = []
    pool = WorkerPool(["a", "b"], on_drained=drained.append)
    b = pool.workers["b"]
    pool.started(b, 5)
    pool.started(b, 5)
    pool.remove("b")
    assert b.draining and "b" not in pool.workers and drained == []
    pool.finished(b, 5, failed=False)
    assert drained == []
    pool.finished(b, 5, failed=True)  # how its last call ended does not matter
    assert drained == ["b"] and not pool.draining


def test_an_idle_worker_is_drained_as_it_is_removed_and_unknown_ones_are_ignored() -> None:
    drained: list[str] = []
    pool = WorkerPool(["a"], on_drained=drained.append)
    pool.remove("a")
    pool.remove("nobody")
    assert drained == ["a"] and not pool.workers


def test_a_worker_back_before_it_drained_keeps_its_calls_and_is_not_reported_drained() -> None:
    drained: list[str] = []
    pool = WorkerPool(["a"], on_drained=drained.append)
    a = pool.workers["a"]
    pool.started(a, 3)
    pool.remove("a")
    assert pool.add("a") is a and not a.draining and a.outstanding == 1
    pool.finished(a, 3, failed=False)
    assert drained == [] and pool.choose().address == "a"
