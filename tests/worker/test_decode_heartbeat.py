"""Decode streams say they are alive while a request has nothing to send yet, and only while the engine moves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from qwenserve.engine.outputs import RequestOutput, TokenCounts
from qwenserve.v1 import common_pb2, decode_pb2
from qwenserve.worker.decode_worker import STUCK_STEP_S, DecodeWorker, _coalesced


async def _slow_outputs(delay_s: float) -> AsyncIterator[RequestOutput]:
    await asyncio.sleep(delay_s)  # a long prompt being prefilled
    yield RequestOutput("r", [7], None, True, "length", TokenCounts(4, 1, 0))


async def _collect(engine_moved: object, delay_s: float = 0.5) -> list[decode_pb2.DecodeResponse]:
    return [m async for m in _coalesced(_slow_outputs(delay_s), 0, 0.0, engine_moved, heartbeat_s=0.05)]  # type: ignore[arg-type]


def test_a_stream_waiting_for_its_first_token_sends_empty_heartbeats_while_the_engine_steps() -> None:
    messages = asyncio.run(_collect(lambda: True))
    heartbeats, last = messages[:-1], messages[-1]
    assert len(heartbeats) >= 3
    assert all(not m.token_ids and not m.finish_reason for m in heartbeats)
    assert list(last.token_ids) == [7] and last.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_stuck_engine_sends_no_heartbeat() -> None:
    messages = asyncio.run(_collect(lambda: False))
    assert len(messages) == 1 and list(messages[0].token_ids) == [7]


class _EngineClock:
    """The two facts the probe reads from an engine: steps begun, and how long the current one has run."""

    def __init__(self) -> None:
        self.steps_completed = 0
        self.running: float | None = None

    def step_running_s(self) -> float | None:
        return self.running


def test_a_long_step_counts_as_progress_until_it_looks_stuck() -> None:
    engine = _EngineClock()
    moved = DecodeWorker(engine, importer=None)._engine_moved()
    assert not moved()  # idle between probes: nothing to vouch for
    engine.steps_completed += 1
    assert moved()  # a new step began
    engine.running = 45.0  # one step of a long prompt on a busy CPU
    assert moved()
    engine.running = STUCK_STEP_S + 1
    assert not moved()
