"""Progress of the slow steps of a start: first-use work (the default model, the vocabulary, the C kernels) and
weight loading, reported on stderr so that a start is never silent for long.

    with progress.step("loading weights from /models/qwen3", total=311, unit="tensors", total_bytes=size) as s:
        for tensor in tensors:
            ...
            s.advance(1, tensor.nbytes)

Where stderr is a terminal, a step is one line redrawn in place ("loading weights [=====>    ] 120/311
tensors 1.2/2.4 GB 3 s"), replaced by an end line when it finishes. Anywhere else (pipes, log files, CI,
JSON logs, the children of `qwen-serve up`) it is plain log lines: a start line once the step has taken
half a second, a line every 15 seconds for long steps, and always an end line with the duration, so a quick
step costs one line. Lines go through the `qwenserve.progress` logger (JSON under `--log-json`) once logging
is set up, else straight to stderr.

QWENSERVE_PROGRESS chooses: auto (the default, as above), bar, lines or off. QWENSERVE_PROGRESS_NAME is put in
front of every line; `qwen-serve up` sets both for its children (lines, named prefill-0, decode-0...), whose
output shares one terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

log = logging.getLogger("qwenserve.progress")

MODE_ENV = "QWENSERVE_PROGRESS"
NAME_ENV = "QWENSERVE_PROGRESS_NAME"
QUIET_FOR_S = 0.5  # a step that ends sooner prints only its end line (lines) or no bar (terminal)
LINE_EVERY_S = 15.0  # lines: how often a long step says how far it got
REDRAW_EVERY_S = 0.1
BAR_WIDTH = 24
CLEAR_LINE = "\r\x1b[K"

# The steps running now, innermost last: only the innermost draws its bar, so nested steps never fight.
_active: list[ProgressStep] = []
_active_lock = threading.Lock()


def _json_logging() -> bool:
    if os.environ.get("QWENSERVE_LOG_FORMAT", "").strip().lower() == "json":
        return True
    logs = sys.modules.get("qwenserve.telemetry.logs")  # not imported: no JSON handler can exist
    return logs is not None and any(
        isinstance(handler.formatter, logs.JsonFormatter) for handler in logging.getLogger().handlers
    )


def mode(stream: TextIO | None = None, allow_bar: bool = True) -> str:
    """How a step starting now reports on `stream` (stderr): "bar", "lines" or "off"."""
    wanted = os.environ.get(MODE_ENV, "auto").strip().lower()
    if wanted == "off":
        return "off"
    if not allow_bar or wanted == "lines":
        return "lines"
    if wanted == "bar":
        return "bar"
    stream = stream or sys.stderr
    terminal = stream.isatty() and os.environ.get("TERM") != "dumb"
    return "bar" if terminal and not _json_logging() else "lines"


def child_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """What a child process sharing the launcher's terminal needs: lines (never bars, which would interleave)
    named `name`, unless `env` turned progress off."""
    wanted = env.get(MODE_ENV, "auto").strip().lower()
    return {MODE_ENV: "off" if wanted == "off" else "lines", NAME_ENV: name}


def _columns(stream: TextIO) -> int:
    """The terminal's width: a bar longer than that would wrap, and only its last row could be redrawn."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


def _size(nbytes: float) -> tuple[float, str]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return nbytes / scale, unit
    return nbytes, "B"


def _bytes_text(done: int, total: int | None) -> str:
    if total:
        value, unit = _size(total)
        scale = total / value
        return f"{done / scale:.1f}/{value:.1f} {unit}"
    value, unit = _size(done)
    return f"{value:.1f} {unit}"


