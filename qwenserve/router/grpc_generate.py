"""gRPC `Router.Generate` behind the gatekeeper: what the Router servicer's Generate delegates to.

    async def Generate(self, request, context):
        async for msg in generate(self.router, self.gatekeeper, request, context):
            yield msg

Errors before the stream starts end the call with the error's gRPC status, its ErrorDetail in the
status details (`qwenserve.rpc_errors`) and rate-limit values as trailing metadata; once streaming, the
router's terminal message carries any error.

The client's `request_id` must be 1 to 128 characters of `A-Z a-z 0-9 . _ : -`
(INVALID_ARGUMENT otherwise); an unusable `x-request-id` metadata value is ignored. Answers echo the
client's id; the stages see a unique internal id (see `qwenserve.router.request_ids`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

import grpc
from opentelemetry import trace

from qwenserve.protocol import FINISH_REASON_NAMES
from qwenserve.router.errors import RouterError
from qwenserve.router.gatekeeper import Gatekeeper, api_key_from_grpc_metadata, grpc_error_metadata
from qwenserve.router.generation import Router
from qwenserve.router.models import ModelRoutes
from qwenserve.router.request_ids import new_request_id, valid_request_id
from qwenserve.rpc_errors import abort
from qwenserve.telemetry.logs import bind_request_id
from qwenserve.telemetry.tracing import REQUEST_ID_METADATA_KEY, Attr, get_tracer
from qwenserve.v1 import common_pb2, router_pb2

tracer = get_tracer("qwenserve.router")

# How an error that ends a request before its stream starts is counted (requests_total's outcome).
_OUTCOMES = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected",
    grpc.StatusCode.UNAUTHENTICATED: "rejected",
    grpc.StatusCode.PERMISSION_DENIED: "rejected",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.OUT_OF_RANGE: "invalid",
    grpc.StatusCode.NOT_FOUND: "invalid",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
}


def outcome_for(error: RouterError) -> str:
    """The `outcome` label of a request refused with `error` ("rejected", "invalid", "timeout", "error")."""
    return _OUTCOMES.get(error.grpc_code, "error")


async def refuse(context: grpc.aio.ServicerContext, error: RouterError) -> NoReturn:
    """End the call with `error`: its status code and message, its ErrorDetail (and RetryInfo when it says
    when to retry) as the google.rpc.Status details, and its rate-limit headers as trailing metadata."""
    await abort(context, error.grpc_code, error.detail(), retry_after_s=error.retry_after_s,
                metadata=grpc_error_metadata(error))


def request_id_for(
    request: router_pb2.GenerateRequest, metadata: Sequence[tuple[str, str | bytes]] | None
) -> str:
    """The request's id: its own field (checked by `Router.prepare`), else the caller's x-request-id
    when it is a valid id, else a new one."""
    if request.request_id:
        return request.request_id
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA_KEY and isinstance(value, str) and valid_request_id(value):
            return value
    return new_request_id()


async def generate(
    router: Router | ModelRoutes,
    gatekeeper: Gatekeeper,
    request: router_pb2.GenerateRequest,
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[router_pb2.GenerateResponse]:
    """Authenticate, prepare, admit, stream, settle: one gRPC Generate call.

    The whole call runs in a `router.request` span (the parent of tokenize, rate_limit, prefill
    and decode) with the request id bound, so every log line and span of it carries the id.
    """
    request.request_id = request_id_for(request, context.invocation_metadata())
    # A bound id travels as metadata on every call to the stages: bind only a valid one (prepare() refuses
    # the others before any such call).
    bound = bind_request_id(request.request_id) if valid_request_id(request.request_id) else contextlib.nullcontext()
    with tracer.start_as_current_span("router.request") as span, bound:
        async with contextlib.aclosing(_generate(router, gatekeeper, request, context, span)) as stream:
            async for msg in stream:
                yield msg


async def _generate(
    routes: Router | ModelRoutes,
    gatekeeper: Gatekeeper,
    request: router_pb2.GenerateRequest,
    context: grpc.aio.ServicerContext,
    span: trace.Span,
) -> AsyncIterator[router_pb2.GenerateResponse]:
    arrived = time.monotonic()
    try:
        tenant = gatekeeper.authenticate(api_key_from_grpc_metadata(context.invocation_metadata()))
        if isinstance(routes, Router):
            routes.check_model(request.model)
            model, router = routes.config.model_name, routes
        else:
            model, router = routes.choose(request.model or None, tenant.models, key=tenant.id)
        gatekeeper.check_request(tenant, request)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        prep = await router.prepare(request, deadline, content_filter=tenant.content_filter)
        with tracer.start_as_current_span("rate_limit", attributes={Attr.TENANT: tenant.id}):
            ticket = await gatekeeper.admit(tenant, [prep], model=model)
    except RouterError as e:
        if gatekeeper.metrics is not None:
            gatekeeper.metrics.record_finished(outcome_for(e), "none")
        span.set_attribute("qwenserve.outcome", outcome_for(e))
        await refuse(context, e)
    await context.send_initial_metadata(ticket.grpc_metadata())
    usage = common_pb2.Usage(prompt_tokens=len(prep.prompt_ids), total_tokens=len(prep.prompt_ids))
    metrics = gatekeeper.metrics
    timer = metrics.stream_timer(arrived) if metrics is not None else None
    if metrics is not None:
        metrics.in_flight.inc()
    finish = ""
    first = True
    try:
        # Closed explicitly: a client that leaves cancels the decode call now, not at garbage collection.
        runs = router.run(prep) if isinstance(routes, Router) else routes.run(model, prep, tenant.models)
        async with contextlib.aclosing(runs) as stream:
            async for msg in stream:
                if first:
                    msg.model, first = msg.model or model, False  # a fallback's run names itself
                    ticket.model = msg.model
                # Counted as they stream, so a cancelled call still settles what it consumed.
                usage.completion_tokens += len(msg.token_ids)
                if msg.token_ids and timer is not None:
                    timer.token()
                if msg.HasField("usage"):
                    usage.CopyFrom(msg.usage)
                if msg.finish_reason:
                    finish = FINISH_REASON_NAMES.get(msg.finish_reason, "error")
                yield msg
    finally:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        try:
            await gatekeeper.finish(ticket, usage)  # runs to its end even if this call is cancelled
        finally:
            if metrics is not None and timer is not None:
                metrics.in_flight.dec()
                timer.finish()
                outcome = "cancelled" if not finish else "error" if finish == "error" else "ok"
                metrics.record_finished(outcome, finish)
        span.set_attribute(Attr.FINISH_REASON, finish or "none")
        span.set_attribute(Attr.COMPLETION_TOKENS, usage.completion_tokens)
