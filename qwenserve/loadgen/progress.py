"""A live progress line on stderr while a run goes: elapsed, sent, done, in flight, errors, output tok/s."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from qwenserve.loadgen.runner import LiveCounters


def progress_line(label: str, c: LiveCounters, now: float) -> str:
    """One status line (pure)."""
    elapsed = max(now - c.started_at, 1e-9)
    planned = f"/{c.planned}" if c.planned else ""
    return (f"[{label}] {elapsed:6.1f}s sent {c.sent}{planned} done {c.done} in-flight {c.in_flight} "
            f"errors {c.errors} out {c.output_tokens / elapsed:,.0f} tok/s")


async def show_progress(label: str, counters: LiveCounters, stream: TextIO = sys.stderr,
                        interval_s: float = 0.5) -> None:
    """Redraw the line in place (a terminal) or print one every 10 s (a log file), until cancelled."""
    tty = stream.isatty()
    last_print = 0.0
    try:
        while True:
            now = time.monotonic()
            if tty:
                stream.write("\r\033[K" + progress_line(label, counters, now))
                stream.flush()
            elif now - last_print >= 10.0:
                stream.write(progress_line(label, counters, now) + "\n")
                stream.flush()
                last_print = now
            await asyncio.sleep(interval_s)
    finally:
        if tty:
            stream.write("\r\033[K" + progress_line(label, counters, time.monotonic()) + "\n")
            stream.flush()
