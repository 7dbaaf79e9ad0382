"""Stage credentials: prefill, decode, the KV transfer and the tokenizer serve only their deployment's own stages.

A deployment shares one secret (qwenserve/stage_secret.py). Callers (the router, decode fetching KV from prefill)
send the credential derived from it in the metadata of every call; a stage server checks it, in constant time,
before any handler or deserializer runs. A call without it is UNAUTHENTICATED, one with another deployment's is
UNAUTHENTICATED too; both are counted (`qwenserve_stage_auth_refusals_total`). Health checking and reflection stay
open, for probes and tools.

No file configured means the stage accepts any caller, as before credentials existed, and says so in a
warning at start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from qwenserve.rpc_errors import abort, error_detail
from qwenserve.stage_secret import StageSecret, load_stage_secret
from qwenserve.telemetry.metrics import stage_auth_metrics

log = logging.getLogger(__name__)

#: The metadata key that carries a caller's stage credential.
CREDENTIAL_METADATA_KEY = "x-qwenserve-stage-credential"
#: Methods any caller may use: health checking (probes, `qwen-serve up`) and reflection (grpcurl).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: A refused call that streams requests is read (never parsed) up to this long and this many messages first.
REFUSED_STREAM_DRAIN_S = 0.5
REFUSED_STREAM_DRAIN_MESSAGES = 16


def credential_interceptors(secret: StageSecret | None) -> list[aio.ClientInterceptor]:
    """Interceptors that add the deployment's credential to every call of a grpc.aio channel (none: no secret)."""
    if secret is None:
        return []
    metadata = (CREDENTIAL_METADATA_KEY, secret.credential)
    return [_UnaryUnary(metadata), _UnaryStream(metadata), _StreamUnary(metadata), _StreamStream(metadata)]


def guarding_secret(path: str, stage: str) -> StageSecret | None:
    """The secret a serving stage checks callers against; without one, a warning that it serves any caller."""
    secret = load_stage_secret(path)
    if secret is None:
        log.warning("%s: no --stage-secret-file: any process that can reach this port may call it (qwen-serve up "
                    "and the operator give every stage one)", stage)
    return secret


class StageAuthInterceptor(aio.ServerInterceptor):
    """Refuses every call but health and reflection that lacks the deployment's credential."""

    def __init__(self, secret: StageSecret) -> None:
        self._secret = secret
        self._refusals = stage_auth_metrics().refusals

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        presented = next((value for key, value in handler_call_details.invocation_metadata or ()
                          if key == CREDENTIAL_METADATA_KEY), None)
        if self._secret.accepts(presented):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC's own UNIMPLEMENTED
            return handler
        reason = "missing" if presented is None else "wrong"
        self._refusals.labels(method.lstrip("/").partition("/")[0], reason).inc()
        log.info("refused %s: %s stage credential", method, "no" if presented is None else "a wrong")
        message = ("this is a stage of a qwen-serve deployment: only its own stages may call it (they send "
                   "the credential of the deployment's --stage-secret-file)")
        return _refusal(handler, message, reason)


def _refusal(handler: grpc.RpcMethodHandler, message: str, reason: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that refuses the call; the request's bytes are never parsed."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort(context, grpc.StatusCode.UNAUTHENTICATED,
                    error_detail(f"stage_credential_{reason}", message))

    async def refuse_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        # A client still writing when the status arrives gets INTERNAL from its own failed write (grpc.aio),
        # not our UNAUTHENTICATED: let a short request stream finish first. No deserializer is set, so the
        # bytes are never parsed, and a stream that goes on is cut off by count and time.
        try:
            async with asyncio.timeout(REFUSED_STREAM_DRAIN_S):
                count = 0
                async for _ in requests:
                    count += 1
                    if count >= REFUSED_STREAM_DRAIN_MESSAGES:
                        break
        except TimeoutError:
            pass
        await refuse(None, context)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse_stream)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)


class _AddsCredential:
    """Adds one metadata pair (the stage credential) to each call."""

    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    def _with_credential(self, details: aio.ClientCallDetails) -> aio.ClientCallDetails:
        metadata = aio.Metadata(*(details.metadata or ()))
        metadata[self._pair[0]] = self._pair[1]
        return details._replace(metadata=metadata)


# grpc.aio files a client interceptor under the first call kind it subclasses: one class per kind.
class _UnaryUnary(_AddsCredential, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Awaitable[aio.Call]],
                                    client_call_details: aio.ClientCallDetails, request: Any) -> aio.Call:
        """Send the credential with a unary call."""
        return await continuation(self._with_credential(client_call_details), request)


class _UnaryStream(_AddsCredential, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Awaitable[aio.Call]],
                                     client_call_details: aio.ClientCallDetails, request: Any) -> aio.Call:
        """Send the credential with a server-streaming call."""
        return await continuation(self._with_credential(client_call_details), request)


class _StreamUnary(_AddsCredential, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Awaitable[aio.Call]],
                                     client_call_details: aio.ClientCallDetails, request_iterator: Any) -> aio.Call:
        """Send the credential with a client-streaming call."""
        return await continuation(self._with_credential(client_call_details), request_iterator)


class _StreamStream(_AddsCredential, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Awaitable[aio.Call]],
                                      client_call_details: aio.ClientCallDetails, request_iterator: Any) -> aio.Call:
        """Send the credential with a bidirectional-streaming call (the tokenizer's Detokenize)."""
        return await continuation(self._with_credential(client_call_details), request_iterator)
