"""Tracing: W3C context across real grpc.aio hops, request ids on spans, off by default, OTLP export."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry import propagate
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from qwenserve.telemetry import tracing
from qwenserve.telemetry.logs import bind_request_id
from qwenserve.telemetry.tracing import Attr
from qwenserve.v1 import router_pb2, tokenizer_pb2


async def _until_spans(exporter, n: int) -> list[ReadableSpan]:
    # Client spans close from the call's done-callback, a loop iteration after the response.
    for _ in range(200):
        found = list(exporter.get_finished_spans())
        if len(found) >= n:
            return found
        await asyncio.sleep(0.005)
    return list(exporter.get_finished_spans())


def _one(spans: list[ReadableSpan], name: str, kind: SpanKind) -> ReadableSpan:
    matches = [s for s in spans if s.name == name and s.kind == kind]
    assert len(matches) == 1, [(s.name, s.kind) for s in spans]
    return matches[0]


async def test_server_span_is_child_of_client_span(spans, services):
    with bind_request_id("req-1"):
        info = await services.direct.GetInfo(tokenizer_pb2.GetInfoRequest())
    assert info.vocab_size == 7

    finished = await _until_spans(spans, 2)
    client = _one(finished, "qwenserve.v1.Tokenizer/GetInfo", SpanKind.CLIENT)
    server = _one(finished, "qwenserve.v1.Tokenizer/GetInfo", SpanKind.SERVER)
    assert server.context.trace_id == client.context.trace_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.parent.is_remote
    assert client.attributes[Attr.REQUEST_ID] == "req-1"
    assert server.attributes[Attr.REQUEST_ID] == "req-1"
    assert client.attributes["rpc.grpc.status_code"] == 0
    assert server.attributes["rpc.service"] == "qwenserve.v1.Tokenizer"
    # The request id crossed the hop in metadata and was bound in the handler.
    assert services.backend.seen.request_ids == ["req-1"]
    assert services.backend.seen.metadata[0]["traceparent"].split("-")[1] == format(
        client.context.trace_id, "032x"
    )


async def test_two_hops_share_one_trace_with_correct_parents(spans, services):
    tracer = tracing.get_tracer("test")
    with tracer.start_as_current_span("request") as root, bind_request_id("req-2"):
        info = await services.front.GetInfo(tokenizer_pb2.GetInfoRequest())
    assert info.vocab_size == 8

    finished = await _until_spans(spans, 5)
    assert len(finished) == 5
    by_kind = {kind: [s for s in finished if s.kind == kind] for kind in (SpanKind.CLIENT, SpanKind.SERVER)}
    assert {s.context.trace_id for s in finished} == {root.get_span_context().trace_id}
    assert all(s.attributes[Attr.REQUEST_ID] == "req-2" for s in finished)

    # root -> client(front) -> server(front) -> client(backend) -> server(backend)
    parent_of = {s.context.span_id: (s.parent.span_id if s.parent else None) for s in finished}
    chain = []
    span_id = next(s.context.span_id for s in finished if s.name == "request")
    children = {p: c for c, p in parent_of.items() if p is not None}
    while span_id in children:
        span_id = children[span_id]
        chain.append(next(s for s in finished if s.context.span_id == span_id).kind)
    assert chain == [SpanKind.CLIENT, SpanKind.SERVER, SpanKind.CLIENT, SpanKind.SERVER]
    assert len(by_kind[SpanKind.CLIENT]) == 2 and len(by_kind[SpanKind.SERVER]) == 2
    assert services.backend.seen.request_ids == ["req-2"]


async def test_streaming_call_span_covers_the_whole_stream(spans, services):
    with bind_request_id("req-3"):
        call = services.router.Generate(router_pb2.GenerateRequest(prompt="abc"))
        texts = [msg.text async for msg in call]
    assert texts == ["a", "b", "c", ""]

    finished = await _until_spans(spans, 2)
    client = _one(finished, "qwenserve.v1.Router/Generate", SpanKind.CLIENT)
    server = _one(finished, "qwenserve.v1.Router/Generate", SpanKind.SERVER)
    assert server.parent.span_id == client.context.span_id
    assert client.end_time >= server.end_time
    assert server.attributes[Attr.REQUEST_ID] == "req-3"
    assert client.status.status_code != StatusCode.ERROR


async def test_failed_stream_is_an_error_for_the_client_and_a_recorded_code_on_the_server(spans, services):
    call = services.router.Generate(router_pb2.GenerateRequest(prompt="fail"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    finished = await _until_spans(spans, 2)
    client = _one(finished, "qwenserve.v1.Router/Generate", SpanKind.CLIENT)
    server = _one(finished, "qwenserve.v1.Router/Generate", SpanKind.SERVER)
    assert client.status.status_code == StatusCode.ERROR
    assert "NOT_FOUND" in client.status.description
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    # OpenTelemetry's gRPC conventions: NOT_FOUND is the caller's error, not the server's.
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert server.status.status_code != StatusCode.ERROR
    assert Attr.REQUEST_ID not in client.attributes  # no id was bound


async def test_cancelled_stream_closes_both_spans(spans, services):
    call = services.router.Generate(router_pb2.GenerateRequest(prompt="hang"))
    first = await call.read()
    assert first.text == "h"
    call.cancel()

    finished = await _until_spans(spans, 2)
    client = _one(finished, "qwenserve.v1.Router/Generate", SpanKind.CLIENT)
    server = _one(finished, "qwenserve.v1.Router/Generate", SpanKind.SERVER)
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert server.parent.span_id == client.context.span_id


async def test_tracing_off_records_nothing_but_still_forwards_request_id(tracing_off, services):
    assert tracing.memory_exporter() is None
    with tracing.get_tracer("test").start_as_current_span("request") as root, bind_request_id("req-4"):
        await services.front.GetInfo(tokenizer_pb2.GetInfoRequest())
    assert not root.is_recording()
    seen = services.backend.seen.metadata[0]
    assert "traceparent" not in seen
    assert seen[tracing.REQUEST_ID_METADATA_KEY] == "req-4"
    assert services.backend.seen.request_ids == ["req-4"]


async def test_outside_a_request_with_tracing_off_metadata_is_untouched(tracing_off, services):
    await services.direct.GetInfo(tokenizer_pb2.GetInfoRequest())
    seen = services.backend.seen.metadata[0]
    assert "traceparent" not in seen and tracing.REQUEST_ID_METADATA_KEY not in seen
    assert services.backend.seen.request_ids == [None]


def test_tracer_taken_before_setup_follows_later_setups():
    tracer = tracing.get_tracer("early")
    tracing.setup_tracing("svc", exporter="none")
    with tracer.start_as_current_span("off") as span:
        assert not span.is_recording()
    tracing.setup_tracing("svc", exporter="memory")
    try:
        with tracer.start_as_current_span("on") as span:
            assert span.is_recording()
        assert [s.name for s in tracing.memory_exporter().get_finished_spans()] == ["on"]
    finally:
        tracing.shutdown_tracing()
    with tracer.start_as_current_span("off-again") as span:
        assert not span.is_recording()


def test_environment_chooses_exporter_and_service_name(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "memory")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "decode-7")
    tracing.setup_tracing("decode")
    try:
        with tracing.get_tracer("t").start_as_current_span("x"):
            pass
        (span,) = tracing.memory_exporter().get_finished_spans()
        assert span.resource.attributes["service.name"] == "decode-7"
    finally:
        tracing.shutdown_tracing()


def test_tracing_is_off_without_exporter_or_endpoint_and_with_sdk_disabled(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    tracer = tracing.get_tracer("t")
    tracing.setup_tracing("svc")
    assert not tracer.start_span("x").is_recording()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "memory")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    tracing.setup_tracing("svc")
    assert not tracer.start_span("x").is_recording()


def test_unknown_exporter_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="otlp, console, memory or none"):
        tracing.setup_tracing("svc", exporter="jaeger")


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.arrived = threading.Event()

    def Export(self, request, context):
        self.requests.append(request)
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_exporter_sends_spans_to_a_collector(monkeypatch):
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # What the operator sets: an endpoint and resource attributes, no exporter name.
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.namespace.name=ns1,qwenserve.deployment=d1")
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        tracing.setup_tracing("router")
        with bind_request_id("req-otlp"), tracing.get_tracer("t").start_as_current_span("handoff") as span:
            span.set_attribute(Attr.HANDOFF_BYTES, 4096)
        tracing.shutdown_tracing()  # flushes the batch processor
        assert collector.arrived.wait(10)
        resource_spans = collector.requests[0].resource_spans[0]
        resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        (otlp_span,) = resource_spans.scope_spans[0].spans
        attrs = {a.key: a.value for a in otlp_span.attributes}
        assert resource["service.name"] == "router"
        assert resource["k8s.namespace.name"] == "ns1" and resource["qwenserve.deployment"] == "d1"
        assert otlp_span.name == "handoff"
        assert attrs[Attr.HANDOFF_BYTES].int_value == 4096
        assert attrs[Attr.REQUEST_ID].string_value == "req-otlp"
    finally:
        server.stop(None)


def test_http_front_continues_a_trace_from_capitalised_headers(spans):
    carrier: dict[str, str] = {}
    with tracing.get_tracer("client").start_as_current_span("caller") as caller:
        propagate.inject(carrier)
    headers = {k.capitalize(): v for k, v in carrier.items()}
    assert "Traceparent" in headers
    with tracing.server_span("POST /v1/chat/completions", headers.items(), request_id="req-http") as span:
        assert span.get_span_context().trace_id == caller.get_span_context().trace_id
    server = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert server.name == "POST /v1/chat/completions"
    assert server.attributes[Attr.REQUEST_ID] == "req-http"
    assert "rpc.system" not in server.attributes
