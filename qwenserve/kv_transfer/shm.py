"""POSIX shared-memory segments in /dev/shm: created owner-only by the exporter, mapped by importers.

A segment is named `<prefix>-<pid>-<token>-<n>` so that leaks are easy to find. Its creator holds
an exclusive flock on it for as long as it lives: any process can then tell a dead owner's
segment from a live one (even across PID namespaces, which share /dev/shm through a host path)
and reap it. Segments are unlinked on close, at interpreter exit and on SIGTERM/SIGHUP when the
application has no handler of its own.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import re
import secrets
import signal
import stat
import threading
import time
from pathlib import Path

import torch

from qwenserve.kv_transfer.errors import KVHandoffGone

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "qwenserve-kv"
#: A segment younger than this is never reaped: its creator may not hold the lock yet.
REAP_MIN_AGE_S = 2.0

#: What a segment name may look like: one plain file name in /dev/shm, never a path.
SEGMENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")

_live: dict[str, ShmSegment] = {}
# Re-entrant: the SIGTERM handler may run while the main thread holds it.
_live_lock = threading.RLock()
# 128 random bits, so no name can be predicted and created first. Names are not secrets (anyone may list
# /dev/shm): what keeps other users from a handoff's bytes is the segment's owner-only mode.
_token = secrets.token_hex(16)
_counter = 0
_exit_cleanup_installed = False


class ShmSegment:
    """One writable shared-memory segment owned by this process, as a uint8 tensor."""

    def __init__(self, name: str, size: int, fd: int, buffer: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._fd = fd
        self._mmap = buffer
        self._owner_pid = os.getpid()
        self.bytes = torch.frombuffer(buffer, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int, prefix: str = DEFAULT_PREFIX, prefault: bool = True) -> ShmSegment:
        """Create a segment of `size` bytes (mode 0600), locked and registered for exit cleanup."""
        global _counter
        _install_exit_cleanup()
        with _live_lock:
            _counter += 1
            name = f"{prefix}-{os.getpid()}-{_token}-{_counter}"
        path = SHM_DIR / name
        # O_EXCL: never adopt someone else's file; the mode is applied atomically at creation.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        segment = cls(name, size, fd, buffer)
        with _live_lock:
            _live[name] = segment
        if prefault:
            # Touch every page now so that handoffs later write at memcpy speed, not page-fault speed.
            segment.bytes.zero_()
        return segment

    def close(self) -> None:
        """Unlink the segment; importers that still map it keep their pages until they unmap."""
        with _live_lock:
            if _live.pop(self.name, None) is None:
                return
        if os.getpid() == self._owner_pid:
            (SHM_DIR / self.name).unlink(missing_ok=True)
        os.close(self._fd)
        # The mapping itself goes away with the last tensor view; closing it here would fail
        # (or crash readers) while views are exported.
        self.bytes = torch.empty(0, dtype=torch.uint8)


def map_segment(name: str) -> torch.Tensor:
    """Map a segment another process created, copy-on-write so this side can never corrupt it.

    Raises KVHandoffGone when the segment no longer exists (released, reclaimed, exporter gone) or the name
    does not name a segment this process may map (a handle from elsewhere must never reach other files).
    """
    if not SEGMENT_NAME.fullmatch(name) or name in (".", ".."):
        raise KVHandoffGone(f"shared-memory segment name {name[:64]!r} is not a /dev/shm segment name")
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError as e:
        raise KVHandoffGone(
            f"shared-memory segment {name} is gone: the exporter released it or exited"
        ) from e
    except OSError as e:
        raise KVHandoffGone(f"shared-memory segment {name} cannot be opened: {e.strerror}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            raise KVHandoffGone(f"{SHM_DIR / name} is not a shared-memory segment with data in it")
        buffer = mmap.mmap(fd, info.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise KVHandoffGone(f"shared-memory segment {name} cannot be mapped: {e.strerror}") from e
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def leaked_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of segments in /dev/shm that start with `prefix` (for tests and health checks)."""
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def reap_orphaned_segments(prefix: str = DEFAULT_PREFIX, min_age_s: float = REAP_MIN_AGE_S) -> list[str]:
    """Unlink segments under `prefix` whose creator died without cleaning up (e.g. kill -9).

    A live creator holds an exclusive flock, so a lock we can take means the owner is gone.
    Segments younger than `min_age_s` are left alone. Returns the names it removed.
    """
    reaped = []
    for name in leaked_segments(prefix):
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            if time.time() - os.fstat(fd).st_ctime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # the owner is alive
            path.unlink(missing_ok=True)
            reaped.append(name)
        finally:
            os.close(fd)
    return reaped


def close_all_segments() -> None:
    """Unlink every segment this process created (exit and signal cleanup)."""
    with _live_lock:
        segments = list(_live.values())
    for segment in segments:
        segment.close()


def _on_fatal_signal(signum: int, frame: object) -> None:
    close_all_segments()
    # Die the way the signal would have killed us, so the parent sees the usual status.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_cleanup() -> None:
    global _exit_cleanup_installed
    if _exit_cleanup_installed:
        return
    _exit_cleanup_installed = True
    atexit.register(close_all_segments)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        # An application handler (graceful drain) ends in a normal exit, where atexit cleans up.
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_fatal_signal)
