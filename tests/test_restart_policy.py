"""`qwen-serve up`'s decision after a stage exits (qwenserve/restarts.py): restart it with a backoff that doubles
with each exit in a row and starts over after a stage served a while; stop only when it keeps failing at start."""

from __future__ import annotations

import pytest

from qwenserve.restarts import GiveUp, Restart, RestartPolicy, StageExit, after_exit

POLICY = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=8.0, max_start_failures=3, healthy_after_s=60.0)
SERVED_BRIEFLY = StageExit(ran_s=5.0, ready=True)
SERVED_LONG = StageExit(ran_s=600.0, ready=True)
FAILED_AT_START = StageExit(ran_s=2.0, ready=False)


def test_a_stage_that_served_and_died_is_restarted_after_the_initial_backoff() -> None:
    assert after_exit([SERVED_LONG], POLICY) == Restart(1.0)
    assert after_exit([SERVED_BRIEFLY], POLICY) == Restart(1.0)


def test_the_backoff_doubles_with_each_exit_in_a_row_up_to_its_bound() -> None:
    delays = [after_exit([SERVED_BRIEFLY] * n, POLICY) for n in range(1, 7)]
    assert delays == [Restart(1.0), Restart(2.0), Restart(4.0), Restart(8.0), Restart(8.0), Restart(8.0)]


def test_a_stage_that_served_long_before_it_died_starts_the_backoff_over() -> None:
    assert after_exit([SERVED_BRIEFLY] * 5 + [SERVED_LONG], POLICY) == Restart(1.0)
    assert after_exit([SERVED_BRIEFLY] * 5 + [SERVED_LONG, SERVED_BRIEFLY], POLICY) == Restart(2.0)


def test_a_stage_that_keeps_failing_at_start_stops_up_after_the_limit() -> None:
    assert after_exit([SERVED_LONG, FAILED_AT_START], POLICY) == Restart(2.0)
    assert after_exit([SERVED_LONG, FAILED_AT_START, FAILED_AT_START], POLICY) == Restart(4.0)
    assert after_exit([SERVED_LONG] + [FAILED_AT_START] * 3, POLICY) == GiveUp(start_failures=3)


def test_a_start_that_became_ready_resets_the_count_of_failed_starts() -> None:
    exits = [FAILED_AT_START, FAILED_AT_START, SERVED_BRIEFLY, FAILED_AT_START, FAILED_AT_START]
    assert isinstance(after_exit(exits, POLICY), Restart)
    assert after_exit([*exits, FAILED_AT_START], POLICY) == GiveUp(start_failures=3)


def test_one_failed_start_is_enough_when_the_limit_is_one() -> None:
    assert after_exit([FAILED_AT_START], RestartPolicy(max_start_failures=1)) == GiveUp(start_failures=1)
    assert after_exit([SERVED_BRIEFLY], RestartPolicy(max_start_failures=1)) == Restart(1.0)


def test_there_is_nothing_to_decide_without_an_exit() -> None:
    with pytest.raises(ValueError):
        after_exit([], POLICY)
