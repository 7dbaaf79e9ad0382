"""A stage started by a launcher (`qwen-serve up`, LocalCluster) dies with it and runs at the priority it was given.

The launcher passes `QWENSERVE_SUPERVISOR=PID:NICE:RESTARTS`; the stage applies it first thing (`apply()`, from
the command line's entry): the kernel sends it SIGTERM when the launcher dies (PR_SET_PDEATHSIG), its CPU
priority is lowered by NICE once it serves (`lower_priority()`, every thread of it: Linux keeps a nice value per
thread; threads started later inherit it), and its /metrics shows how many times the launcher has
restarted it (`qwenserve_stage_restarts`, as a kubelet's restart count: qwenserve/restarts.py). Done in the
stage rather than between fork and exec: in a launcher whose gRPC threads run (it probes the stages' health), a
fork that runs Python code runs gRPC's fork handlers too, which were seen aborting the child (out of threads)
about one start in five. Not lowered from the start: a prefill at nice 10 starting beside decode on two cores
got so little CPU that it began loading its weights only once decode was serving, and `up` was ready twice as late.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Gauge

ENV = "QWENSERVE_SUPERVISOR"
PR_SET_PDEATHSIG = 1
# Times the launcher restarted this process before it started (apply() sets it).
_restarts = 0
# How much lower_priority() lowers this process's priority (apply() sets it; 0 once applied).
_pending_nice = 0


def child_env(nice: int = 0, restarts: int = 0) -> dict[str, str]:
    """The variable a launcher gives each child: this process is its supervisor, which started it `restarts`
    times before."""
    return {ENV: f"{os.getpid()}:{nice}:{restarts}"}


def apply() -> None:
    """In the child: die with the supervisor, take its priority; nothing when not started by one."""
    raw = os.environ.pop(ENV, "")  # not inherited further: a stage's own children have no such supervisor
    if not raw:
        return
    pid, nice, restarts = (raw.split(":") + ["0", "0"])[:3]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(pid):  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
    global _restarts, _pending_nice
    _pending_nice = int(nice or 0)
    _restarts = int(restarts or 0)
    _restarts_gauge().set(_restarts)


def lower_priority() -> None:
    """Lower every thread of this process by the nice value the launcher gave (once; nothing without one)."""
    global _pending_nice
    if not _pending_nice:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            current = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(current + _pending_nice, 19))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    _pending_nice = 0


def restarts() -> int:
    """Times the launcher restarted this process after it exited (0 when not started by one)."""
    return _restarts


def _restarts_gauge() -> Gauge:
    """The stage's restart count on its /metrics (the default registry, which every stage serves)."""
    from prometheus_client import Gauge

    return Gauge("qwenserve_stage_restarts",
                 "Times the launcher (qwen-serve up) restarted this stage after it exited, before this process.")
