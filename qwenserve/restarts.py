"""What `qwen-serve up` does when one of its stages exits: restart it after a backoff, or give up.

As a kubelet does for a pod's container: a stage that exits is started again on the same ports (the router's
channels point there and reconnect), after a delay that doubles with each exit in a row (from
`initial_backoff_s` to `max_backoff_s`) and starts over once a stage has served for `healthy_after_s`. A stage
that dies `max_start_failures` times in a row before it ever became ready (a bad flag, a model folder gone, a
port taken) will not come up by waiting: `up` stops, naming it. The decision is a pure function of the stage's
exits (`after_exit`); `qwenserve/up.py` acts on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """How `up` restarts a stage that exited."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # Exits in a row before the stage became ready after which `up` stops (it keeps failing at start).
    max_start_failures: int = 3
    # A stage that ran this long before it exited starts the backoff over, as a first failure would.
    healthy_after_s: float = 60.0


@dataclass(frozen=True)
class StageExit:
    """One end of a stage process: how long it ran, and whether it had become ready (gRPC health SERVING)."""

    ran_s: float
    ready: bool


@dataclass(frozen=True)
class Restart:
    """Start the stage again after `delay_s` seconds."""

    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """Stop `up`: the stage failed `start_failures` starts in a row."""

    start_failures: int


def after_exit(exits: Sequence[StageExit], policy: RestartPolicy) -> Restart | GiveUp:
    """What to do after the last of `exits` (the stage's exits so far, oldest first; at least one)."""
    if not exits:
        raise ValueError("after_exit needs the exit it decides about")
    start_failures = _trailing(exits, lambda e: not e.ready)
    if start_failures >= policy.max_start_failures:
        return GiveUp(start_failures)
    # An exit after a long enough run starts the backoff over: the exits in a row are the short runs since
    # (the newest ones), counting the exit that ended the long run as their first.
    short_runs = _trailing(exits, lambda e: e.ran_s < policy.healthy_after_s)
    in_a_row = short_runs if short_runs == len(exits) else short_runs + 1
    return Restart(min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** (in_a_row - 1)))


def _trailing(exits: Sequence[StageExit], counts: Callable[[StageExit], bool]) -> int:
    """How many of the last exits, counting back from the newest, satisfy `counts`."""
    n = 0
    for e in reversed(exits):
        if not counts(e):
            break
        n += 1
    return n
