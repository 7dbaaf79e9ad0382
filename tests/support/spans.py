"""Spans as the OTLP receiver process (tests/support/otlp_receiver.py) writes them, read back by the tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an OTLP receiver sees it (ids in hex; parent "" for a root)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any] = field(hash=False)


class SpanReceiver:
    """Reads the spans the OTLP receiver process has written so far."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def snapshot(self) -> list[ReceivedSpan]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        return [ReceivedSpan(**json.loads(line)) for line in lines if line.endswith("}")]

    def wait_for(self, ready: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 15.0) -> list[ReceivedSpan]:
        """The spans so far, once `ready(spans)` holds (fails the test after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if ready(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                pytest.fail(f"spans never arrived as expected; have {names}")
            time.sleep(0.1)