class ProgressStep:
    """One step being reported; `advance` it as work gets done (cheap: the drawing happens on its own thread)."""

    def __init__(self, what: str, total: int | None, unit: str, total_bytes: int | None, mode: str,
                 stream: TextIO) -> None:
        self.what = what
        self.total = total
        self.unit = unit
        self.total_bytes = total_bytes
        self.done = 0
        self.done_bytes = 0
        self.mode = mode
        self.stream = stream
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._drawn = False
        self._ticker = threading.Thread(target=self._tick, name=f"progress: {what}", daemon=True)

    def expect(self, total: int | None = None, total_bytes: int | None = None) -> None:
        """Set the totals once they are known (after the step started)."""
        self.total = total if total is not None else self.total
        self.total_bytes = total_bytes if total_bytes is not None else self.total_bytes

    def advance(self, count: int = 1, nbytes: int = 0) -> None:
        """Record `count` more items (and `nbytes` more bytes) done."""
        self.done += count
        self.done_bytes += nbytes

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def counts(self, totals: bool = True) -> str:
        """"120/311 tensors, 1.2/2.4 GB" (without the totals: "120 tensors, 1.2 GB") — whatever of that this
        step knows; "" when it counts nothing."""
        parts = []
        if self.total or self.done:
            parts.append(f"{self.done}/{self.total}" if self.total and totals else f"{self.done}")
            parts[-1] += f" {self.unit}" if self.unit else ""
        if self.total_bytes or self.done_bytes:
            parts.append(_bytes_text(self.done_bytes, self.total_bytes if totals else None))
        return ", ".join(parts)

    def bar(self, width: int = 80) -> str:
        """The in-place line, at most `width` characters: what (shortened first), a bar when the fraction done is
        known, the counts and the seconds so far."""
        fraction = None
        if self.total_bytes:
            fraction = self.done_bytes / self.total_bytes
        elif self.total:
            fraction = self.done / self.total
        parts = []
        if fraction is not None:
            filled = min(BAR_WIDTH, int(fraction * BAR_WIDTH))
            parts.append("[" + "=" * filled + (">" if filled < BAR_WIDTH else "") + " " * (BAR_WIDTH - filled - 1)
                         + "]")
        if counts := self.counts():
            parts.append(counts.replace(", ", " "))
        parts.append(f"{self.elapsed():.0f} s")
        tail = " " + " ".join(parts)
        room = width - len(tail)
        what = self.what if len(self.what) <= room else self.what[: max(0, room - 3)] + "..."
        return (what + tail)[:width]

    def _start(self) -> None:
        if self.mode != "off":
            with _active_lock:
                if _active:
                    _active[-1]._clear()
                _active.append(self)
            self._ticker.start()

    def _tick(self) -> None:
        if self.mode == "bar":
            shown = ""
            while not self._stop.wait(REDRAW_EVERY_S):
                with _active_lock:
                    if self.elapsed() < QUIET_FOR_S or _active[-1] is not self:
                        continue
                    line = self.bar(_columns(self.stream) - 1)
                    if line != shown or not self._drawn:
                        self.stream.write(CLEAR_LINE + line)
                        self.stream.flush()
                        self._drawn, shown = True, line
            return
        if self._stop.wait(QUIET_FOR_S):
            return
        _emit(f"{self.what} ...")
        while not self._stop.wait(LINE_EVERY_S):
            counts = self.counts()
            _emit(f"{self.what}: {counts + ', ' if counts else ''}{self.elapsed():.0f} s so far")

    def _clear(self) -> None:
        """Erase this step's bar from the terminal (the caller holds _active_lock)."""
        if self._drawn:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
            self._drawn = False

    def _finish(self, failed: bool) -> None:
        """Stop drawing; say how long the step took unless it failed (its error says what happened)."""
        if self.mode == "off":
            return
        self._stop.set()
        self._ticker.join()
        with _active_lock:
            self._clear()
            _active.remove(self)
        if not failed:
            counts = self.counts(totals=False)
            _emit(f"{self.what}: done in {self.elapsed():.1f} s{f' ({counts})' if counts else ''}")


@contextlib.contextmanager
def step(what: str, total: int | None = None, unit: str = "", total_bytes: int | None = None,
         allow_bar: bool = True) -> Iterator[ProgressStep]:
    """Report the step `what` (a phrase: "loading weights from DIR") on stderr while the block runs: a bar on a
    terminal unless `allow_bar` is False, log lines otherwise; an end line with its duration either way, unless
    the block raises."""
    stream = sys.stderr
    current = ProgressStep(what, total, unit, total_bytes, mode(stream, allow_bar), stream)
    current._start()
    try:
        yield current
    except BaseException:
        current._finish(failed=True)
        raise
    current._finish(failed=False)


def _emit(message: str) -> None:
    """One progress line: through logging once a handler is installed, else plain on stderr (JSON when
    QWENSERVE_LOG_FORMAT=json asks for it)."""
    if name := os.environ.get(NAME_ENV):
        message = f"{name}: {message}"
    if log.hasHandlers():
        log.info(message)
        return
    if _json_logging():
        from qwenserve.telemetry.logs import JsonFormatter

        message = JsonFormatter().format(log.makeRecord(log.name, logging.INFO, __file__, 0, message, None, None))
    print(message, file=sys.stderr, flush=True)
