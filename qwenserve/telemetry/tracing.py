"""OpenTelemetry tracing across every gRPC hop: one trace per request.

Off unless `OTEL_TRACES_EXPORTER` names an exporter or an OTLP endpoint is set (unlike the
OpenTelemetry default of "otlp" to localhost: a serving process should not dial a collector
nobody configured). When off, spans cost one attribute check and the interceptors only forward
the request id.

Configuration, read by `setup_tracing`:
- `OTEL_TRACES_EXPORTER`: comma list of `otlp`, `console`, `memory` (in-process, for tests),
  `none`; unset means `otlp` when `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` is set, else `none`.
  `OTEL_SDK_DISABLED=true` turns everything off.
- `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `..._HEADERS`, `..._INSECURE`,
  `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` (`grpc`, the default, or `http/protobuf`): read by the
  OTLP exporter itself.
- `OTEL_SERVICE_NAME` (wins over the name a service passes), `OTEL_RESOURCE_ATTRIBUTES`,
  `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*`, `OTEL_PROPAGATORS`: standard SDK behaviour.

Across hops: W3C trace context travels in gRPC metadata (`traceparent`, `tracestate`), the request id
in `x-request-id`. Server spans come from `opentelemetry-instrumentation-grpc`; our one server
interceptor binds the caller's request id around them. The client side is ours: the library's aio
client wraps a server stream in a bare iterator, which breaks `call.read()` (the router reads streams
that way) and leaves a cancelled stream's span without its status. Every span started while a request
id is bound carries `qwenserve.request_id`; gRPC spans are named `package.Service/Method`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
from grpc import aio
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from qwenserve.telemetry.logs import request_id_var, reset_request_id
from qwenserve.telemetry.switchable_tracer import SwitchableTracer, SwitchableTracerProvider
from qwenserve.telemetry.switchable_tracer import state as _state

log = logging.getLogger(__name__)

REQUEST_ID_METADATA_KEY = "x-request-id"


class Attr:
    """Span attribute names shared by all services, so dashboards and tests agree on them."""

    REQUEST_ID = "qwenserve.request_id"
    TENANT = "qwenserve.tenant"
    PROMPT_TOKENS = "qwenserve.prompt_tokens"
    CACHED_TOKENS = "qwenserve.cached_tokens"
    COMPLETION_TOKENS = "qwenserve.completion_tokens"
    FINISH_REASON = "qwenserve.finish_reason"
    WORKER = "qwenserve.worker"
    HANDOFF_TRANSPORT = "qwenserve.handoff.transport"
    HANDOFF_BYTES = "qwenserve.handoff.bytes"
    # The precision of the weights that computed a handoff's KV and of those that continue it (per-stage precision).
    HANDOFF_EXPORTER_WEIGHTS = "qwenserve.handoff.exporter_weights"
    HANDOFF_IMPORTER_WEIGHTS = "qwenserve.handoff.importer_weights"


class _SpanStamp(SpanProcessor):
    """Stamps the bound request id on every span as it starts, and names gRPC server spans as the
    semantic conventions (and our client spans) do: the instrumentation keeps gRPC's leading slash."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        rid = request_id_var.get()
        if rid:
            span.set_attribute(Attr.REQUEST_ID, rid)
        if span.kind is SpanKind.SERVER and span.name.startswith("/"):
            span.update_name(span.name[1:])

    def on_end(self, span: ReadableSpan) -> None:
        return


_PROVIDER = SwitchableTracerProvider()
_GRPC_TRACER = SwitchableTracer("qwenserve.grpc")


def get_tracer(name: str = "qwenserve") -> trace.Tracer:
    """The tracer services use for their own spans (tokenize, rate-limit, handoff, ...).

    Safe to call at import time: it follows later `setup_tracing` calls. Use it as
    `with tracer.start_as_current_span(...)`; the decorator form binds at import time and stays
    a no-op if tracing was off then.
    """
    return SwitchableTracer(name)


def memory_exporter() -> InMemorySpanExporter | None:
    """The in-memory exporter when `OTEL_TRACES_EXPORTER` includes `memory`, else None."""
    return _state.memory


