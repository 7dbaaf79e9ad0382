"""A real prefill or decode stage whose engine's compute loop fails on cue (a helper process, not a test module).

    python faulty_stage.py prefill|decode [the stage's flags...]

Everything is the real stage, except that the engine's scheduler raises as soon as a request whose id starts
with `kill-the-loop` waits in it: a fault that belongs to no step, so the compute loop itself dies, as a bug
in the scheduler's bookkeeping would kill it. The tests watch what the process does then.
"""

from __future__ import annotations

import sys

from qwenserve.cli import main
from qwenserve.engine.scheduler import Scheduler, SchedulerOutput

KILL_PREFIX = "kill-the-loop"
_schedule = Scheduler.schedule


def _schedule_or_fail(self: Scheduler) -> SchedulerOutput:
    if any(seq.request_id.startswith(KILL_PREFIX) for seq in self.waiting):
        raise RuntimeError("injected scheduler fault")
    return _schedule(self)


if __name__ == "__main__":
    Scheduler.schedule = _schedule_or_fail  # type: ignore[method-assign]
    sys.exit(main(["serve", *sys.argv[1:]]))
