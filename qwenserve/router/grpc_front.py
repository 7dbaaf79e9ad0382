"""gRPC `Router.Generate` behind the gatekeeper: what the Router servicer's Generate delegates to.

    async def Generate(self, request, context):
        async for msg in generate(self.router, self.gatekeeper, request, context):
            yield msg

Errors before the stream starts end the call with the error's gRPC status (rate-limit values as
trailing metadata); once streaming, the router's terminal message carries any error.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from qwenserve.protocol import FINISH_REASON_NAMES
from qwenserve.router.admission import Gatekeeper, api_key_from_grpc_metadata, grpc_error_metadata
from qwenserve.router.errors import RouterError
from qwenserve.router.generation import Router
from qwenserve.v1 import common_pb2, router_pb2


async def generate(
    router: Router,
    gatekeeper: Gatekeeper,
    request: router_pb2.GenerateRequest,
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[router_pb2.GenerateResponse]:
    """Authenticate, prepare, admit, stream, settle: one gRPC Generate call."""
    arrived = time.monotonic()
    try:
        tenant = gatekeeper.authenticate(api_key_from_grpc_metadata(context.invocation_metadata()))
        gatekeeper.check_request(tenant, request)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        prep = await router.prepare(request, deadline)
        ticket = await gatekeeper.admit(tenant, [prep])
    except RouterError as e:
        context.set_trailing_metadata(grpc_error_metadata(e))
        await context.abort(e.grpc_code, e.message)
    await context.send_initial_metadata(ticket.grpc_metadata())
    usage = common_pb2.Usage(prompt_tokens=len(prep.prompt_ids), total_tokens=len(prep.prompt_ids))
    metrics = gatekeeper.metrics
    timer = metrics.stream_timer(arrived) if metrics is not None else None
    if metrics is not None:
        metrics.in_flight.inc()
    finish = ""
    try:
        async for msg in router.run(prep):
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
        await gatekeeper.finish(ticket, usage)
        if metrics is not None and timer is not None:
            metrics.in_flight.dec()
            timer.finish()
            outcome = "cancelled" if not finish else "error" if finish == "error" else "ok"
            metrics.record_finished(outcome, finish)
