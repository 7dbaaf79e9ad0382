"""Fixtures for the telemetry tests: fresh registries, in-memory tracing, tiny gRPC services."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc import aio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from qwenserve.telemetry import tracing
from qwenserve.telemetry.logs import request_id_var
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on with the in-memory exporter; off again afterwards."""
    tracing.setup_tracing("telemetry-test", exporter="memory")
    exporter = tracing.memory_exporter()
    assert exporter is not None
    yield exporter
    tracing.shutdown_tracing()


@pytest.fixture
def tracing_off() -> Iterator[None]:
    tracing.setup_tracing("telemetry-test", exporter="none")
    yield
    tracing.shutdown_tracing()


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


@dataclass
class Seen:
    """What a test servicer observed about each call it handled."""

    metadata: list[dict[str, str]] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)


class BackendTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """The last hop: answers GetInfo and records the metadata and bound request id it saw."""

    def __init__(self) -> None:
        self.seen = Seen()

    async def GetInfo(
        self, request: tokenizer_pb2.GetInfoRequest, context: aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        self.seen.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        self.seen.request_ids.append(request_id_var.get())
        logging.getLogger("backend").info("answering GetInfo")
        return tokenizer_pb2.TokenizerInfo(vocab_size=7)


class FrontTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """A middle hop: its GetInfo calls the backend through a traced channel."""

    def __init__(self, backend: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self.backend = backend

    async def GetInfo(
        self, request: tokenizer_pb2.GetInfoRequest, context: aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        info = await self.backend.GetInfo(tokenizer_pb2.GetInfoRequest())
        return tokenizer_pb2.TokenizerInfo(vocab_size=info.vocab_size + 1)


class StreamingRouter(router_pb2_grpc.RouterServicer):
    """Streams one message per character of the prompt; "fail" aborts with NOT_FOUND, "hang" stalls."""

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        if request.prompt == "fail":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such model")
        if request.prompt == "hang":
            yield router_pb2.GenerateResponse(text="h")
            await asyncio.sleep(30)
        for ch in request.prompt:
            yield router_pb2.GenerateResponse(request_id=request_id_var.get() or "", text=ch)
        yield router_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_STOP)


async def _serve(add: object, servicer: object) -> tuple[aio.Server, str]:
    server = aio.server(interceptors=tracing.server_interceptors())
    add(servicer, server)  # type: ignore[operator]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@dataclass
class Services:
    """Two tokenizer hops (front -> backend) and a streaming router, all traced."""

    backend: BackendTokenizer
    front: tokenizer_pb2_grpc.TokenizerStub
    direct: tokenizer_pb2_grpc.TokenizerStub
    router: router_pb2_grpc.RouterStub


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    backend = BackendTokenizer()
    backend_server, backend_addr = await _serve(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, backend)
    backend_channel = aio.insecure_channel(backend_addr, interceptors=tracing.client_interceptors())
    front_server, front_addr = await _serve(
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server,
        FrontTokenizer(tokenizer_pb2_grpc.TokenizerStub(backend_channel)),
    )
    router_server, router_addr = await _serve(router_pb2_grpc.add_RouterServicer_to_server, StreamingRouter())
    channels = [
        aio.insecure_channel(addr, interceptors=tracing.client_interceptors())
        for addr in (front_addr, backend_addr, router_addr)
    ]
    yield Services(
        backend=backend,
        front=tokenizer_pb2_grpc.TokenizerStub(channels[0]),
        direct=tokenizer_pb2_grpc.TokenizerStub(channels[1]),
        router=router_pb2_grpc.RouterStub(channels[2]),
    )
    for channel in [*channels, backend_channel]:
        await channel.close()
    for server in (front_server, backend_server, router_server):
        await server.stop(None)
