"""Calls to the stage workers that survive a worker's failure: prefill retried on another worker, decode
resumed on another from the tokens the client already has.

Only worker faults count towards a worker's circuit breaker, never a client that left or a stop string.
A call of a request that runs out of time (its deadline, or the router's drain) ends it with ABORT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from qwenserve.router.fleet import WorkerFleet, remaining, stage_error
from qwenserve.router.prepared_request import PreparedRequest
from qwenserve.router.stream_watch import StreamOutOfTime, StreamStalled, StreamWatch
from qwenserve.router.workers import NoWorkerAvailable
from qwenserve.rpc_errors import detail_of
from qwenserve.telemetry.tracing import Attr, get_tracer
from qwenserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.router")

# Codes that mean the request itself is wrong: it ends with this error, no other worker is tried.
# Any other failure of a stage call is the worker's, and the request moves on to another worker.
CLIENT_MISTAKES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
# After these the worker is gone or going (dead, restarting, draining): send it nothing for a while.
WORKER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
# How long after abandoning a decode call that never answered the router releases its handoff itself.
HANDOFF_RELEASE_DELAY_S = 3.0
# ... and after a prefill call given up on, enough for an answer already sent to have been published.
UNREAD_PREFILL_RELEASE_DELAY_S = 0.5
# A failed prefill call with one of these may have left its handler running: free its handoff by name.
PREFILL_MAYBE_RUNNING = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                         grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}

# What a stage call yields: (token ids, logprobs, finish reason or 0, error detail).
Step = tuple[list[int], list[common_pb2.TokenLogprob], int, common_pb2.ErrorDetail | None]


@dataclass(slots=True)
class Progress:
    """What the client has received so far; failover resumes from here."""

    generated: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    first_token_at: float | None = None
    handoff_sent: bool = False  # a decode call carried the prefill's handoff: its worker releases it
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None  # once a worker computed them


class RequestFailed(Exception):
    """The request itself cannot go on: refused by a stage as invalid, or out of time."""

    def __init__(self, finish_reason: int, detail: common_pb2.ErrorDetail) -> None:
        super().__init__(detail.message)
        self.finish_reason = finish_reason
        self.detail = detail


async def prefill(fleet: WorkerFleet, prep: PreparedRequest) -> prefill_pb2.PrefillResponse:
    """Prefill on the least loaded worker; a failure of any kind but the request's own moves it on.

    Raises NoWorkerAvailable when no attempt succeeded (the decode worker then prefills locally),
    RequestFailed when the request itself was refused or ran out of time.
    """
    tried: list[str] = []
    request = prefill_pb2.PrefillRequest(**_stage_fields(prep), handoff_token=prep.handoff_token)
    tokens = len(prep.prompt_ids)
    for attempt in range(fleet.config.prefill_attempts):
        worker = fleet.prefill_pool.choose(prep.prompt_ids, exclude=tried)
        tried.append(worker.address)
        span = trace.get_current_span()
        span.set_attribute(Attr.WORKER, worker.address)
        span.set_attribute("qwenserve.attempt", attempt + 1)
        failed = False  # a client that leaves (CancelledError) is no fault of the worker
        fleet.prefill_pool.started(worker, tokens)
        try:
            if not await fleet.connected(worker.address):
                failed, why = True, f"no connection within {fleet.config.connect_timeout_s:g}s"
                fleet.prefill_pool.mark_dead(worker)
            else:
                stub = prefill_pb2_grpc.PrefillStub(fleet.channel(worker.address))
                timeout = remaining(fleet.cutoff(prep), fleet.prefill_timeout(tokens))
                try:
                    return await stub.Prefill(request, timeout=timeout)
                except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
                    if isinstance(e, asyncio.CancelledError) or e.code() in PREFILL_MAYBE_RUNNING:
                        # Given up while the worker may still publish the handoff (its answer in flight, or
                        # a stopped worker resumed later): its id is unknown here, so free it by the token it is
                        # bound to, before it is made if need be.
                        handle = common_pb2.KVHandle(control_endpoint=worker.address)
                        fleet.release_handoff(handle, prep.request_id, UNREAD_PREFILL_RELEASE_DELAY_S,
                                              token=prep.handoff_token)
                    raise
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and fleet.expired(prep):
                raise RequestFailed(common_pb2.FINISH_REASON_ABORT, fleet.cutoff_detail(prep)) from e
            if code in CLIENT_MISTAKES:
                raise RequestFailed(common_pb2.FINISH_REASON_ERROR, refusal(e)) from e
            failed = code != grpc.StatusCode.RESOURCE_EXHAUSTED  # an overloaded worker did nothing wrong
            if code in WORKER_GONE:
                fleet.prefill_pool.mark_dead(worker)
            why = f"{code.name}: {e.details()}"
        finally:
            fleet.prefill_pool.finished(worker, tokens, failed)
        log.warning("%s: prefill on %s failed (%s), attempt %d", prep.request_id, worker.address, why, attempt + 1)
        fleet.metrics.record_retry("prefill")
    raise NoWorkerAvailable(f"prefill failed on {tried}")


async def decode(
    fleet: WorkerFleet, prep: PreparedRequest, progress: Progress, start: decode_pb2.PrefilledStart | None,
    held: Step | None = None,
) -> AsyncIterator[Step]:
    """Stream from a decode worker; on a worker fault resume on another from the tokens so far.

    `held` (the prefill's first token) is yielded first, once a decode worker has taken the call: when none does,
    the request ends with nothing sent, and a model's fallback can still answer it."""
    tried: list[str] = []
    budget = prep.sampling.max_tokens or 0
    while True:
        try:
            worker = fleet.decode_pool.choose(prep.prompt_ids, exclude=tried)
        except NoWorkerAvailable:
            if not fleet.decode_pool.workers and fleet.config.cold_start_wait_s > 0 and not tried:
                if await fleet.wait_for_decode_worker(prep):
                    continue
                yield [], [], common_pb2.FINISH_REASON_ERROR, stage_error(
                    "cold_start_timeout", f"no decode worker is running (scaled to zero) and none became ready "
                    f"within {fleet.config.cold_start_wait_s:g}s; retry shortly", retryable=True)
                return
            # The addresses stay in the log lines above: clients are told none (GetStatus shows them to admins).
            yield [], [], common_pb2.FINISH_REASON_ERROR, stage_error(
                "no_decode_worker", f"no decode worker could finish the request ({len(tried)} tried); retry shortly",
                retryable=True)
            return
        tried.append(worker.address)
        fleet.decode_pool.started(worker, budget)
        # A span per attempt; current only while the call starts (this generator yields across it).
        span = tracer.start_span("decode", attributes={
            Attr.WORKER: worker.address, "qwenserve.attempt": len(tried), "qwenserve.handoff": start is not None,
        })
        request = decode_request(prep, progress, start)
        call: grpc.aio.UnaryStreamCall | None = None
        watch: StreamWatch | None = None
        answered = False  # the worker sent a message
        # Set only for a fault of the worker: the request then fails over. A client that leaves
        # (GeneratorExit at a yield, CancelledError at an await) or a normal finish leaves it unset.
        fault = ""
        failed = False  # whether the fault counts towards the worker's circuit breaker
        try:
            if not await fleet.connected(worker.address):
                fault, failed = f"no connection within {fleet.config.connect_timeout_s:g}s", True
                fleet.decode_pool.mark_dead(worker)
            else:
                call = start_decode(fleet, worker.address, request, span, prep)
                progress.handoff_sent = progress.handoff_sent or request.HasField("prefilled")
                accept_s = fleet.config.accept_timeout_s if worker.address in fleet.sends_headers_on_accept else None
                watch = StreamWatch(call, fleet.config.stall_timeout_s, lambda: fleet.drain_deadline, accept_s)
                fleet.watches.add(watch)
                if held is not None:
                    await watch.accepted()
                    answered = True  # its handler runs: it releases the handoff
                    step, held = held, None
                    yield step
                while True:
                    msg = await watch.read()
                    if msg is grpc.aio.EOF:
                        fault, failed = "the decode stream ended without a finish reason", True
                        break
                    answered = True
                    if not msg.token_ids and not msg.finish_reason:
                        continue  # a heartbeat: the worker is busy on this request (a long prompt)
                    if msg.token_ids:
                        progress.generated.extend(msg.token_ids)
                    if msg.prompt_logprobs and progress.prompt_logprobs is None:
                        progress.prompt_logprobs = list(msg.prompt_logprobs)
                    if msg.finish_reason:
                        if msg.HasField("usage") and not progress.cached_prompt_tokens:
                            progress.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                        error = msg.error if msg.HasField("error") else None
                        yield list(msg.token_ids), list(msg.logprobs), msg.finish_reason, error
                        return
                    yield list(msg.token_ids), list(msg.logprobs), 0, None
        except StreamStalled as e:
            fault, failed = str(e), True
            fleet.decode_pool.mark_dead(worker)
        except StreamOutOfTime:
            yield [], [], common_pb2.FINISH_REASON_ABORT, fleet.cutoff_detail(prep)
            return
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and fleet.expired(prep):
                yield [], [], common_pb2.FINISH_REASON_ABORT, fleet.cutoff_detail(prep)
                return
            if code == grpc.StatusCode.FAILED_PRECONDITION and start is not None:
                # The handoff was refused (layout or checksum): recompute the prompt locally instead.
                log.warning("%s: handoff refused by %s: %s", prep.request_id, worker.address, e.details())
                start = None
                tried.pop()
                continue
            if code in CLIENT_MISTAKES:
                yield [], [], common_pb2.FINISH_REASON_ERROR, refusal(e)
                return
            fault, failed = f"{code.name}: {e.details()}", code != grpc.StatusCode.RESOURCE_EXHAUSTED
            if code in WORKER_GONE:
                fleet.decode_pool.mark_dead(worker)
        finally:
            if watch is not None:
                watch.close()
                fleet.watches.discard(watch)
            if call is not None:
                call.cancel()  # a no-op after a finish; otherwise the worker aborts the request, frees the KV
                if request.HasField("prefilled") and not answered:
                    # gRPC drops a call cancelled before its handler ran, and with it the worker's duty to
                    # release the handoff: release it here, late enough for a handler that did run to
                    # have done it first (releases are idempotent).
                    fleet.release_handoff(request.prefilled.kv_handle, prep.request_id, HANDOFF_RELEASE_DELAY_S,
                                          token=request.prefilled.handoff_token)
            fleet.decode_pool.finished(worker, budget, failed)
            span.set_attribute(Attr.COMPLETION_TOKENS, len(progress.generated))
            span.end()
        fleet.metrics.record_failover("decode")
        if call is not None:
            start = None  # the failed worker may have consumed the handoff: recompute the prompt
        log.warning("%s: decode on %s failed (%s); resuming after %d tokens", prep.request_id,
                    worker.address, fault, len(progress.generated))


def decode_request(
    prep: PreparedRequest, progress: Progress, start: decode_pb2.PrefilledStart | None
) -> decode_pb2.DecodeRequest:
    """The call that continues a request on a decode worker: from the prefill's handoff when it still holds
    (nothing generated since), else prefilled there with the tokens generated so far."""
    request = decode_pb2.DecodeRequest(**_stage_fields(prep))
    if start is not None or progress.prompt_logprobs is not None:
        # Computed once, where the prompt was first computed: a decode worker that imports the KV or resumes
        # after a failover takes prefix-cache hits instead of scoring the prompt again.
        request.sampling.ClearField("prompt_logprobs")
    if start is not None and len(progress.generated) == 1:
        request.prefilled.CopyFrom(start)
    else:
        request.local_prefill = True
        request.resume_token_ids.extend(progress.generated)
    return request


def _stage_fields(prep: PreparedRequest) -> dict[str, Any]:
    """What a prefill and a decode call both carry: the stages' id, the prompt, sampling, salt and tier."""
    return {"request_id": prep.internal_id, "prompt_token_ids": prep.prompt_ids, "sampling": prep.wire_sampling,
            "cache_salt": prep.cache_salt, "priority": prep.priority}


def start_decode(
    fleet: WorkerFleet, address: str, request: decode_pb2.DecodeRequest, span: trace.Span, prep: PreparedRequest
) -> grpc.aio.UnaryStreamCall:
    """Start the Decode call, inside the attempt's span so the worker's spans are its children."""
    stub = decode_pb2_grpc.DecodeStub(fleet.channel(address))
    timeout = remaining(fleet.cutoff(prep), None)
    if span.is_recording():
        with trace.use_span(span, end_on_exit=False):
            return stub.Decode(request, timeout=timeout)
    return stub.Decode(request, timeout=timeout)


def refusal(error: grpc.aio.AioRpcError) -> common_pb2.ErrorDetail:
    """A stage's refusal of the request itself, in the stage's words (the ErrorDetail of its status); named
    from the status code when it sent none (OUT_OF_RANGE: it does not fit the context or KV cache)."""
    detail = detail_of(error)
    if detail is not None:
        return detail
    code = error.code()
    name = "context_length_exceeded" if code == grpc.StatusCode.OUT_OF_RANGE else code.name.lower()
    return stage_error(name, error.details() or "the request was refused")