def _exporter_names(override: str | None) -> list[str]:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = override if override is not None else os.environ.get("OTEL_TRACES_EXPORTER")
    if raw is None:
        # An endpoint without an exporter name means OTLP (the standard default); with neither,
        # stay off rather than dial a collector on localhost that nobody configured.
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT")
        raw = "otlp" if endpoint else "none"
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    return [n for n in names if n != "none"]


def _otlp_exporter() -> SpanExporter:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(f"OTLP protocol {protocol!r} is not supported; use grpc or http/protobuf")
    except ImportError as exc:
        package = "grpc" if protocol == "grpc" else "http"
        raise RuntimeError(
            f"OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp-proto-{package}"
        ) from exc
    return OTLPSpanExporter()


def setup_tracing(service_name: str, exporter: str | None = None) -> None:
    """Configure tracing for this process from the `OTEL_*` environment (see the module doc).

    `exporter` overrides `OTEL_TRACES_EXPORTER` (e.g. "memory" in tests). Calling it again
    flushes and replaces the previous configuration. With no exporter, tracing is off.
    """
    shutdown_tracing()
    names = _exporter_names(exporter)
    if not names:
        return
    unknown = set(names) - {"otlp", "console", "memory"}
    if unknown:
        raise ValueError(f"unknown OTEL_TRACES_EXPORTER {sorted(unknown)}; use otlp, console, memory or none")
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(_SpanStamp())
    if "memory" in names:
        # Synchronous export, so a test sees a span the moment it ends.
        _state.memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_state.memory))
    if "console" in names:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if "otlp" in names:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    _state.provider = provider
    if not _state.installed_globally:
        # The global provider can be set once per process; the switchable one follows every setup.
        trace.set_tracer_provider(_PROVIDER)
        _state.installed_globally = True
    log.info("tracing on: service %s, exporters %s", name, ",".join(names))


def shutdown_tracing() -> None:
    """Flush pending spans and turn tracing off (call on service shutdown)."""
    provider, _state.provider, _state.memory = _state.provider, None, None
    if provider is not None:
        provider.shutdown()


# --- Across hops: the request id and W3C trace context in gRPC metadata or HTTP headers ----------


@contextlib.contextmanager
def server_span(
    name: str, headers: Iterable[tuple[str, str | bytes]] | None, request_id: str | None = None
) -> Iterator[trace.Span]:
    """Bind the request id and run the block in a SERVER span whose parent is the caller's span.

    For the HTTP front, which no gRPC interceptor covers: `name` such as "POST /v1/chat/completions",
    `headers` as `request.headers.items()` (names may arrive capitalised). `request_id` defaults to the
    caller's `x-request-id`. Yields the invalid span when tracing is off.
    """
    carrier = {key.lower(): value for key, value in (headers or ()) if isinstance(value, str)}
    rid = request_id or carrier.get(REQUEST_ID_METADATA_KEY)
    token = request_id_var.set(rid) if rid else None
    try:
        if _state.provider is None:
            yield trace.INVALID_SPAN
        else:
            parent = propagate.extract(carrier)
            with _GRPC_TRACER.start_as_current_span(name, context=parent, kind=SpanKind.SERVER) as span:
                yield span
    finally:
        if token is not None:
            reset_request_id(token)


