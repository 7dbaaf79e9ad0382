"""Decode: import a handoff (or prefill locally), join the running batch, stream token ids."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from opentelemetry import trace

from qwenserve.engine.kv_handoff import KVImport
from qwenserve.kv_layout import KVLayoutMismatch
from qwenserve.kv_transfer.errors import KVEndpointUnreachable, KVTransferError
from qwenserve.protocol import finish_reason_to_proto, logprobs_to_proto, prompt_logprobs_to_proto
from qwenserve.telemetry.engine_steps import EngineStepObserver
from qwenserve.telemetry.metrics import HandoffMetrics
from qwenserve.telemetry.tracing import Attr, get_tracer
from qwenserve.v1 import common_pb2, decode_pb2
from qwenserve.worker.errors import BadRequest, HandoffRefused
from qwenserve.worker.handoff_telemetry import failure_reason, transport_label
from qwenserve.worker.requests import checked_cache_salt, checked_request, checked_request_id, engine_limits

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.decode")

# How often a stream with nothing to send tells the router it is alive: well inside the router's stall
# timeout (--stall-timeout-s, 30 s by default), so a long prompt prefilled here is not taken for a hang.
HEARTBEAT_S = 5.0
# A step that has run this long is taken for a hang: heartbeats stop and the router fails the stream over.
STUCK_STEP_S = 600.0
# How long a cancelled import's release waits for the engine to let go of the request (an abort waits at
# most one step) before it releases anyway.
ENGINE_LET_GO_S = 30.0
# Release tasks in flight: held so the event loop does not drop them half done.
_BACKGROUND: set[asyncio.Task[None]] = set()


class DecodeWorker:
    """Streams one request's tokens; coalesces several steps into one message when the reader lags.

    With `steps` the request's trace splits into queue, first token and stream; with `handoff`
    each import is counted (bytes and fetch seconds, or the failure's reason) by transport.
    """

    def __init__(
        self,
        engine: Any,
        importer: Any,
        steps: EngineStepObserver | None = None,
        handoff: HandoffMetrics | None = None,
        stream_interval_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.importer = importer
        self.stream_interval_s = stream_interval_s
        self.steps = steps
        self.handoff = handoff

    async def decode(self, request: decode_pb2.DecodeRequest) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """Raises BadRequest / HandoffRefused before the first message; afterwards errors end the stream. A request
        the engine fails ends with finish_reason ERROR and an ErrorDetail; if the engine dies, EngineDeadError."""
        # Not made current across yields: an async generator may be closed from another context.
        span = tracer.start_span("decode")
        timing = _Timing()
        traced = span.is_recording()
        held = _HeldHandoff(self.importer, self.engine)
        try:
            if traced:
                with trace.use_span(span, end_on_exit=False):
                    outputs, cached = await self._start(request, timing, traced, held)
                outputs = timing.watch(outputs)
            else:
                outputs, cached = await self._start(request, timing, traced, held)
            async for msg in _coalesced(outputs, cached, self.stream_interval_s, self._engine_moved()):
                yield msg
        except Exception as e:
            span.record_exception(e)
            span.set_status(trace.StatusCode.ERROR, str(e) or type(e).__name__)
            raise
        finally:
            # Ended before the engine copied the import (a cancel during the fetch, before the first output):
            # the handoff still goes back, here rather than in a generator that may never have started.
            held.release_when_engine_lets_go()
            if traced:
                timing.spans(span, self.steps.first_scheduled_ns(timing.request_id) if self.steps else None)
            span.end()

    def _engine_moved(self) -> Callable[[], bool]:
        """A probe: whether the engine began a step since the probe's last call, or is in one that has not yet
        run for STUCK_STEP_S (a slow step is progress; one that never ends is a hang)."""
        seen = [self.engine.steps_completed]

        def moved() -> bool:
            now, running = self.engine.steps_completed, self.engine.step_running_s()
            moved = now != seen[0] or (running is not None and running < STUCK_STEP_S)
            seen[0] = now
            return moved

        return moved

    async def _start(
        self, request: decode_pb2.DecodeRequest, timing: _Timing, traced: bool, held: _HeldHandoff
    ) -> tuple[AsyncIterator[Any], int]:
        """Check the request, import its handoff and submit it; the engine's outputs and cached tokens."""
        start = request.WhichOneof("start")
        if start is None:
            raise BadRequest("one of prefilled or local_prefill is required")
        request_id = checked_request_id(request.request_id, "decode")
        cache_salt = checked_cache_salt(request.cache_salt)
        # What was generated already: the prefill's first token, or the tokens before a failover.
        resume = [request.prefilled.first_token_id] if start == "prefilled" else list(request.resume_token_ids)
        prompt, sampling = checked_request(request.prompt_token_ids, request.sampling, engine_limits(self.engine),
                                           resume)
        kv_import, handle = None, None
        cached = 0
        if start == "prefilled":
            handle = held.handle = request.prefilled.kv_handle
            held.token = request.prefilled.handoff_token
            held.request_id = request_id
            kv_import = await self._import(held, len(prompt))
            cached = request.prefilled.cached_prompt_tokens
        timing.request_id = request_id
        if traced and self.steps is not None:
            self.steps.watch(request_id)
        timing.submitted = time.time_ns()
        outputs = self.engine.generate(
            request_id, prompt, sampling, cache_salt=cache_salt, resume_token_ids=resume, kv_import=kv_import,
            priority=request.priority,
        )
        if handle is not None:
            outputs = _release_after_first(outputs, held)
        return outputs, cached

    async def _import(self, held: _HeldHandoff, prompt_len: int) -> KVImport:
        handle = held.handle
        transport = transport_label(handle.transport)
        importer_weights = self.engine.kv_layout().weights
        attributes = {Attr.HANDOFF_TRANSPORT: transport, Attr.HANDOFF_BYTES: handle.length,
                      Attr.HANDOFF_EXPORTER_WEIGHTS: handle.layout.weights,
                      Attr.HANDOFF_IMPORTER_WEIGHTS: importer_weights}
        with tracer.start_as_current_span("handoff", attributes=attributes) as span:
            started = time.perf_counter()
            try:
                if handle.num_tokens != prompt_len:
                    raise KVLayoutMismatch(
                        f"the handoff holds {handle.num_tokens} tokens, the prompt has {prompt_len}"
                    )
                tensor, state = await self.importer.fetch_payload(handle, self.engine.kv_layout(), token=held.token)
            except (KVTransferError, KVLayoutMismatch, OSError) as e:
                # OSError: what the handle names could not be read; the router recomputes the prompt instead.
                if self.handoff is not None:
                    self.handoff.record_failure(transport, failure_reason(e))
                span.set_attribute("qwenserve.handoff.failure", failure_reason(e))
                # An address that cannot be dialled is a deployment mistake that would recompute every prompt.
                log.log(logging.ERROR if isinstance(e, KVEndpointUnreachable) else logging.WARNING,
                        "handoff refused: %s", e)
                await held.release("failed")
                raise HandoffRefused(str(e)) from e
            seconds = time.perf_counter() - started
            span.set_attribute("qwenserve.handoff.seconds", seconds)
            if self.handoff is not None:
                self.handoff.record_transfer(transport, handle.length, seconds)
                self.handoff.record_precisions(handle.layout.weights, importer_weights)
        return KVImport(kv=tensor, layout=self.engine.kv_layout(), state=state)


class _HeldHandoff:
    """The handoff one decode call imports: given back exactly once, and never while the engine may still be
    copying from it (an shm import is a view of the exporter's memory, which reuses the bytes once released)."""

    def __init__(self, importer: Any, engine: Any) -> None:
        self.importer = importer
        self.engine = engine
        self.handle: Any = None
        self.token = ""  # what the handoff is bound to: presented to its exporter
        self.request_id = ""
        self.done = False

    async def release(self, reason: str) -> None:
        if self.handle is None or self.done:
            return
        self.done = True
        await self.importer.release(self.handle, reason, token=self.token)

    def release_when_engine_lets_go(self) -> None:
        """Release in the background once the engine no longer holds the request (it copies imports on its own
        thread, between the abort being asked and being done); not awaited, as this may run while cancelled."""
        if self.handle is None or self.done:
            return
        self.done = True
        task = asyncio.ensure_future(self._release_after_engine())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _release_after_engine(self) -> None:
        give_up = time.monotonic() + ENGINE_LET_GO_S
        while self.engine.holds(self.request_id) and time.monotonic() < give_up:
            await asyncio.sleep(0.005)
        await self.importer.release(self.handle, "cancelled", token=self.token)


async def _release_after_first(outputs: AsyncIterator[Any], held: _HeldHandoff) -> AsyncIterator[Any]:
    """The engine has copied the import into its own blocks by the time the first output exists."""
    async for out in outputs:
        await held.release("imported")
        yield out


class _Timing:
    """When a decode request was submitted, produced its first output and its last, for its spans."""

    def __init__(self) -> None:
        self.request_id = ""
        self.submitted: int | None = None
        self.first: int | None = None
        self.last: int | None = None
        self.tokens = 0

    async def watch(self, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Pass `outputs` through, noting the time of the first and the latest."""
        try:
            async for out in outputs:
                now = time.time_ns()
                if self.first is None:
                    self.first = now
                self.last = now
                self.tokens += len(out.new_token_ids)
                yield out
        finally:
            await outputs.aclose()

    def spans(self, parent: trace.Span, scheduled: int | None) -> None:
        """queue (submitted -> first step), first_token (-> first output), stream (-> last output)."""
        parent.set_attribute(Attr.COMPLETION_TOKENS, self.tokens)
        context = trace.set_span_in_context(parent)
        if self.submitted is not None and scheduled is not None:
            tracer.start_span("decode.queue", context=context, start_time=self.submitted).end(end_time=scheduled)
        if self.first is not None:
            begin = scheduled if scheduled is not None else self.submitted
            tracer.start_span("decode.first_token", context=context, start_time=begin).end(end_time=self.first)
            tracer.start_span("decode.stream", context=context, start_time=self.first).end(end_time=self.last)


async def _coalesced(
    outputs: AsyncIterator[Any],
    cached_from_prefill: int,
    interval_s: float = 0.0,
    engine_moved: Callable[[], bool] | None = None,
    heartbeat_s: float = HEARTBEAT_S,
) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """Drain the engine into a buffer; each message carries everything produced since the last one.

    While no token comes (a long prompt prefilled here, a queue, preemption), an empty message goes out
    every `heartbeat_s` in which `engine_moved()` says the engine made progress: the router fails a stream over
    when it hears nothing for its stall timeout, and a long prompt is no stall. A stuck engine sends none.

    With `interval_s` > 0, messages after the first are sent at most that often: a Python gRPC stream
    costs the same per message whatever it carries, so fewer, fuller messages raise the tokens a router
    core can relay, at the price of up to `interval_s` added to inter-token latency (TTFT is unaffected).
    """
    pending: list[Any] = []
    ready = asyncio.Event()
    done: list[BaseException | None] = []

    async def pump() -> None:
        try:
            async for out in outputs:
                pending.append(out)
                ready.set()
            done.append(None)
        except BaseException as e:  # handed to the writer, which re-raises it in the servicer's task
            done.append(e)
        finally:
            ready.set()

    # One repeating timer for the heartbeat (an asyncio timeout around every wait costs each message more):
    # a tick that finds nothing sent since the last one wakes the writer to send an empty message.
    sent, beat_due = [False], [False]
    beat: list[asyncio.TimerHandle | None] = [None]

    def tick() -> None:
        if not sent[0]:
            beat_due[0] = True
            ready.set()
        sent[0] = False
        beat[0] = loop.call_later(heartbeat_s, tick)

    loop = asyncio.get_running_loop()
    if engine_moved is not None:
        beat[0] = loop.call_later(heartbeat_s, tick)
    task = asyncio.create_task(pump())
    try:
        while True:
            await ready.wait()
            ready.clear()
            if beat_due[0]:
                beat_due[0] = False
                if not pending and engine_moved is not None and engine_moved():
                    yield decode_pb2.DecodeResponse()
            batch, pending[:] = list(pending), []
            if batch:
                sent[0] = True
                msg = decode_pb2.DecodeResponse()
                for out in batch:
                    msg.token_ids.extend(out.new_token_ids)
                    msg.logprobs.extend(logprobs_to_proto(out.new_token_ids, out.logprobs))
                    msg.prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
                last = batch[-1]
                if last.finished:
                    msg.finish_reason = finish_reason_to_proto(last.finish_reason)
                    if last.finish_reason == "error":
                        # A request at fault (its grammar past a bound) is the client's error, not this worker's.
                        msg.error.CopyFrom(common_pb2.ErrorDetail(
                            code="invalid_argument" if last.request_fault else "engine_error",
                            message=last.error or "the engine failed this request"
                        ))
                    usage = last.usage
                    msg.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=usage.prompt_tokens,
                        completion_tokens=usage.completion_tokens,
                        cached_prompt_tokens=max(usage.cached_prompt_tokens, cached_from_prefill),
                        total_tokens=usage.prompt_tokens + usage.completion_tokens,
                    ))
                    yield msg
                    return
                yield msg
                if interval_s > 0:
                    await asyncio.sleep(interval_s)  # the pump keeps collecting meanwhile
            if done and not pending:
                if done[0] is not None:
                    raise done[0]
                return
    finally:
        if beat[0] is not None:
            beat[0].cancel()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await outputs.aclose()
