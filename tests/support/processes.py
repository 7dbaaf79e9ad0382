"""The processes this test session started, and the shared-memory segments they left behind.

A leak check that counts every segment in /dev/shm raises a false alarm whenever anything else on the
machine makes segments (another test run, a bench). A segment's name carries its creator's pid
(`<prefix>-<pid>-<token>-<n>`, qwenserve/kv_transfer/shm.py), so the check counts only segments whose
creator this session started: the pytest process and its descendants, children of children included,
which a watcher thread records while they live (a stage loads torch for seconds before it makes a segment).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

# The default segment prefix (qwenserve/kv_transfer/shm.py): every prefix the tests give starts with it.
SEGMENT_PREFIX = "qwenserve-kv"
# How often the watcher walks the process tree: far shorter than a stage's start-up before its first segment
# (it imports torch and loads a model), long enough that a walk (some ms with torch's threads) costs ~1% of a core.
WATCH_PERIOD_S = 0.25


def descendants(root: int) -> set[int]:
    """The pids of every live descendant of `root` (through /proc/<pid>/task/<tid>/children)."""
    found: set[int] = set()
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:  # it exited meanwhile
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    stack.append(child)
    return found


def creator_pid(segment: str) -> int | None:
    """The pid in a segment's name, or None when the name is not `<prefix>-<pid>-<token>-<n>`."""
    parts = segment.rsplit("-", 3)
    return int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None


class SessionProcesses:
    """The pids of the processes this session started (its own included), recorded by a watcher thread."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.pids: set[int] = {self.root}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="session-processes", daemon=True)

    def start(self) -> SessionProcesses:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_PERIOD_S):
            self.record()

    def record(self) -> None:
        """Add the live descendants now (the watcher does this every WATCH_PERIOD_S)."""
        live = descendants(self.root)
        with self._lock:
            self.pids |= live

    def segments(self, prefix: str = SEGMENT_PREFIX) -> set[str]:
        """Segments in /dev/shm whose name starts with `prefix` and whose creator is one of this session's
        processes (the default prefix covers every prefix the tests give, `qwenserve-kvtest-...` too)."""
        # Imported here: every folder's conftest imports this file, most of which never need torch.
        from qwenserve.kv_transfer.shm import leaked_segments

        self.record()
        with self._lock:
            ours = set(self.pids)
        return {name for name in leaked_segments(prefix) if creator_pid(name) in ours}