def _bound_to(request_id: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    """`behavior` run with `request_id` bound; a synchronous one runs on a thread pool, outside this
    context, and is left as it is."""
    if inspect.isasyncgenfunction(behavior):

        async def stream_behavior(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            token = request_id_var.set(request_id)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                reset_request_id(token)

        return stream_behavior
    if inspect.iscoroutinefunction(behavior):

        async def unary_behavior(request: Any, context: aio.ServicerContext) -> Any:
            token = request_id_var.set(request_id)
            try:
                return await behavior(request, context)
            finally:
                reset_request_id(token)

        return unary_behavior
    return behavior


class RequestIdServerInterceptor(aio.ServerInterceptor):
    """Binds the caller's `x-request-id` for the handler (and the server span started inside it)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the handler's behaviour when the caller sent a request id; pass it through otherwise."""
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        rid = next((value for key, value in metadata if key == REQUEST_ID_METADATA_KEY), None)
        if handler is None or not isinstance(rid, str):
            return handler
        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        )
        for attr, make in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(
                    _bound_to(rid, behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


def server_interceptors() -> list[aio.ServerInterceptor]:
    """Interceptors to pass to `grpc.aio.server(interceptors=...)`: the request id bound outermost, so
    the server span, which OpenTelemetry's instrumentation starts only while tracing is on, carries it."""
    # Imported here: the instrumentation costs a quarter second to import, and clients never need it.
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    spans = aio_server_interceptor(tracer_provider=_PROVIDER, filter_=_tracing_on)
    return [RequestIdServerInterceptor(), spans]


def _tracing_on(_call: grpc.HandlerCallDetails) -> bool:
    return _state.provider is not None


# Tasks that close client spans; held here so they are not collected before they run.
_pending: set[asyncio.Task[None]] = set()


async def _close_client_span(call: aio.Call, span: trace.Span) -> None:
    try:
        code = await call.code()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {await call.details()}"))
    finally:
        span.end()


def _end_span_when_done(call: aio.Call, span: trace.Span) -> None:
    def on_done(done: aio.Call) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the loop is gone (interpreter shutdown): end without a status
            span.end()
            return
        task = loop.create_task(_close_client_span(done, span))
        _pending.add(task)
        task.add_done_callback(_pending.discard)

    call.add_done_callback(on_done)


class _ClientInterceptor:
    """Starts a CLIENT span per call and sends its context, plus the request id, in the metadata."""

    def _prepare(self, details: aio.ClientCallDetails) -> tuple[aio.ClientCallDetails, trace.Span | None]:
        rid = request_id_var.get()
        if _state.provider is None and not rid:
            return details, None
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = aio.Metadata(*(details.metadata or ()))
        span: trace.Span | None = None
        carrier: dict[str, str] = {}
        if _state.provider is not None:
            service, _, name = method.lstrip("/").rpartition("/")
            attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
            span = _GRPC_TRACER.start_span(method.lstrip("/"), kind=SpanKind.CLIENT, attributes=attributes)
            propagate.inject(carrier, context=trace.set_span_in_context(span))
        if rid:
            carrier[REQUEST_ID_METADATA_KEY] = rid
        for key, value in carrier.items():
            metadata[key] = value
        return details._replace(metadata=metadata), span

    async def _intercept(
        self, continuation: Callable[..., Awaitable[aio.Call]], details: aio.ClientCallDetails, request: Any
    ) -> aio.Call:
        details, span = self._prepare(details)
        if span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details, request)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            span.end()
            raise
        _end_span_when_done(call, span)
        return call


# grpc.aio files a client interceptor under the first call kind it subclasses: one class per kind.
class _UnaryUnary(_ClientInterceptor, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Awaitable[aio.Call]],
                                    client_call_details: aio.ClientCallDetails, request: Any) -> aio.Call:
        """Trace one unary call."""
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_ClientInterceptor, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Awaitable[aio.Call]],
                                     client_call_details: aio.ClientCallDetails, request: Any) -> aio.Call:
        """Trace one server-streaming call until its stream ends."""
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_ClientInterceptor, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Awaitable[aio.Call]],
                                     client_call_details: aio.ClientCallDetails, request_iterator: Any,
                                     ) -> aio.Call:
        """Trace one client-streaming call."""
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_ClientInterceptor, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Awaitable[aio.Call]],
                                      client_call_details: aio.ClientCallDetails, request_iterator: Any,
                                     ) -> aio.Call:
        """Trace one bidirectional-streaming call (e.g. Detokenize)."""
        return await self._intercept(continuation, client_call_details, request_iterator)


def client_interceptors() -> list[aio.ClientInterceptor]:
    """Interceptors for `grpc.aio.insecure_channel(target, interceptors=client_interceptors())`.

    With tracing off they add only the request id, and nothing at all outside a request.
    """
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]
