"""Prefill: run the prompt, sample the first token, export the prompt's KV into a handoff."""

from __future__ import annotations

import logging
import time
from typing import Any

from qwenserve.handoff_binding import MAX_TOKEN_CHARS, new_handoff_id
from qwenserve.kv_transfer.errors import KVPoolExhausted
from qwenserve.protocol import finish_reason_to_proto, logprobs_to_proto, prompt_logprobs_to_proto
from qwenserve.telemetry.engine_steps import EngineStepObserver
from qwenserve.telemetry.metrics import HandoffMetrics
from qwenserve.telemetry.tracing import Attr, get_tracer
from qwenserve.v1 import common_pb2, prefill_pb2
from qwenserve.worker.errors import BadRequest, Overloaded, PrefillFailed, WorkerUnavailable
from qwenserve.worker.handoff_telemetry import transport_label
from qwenserve.worker.requests import checked_cache_salt, checked_request, checked_request_id, engine_limits

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.prefill")


class PrefillWorker:
    """Owns nothing but references: the engine computes, the exporter holds the bytes under a lease.

    With `steps` the request's trace splits into queue and compute; with `handoff` each export is
    counted (bytes, and the seconds to checksum and publish it) by transport.
    """

    def __init__(
        self,
        engine: Any,
        exporter: Any,
        lease_s: float = 30.0,
        steps: EngineStepObserver | None = None,
        handoff: HandoffMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.exporter = exporter
        self.lease_s = lease_s
        self.steps = steps
        self.handoff = handoff

    async def prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        """Raises BadRequest for invalid input, Overloaded when the handoff finds no room, PrefillFailed when
        the prompt could not be computed or handed off, WorkerUnavailable when the engine is going away; never
        answers without a first token. A cancelled caller aborts the engine request and the slot."""
        request_id = checked_request_id(request.request_id, "prefill")
        cache_salt = checked_cache_salt(request.cache_salt)
        prompt, sampling = checked_request(request.prompt_token_ids, request.sampling, engine_limits(self.engine))
        if len(request.handoff_token) > MAX_TOKEN_CHARS:
            raise BadRequest(f"handoff_token must be at most {MAX_TOKEN_CHARS} characters", "handoff_token")
        with tracer.start_as_current_span("prefill", attributes={Attr.PROMPT_TOKENS: len(prompt)}) as span:
            return await self._prefill(request_id, prompt, sampling, cache_salt, span, request.priority,
                                       request.handoff_token)

    async def _prefill(
        self, request_id: str, prompt: list[int], sampling: Any, cache_salt: str | None, span: Any, priority: int = 0,
        handoff_token: str = "",
    ) -> prefill_pb2.PrefillResponse:
        slots: list[Any] = []
        no_room: list[KVPoolExhausted] = []

        def sink(layout: Any, num_tokens: int) -> Any:
            try:
                # The id's random part keeps others' handoffs out of reach of anyone who knows a request id; a
                # router that gave up on this call frees it by its token instead of by name.
                slot = self.exporter.reserve(new_handoff_id(request_id), layout, num_tokens, binding=handoff_token)
            except KVPoolExhausted as e:
                no_room.append(e)  # the engine ends the request with an error; this says which kind
                raise
            slots.append(slot)
            return slot  # the engine gathers its cache into it, hashing as the bytes land

        first: list[int] = []
        logprobs: list[common_pb2.TokenLogprob] = []
        prompt_logprobs: list[common_pb2.TokenLogprob] = []
        finish, cached, error, request_fault = None, 0, None, False
        traced = span.is_recording()
        if traced and self.steps is not None:
            self.steps.watch(request_id)
        submitted = time.time_ns()
        try:
            async for out in self.engine.generate(
                request_id, prompt, sampling, cache_salt=cache_salt, kv_export=sink, priority=priority
            ):
                first.extend(out.new_token_ids)
                logprobs.extend(logprobs_to_proto(out.new_token_ids, out.logprobs))
                prompt_logprobs.extend(prompt_logprobs_to_proto(out.prompt_logprobs))
                if out.finished:
                    finish, error, request_fault = out.finish_reason, out.error, out.request_fault
                    cached = out.usage.cached_prompt_tokens
        except BaseException:
            for slot in slots:
                slot.abort()
            raise
        finally:
            scheduled = self.steps.first_scheduled_ns(request_id) if traced and self.steps is not None else None
        if traced:
            _phase_spans(submitted, scheduled, time.time_ns())
            span.set_attribute(Attr.CACHED_TOKENS, cached)
        if finish not in ("stop", "length", "export") or not first:
            for slot in slots:
                slot.abort()
            raise _failure(request_id, finish, error, no_room, request_fault)
        response = prefill_pb2.PrefillResponse(
            request_id=request_id, first_token_id=first[0], cached_prompt_tokens=cached
        )
        if logprobs:
            response.first_logprob.CopyFrom(logprobs[0])
        response.prompt_logprobs.extend(prompt_logprobs)
        if finish in ("stop", "length") or not slots:
            # The first token already ends the request: there is nothing for decode to continue.
            for slot in slots:
                slot.abort()
            response.finish_reason = finish_reason_to_proto(finish or "stop")
            return response
        with tracer.start_as_current_span("handoff.export") as export_span:
            started = time.perf_counter()
            try:
                handle = slots[0].publish(self.lease_s)
            except Exception as e:
                slots[0].abort()
                log.exception("%s: publishing the KV handoff failed", request_id)
                raise PrefillFailed(f"the KV handoff could not be published: {type(e).__name__}: {e}") from e
            seconds = time.perf_counter() - started
            transport = transport_label(handle.transport)
            export_span.set_attribute(Attr.HANDOFF_TRANSPORT, transport)
            export_span.set_attribute(Attr.HANDOFF_BYTES, handle.length)
            export_span.set_attribute(Attr.HANDOFF_EXPORTER_WEIGHTS, handle.layout.weights)
        if self.handoff is not None:
            self.handoff.record_transfer(transport, handle.length, seconds)
        response.kv_handle.CopyFrom(handle)
        return response


def _failure(request_id: str, finish: str | None, error: str | None, no_room: list[KVPoolExhausted],
             request_fault: bool = False) -> Exception:
    """What to raise when the engine ended a prefill without a first token and a handoff."""
    if request_fault:  # the request's own grammar went past a bound: the client's error, not this worker's
        return BadRequest(error or "the request's grammar cannot go on", "sampling.structured")
    if no_room:
        return Overloaded(f"no room for the KV handoff: {no_room[0]}")
    if finish == "abort":
        return WorkerUnavailable("the prefill engine is shutting down")
    return PrefillFailed(f"prefill of {request_id} failed: {error or finish or 'the engine gave no first token'}")


def _phase_spans(submitted_ns: int, scheduled_ns: int | None, done_ns: int) -> None:
    """Children of the current span for the time queued in the engine and the time computing."""
    if scheduled_ns is None:
        return  # never scheduled (rejected up front): the parent span alone tells the story
    tracer.start_span("prefill.queue", start_time=submitted_ns).end(end_time=scheduled_ns)
    tracer.start_span("prefill.compute", start_time=scheduled_ns).end(end_time=done_ns)
