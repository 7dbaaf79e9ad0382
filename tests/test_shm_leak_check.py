"""The leak checks' rule (tests/support/processes.py): a segment this session's processes leave behind is reported,
one that any other process on the machine made is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from qwenserve.kv_transfer.shm import SHM_DIR
from tests.support.processes import SessionProcesses

# Makes one segment, says its name, and once told to (stdin closed) exits without the cleanup a normal
# exit runs: the leak a killed or careless stage would leave.
LEAKER = ("import os, sys\n"
          "from qwenserve.kv_transfer.shm import ShmSegment\n"
          "print(ShmSegment.create(4096, sys.argv[1]).name, flush=True)\n"
          "sys.stdin.read()\n"
          "os._exit(0)\n")


def test_a_segment_a_dead_child_leaked_is_reported_and_a_strangers_is_not(
    session_processes: SessionProcesses,
) -> None:
    prefix = f"qwenserve-kvleakcheck-{uuid.uuid4().hex[:8]}"  # private: no other run's check ever sees these
    child = subprocess.Popen([sys.executable, "-c", LEAKER, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdin is not None
    leaked = child.stdout.readline().strip()
    # A process this session never started: the shell or runner above pytest.
    stranger = SHM_DIR / f"{prefix}-{os.getppid()}-00000000-1"
    stranger.write_bytes(b"\0")
    try:
        deadline = time.monotonic() + 10
        while child.pid not in session_processes.pids:  # the watcher thread, not the check, must see it
            assert time.monotonic() < deadline, "the watcher never recorded the session's child"
            time.sleep(0.05)
        child.stdin.close()
        assert child.wait(30) == 0
        assert (SHM_DIR / leaked).exists()  # the child really left it behind
        assert session_processes.segments(prefix) == {leaked}
    finally:
        (SHM_DIR / leaked).unlink(missing_ok=True)
        stranger.unlink(missing_ok=True)
    assert session_processes.segments(prefix) == set()
