"""Runs a load: sends requests on schedule (open loop) or keeping N in flight (closed loop), times every
streamed chunk, and always stops by itself.

Bounds: a request count, a duration (no new requests after it; in-flight ones get `drain_s` more, then
are cancelled and reported as "incomplete"), a per-request timeout, and a stop event (Ctrl-C) that
cancels everything at once. A failing or dead target only produces error records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from qwenserve.loadgen.stats import RequestRecord, split_chunk_gap
from qwenserve.loadgen.targets import LoadRequest, Target, TargetError


@dataclass(frozen=True, slots=True)
class Bounds:
    """When a run stops. At least one of num_requests / duration_s must be set (the CLI enforces it)."""

    num_requests: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    drain_s: float = 30.0


@dataclass(slots=True)
class LiveCounters:
    """What the progress display shows, updated as requests start and end."""

    started_at: float = field(default_factory=time.monotonic)
    sent: int = 0
    done: int = 0
    errors: int = 0
    output_tokens: int = 0
    planned: int | None = None

    @property
    def in_flight(self) -> int:
        return self.sent - self.done


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    stopped_by: str  # "completed", "duration", "count" or "interrupted"
    wall_s: float


async def run_request(target: Target, req: LoadRequest, t0: float, timeout_s: float,
                      counters: LiveCounters, record: RequestRecord) -> None:
    """Send one request and fill `record` as its chunks arrive. Never raises, except CancelledError
    (after marking the record "incomplete")."""
    sent = time.monotonic()
    record.start = sent - t0
    counters.sent += 1
    last = sent
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in target.stream(req):
                now = time.monotonic()
                if chunk.tokens:
                    if record.ttft is None:
                        record.ttft = now - sent
                    else:
                        record.itls += split_chunk_gap(now - last, chunk.tokens)
                    last = now
                    record.output_tokens += chunk.tokens
                    counters.output_tokens += chunk.tokens
                if chunk.usage is not None:
                    record.usage_prompt_tokens = chunk.usage.prompt_tokens
                    record.usage_completion_tokens = chunk.usage.completion_tokens
                    record.usage_cached_tokens = chunk.usage.cached_tokens
                if chunk.finish_reason:
                    record.finish_reason = chunk.finish_reason
                if chunk.error_code:
                    record.error = f"finish:{chunk.error_code}"
                    record.error_message = chunk.error_message
        if record.error is None and record.finish_reason is None:
            record.error = "no_finish_reason"  # the stream ended without its terminal message
        elif record.error is None and record.finish_reason == "abort":
            record.error = "finish:abort"
    except TargetError as e:
        record.error, record.error_message = e.kind, e.message
    except TimeoutError:
        record.error, record.error_message = "timeout", f"no end within {timeout_s:.1f}s"
    except asyncio.CancelledError:
        record.error = "incomplete"
        raise
    except Exception as e:  # noqa: BLE001 - a client-side bug in one request must not end the whole run
        record.error, record.error_message = f"client:{type(e).__name__}", str(e)
    finally:
        record.e2e = time.monotonic() - sent
        counters.done += 1
        counters.errors += record.error is not None


def _record_for(req: LoadRequest) -> RequestRecord:
    return RequestRecord(index=req.spec.index, start=0.0, prompt_tokens_sent=len(req.prompt.token_ids),
                         max_tokens=req.max_tokens, group=req.spec.group)


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` unless `stop` is set first; True when stopped."""
    if seconds <= 0:
        return stop.is_set()
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except TimeoutError:
        return False


async def _finish(tasks: list[asyncio.Task[None]], stop: asyncio.Event, drain_until: float | None) -> bool:
    """Wait for the in-flight tasks until they end, `stop` is set or `drain_until` passes; cancel the
    rest. True when some were cancelled."""
    pending = {t for t in tasks if not t.done()}
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while pending and not stop.is_set():
            timeout = None if drain_until is None else drain_until - time.monotonic()
            if timeout is not None and timeout <= 0:
                break
            done, _ = await asyncio.wait(pending | {stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
    finally:
        stopper.cancel()
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return bool(pending)


async def run_open_loop(target: Target, requests: list[LoadRequest], bounds: Bounds, stop: asyncio.Event,
                        counters: LiveCounters) -> RunResult:
    """Send each request at its spec's arrival time, whatever the server does."""
    t0 = time.monotonic()
    counters.started_at, counters.planned = t0, len(requests)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    stopped_by = "completed"
    for req in requests:
        if bounds.num_requests is not None and len(tasks) >= bounds.num_requests:
            stopped_by = "count"
            break
        at = req.spec.arrival_s or 0.0
        if bounds.duration_s is not None and at >= bounds.duration_s:
            stopped_by = "duration"
            break
        if await _wait(stop, t0 + at - time.monotonic()):
            break
        record = _record_for(req)
        records.append(record)
        tasks.append(asyncio.create_task(run_request(target, req, t0, bounds.request_timeout_s, counters, record)))
    drain_until = t0 + bounds.duration_s + bounds.drain_s if bounds.duration_s is not None else None
    cancelled = await _finish(tasks, stop, drain_until)
    if stop.is_set():
        stopped_by = "interrupted"
    elif cancelled:
        stopped_by = "duration"
    return RunResult(records, stopped_by, time.monotonic() - t0)


async def run_closed_loop(target: Target, make_request: Callable[[int], LoadRequest | None], concurrency: int,
                          bounds: Bounds, stop: asyncio.Event, counters: LiveCounters) -> RunResult:
    """Keep `concurrency` requests in flight; `make_request(i)` gives the i-th (None: no more)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    t0 = time.monotonic()
    counters.started_at, counters.planned = t0, bounds.num_requests
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    next_index = 0

    def take() -> LoadRequest | None:
        nonlocal next_index
        if stop.is_set() or (bounds.num_requests is not None and next_index >= bounds.num_requests):
            return None
        if bounds.duration_s is not None and time.monotonic() - t0 >= bounds.duration_s:
            return None
        req = make_request(next_index)
        next_index += 1
        return req

    async def worker() -> None:
        while (req := take()) is not None:
            record = _record_for(req)
            records.append(record)
            await run_request(target, req, t0, bounds.request_timeout_s, counters, record)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    drain_until = t0 + bounds.duration_s + bounds.drain_s if bounds.duration_s is not None else None
    cancelled = await _finish(tasks, stop, drain_until)
    if stop.is_set():
        stopped_by = "interrupted"
    elif cancelled or (bounds.duration_s is not None and time.monotonic() - t0 >= bounds.duration_s):
        stopped_by = "duration"
    else:
        stopped_by = "count" if bounds.num_requests is not None else "completed"
    records.sort(key=lambda r: r.start)
    return RunResult(records, stopped_by, time.monotonic() - t0)
