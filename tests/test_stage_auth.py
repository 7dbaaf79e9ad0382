"""Stage credentials: a stage server with a secret serves only callers that prove they know it; health stays open."""

from __future__ import annotations

import asyncio
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from qwenserve.grpc_server import GrpcServerConfig, StageServer
from qwenserve.kv_transfer.exporter import ExporterConfig, KVExporter
from qwenserve.kv_transfer.grpc_transport import add_kv_transfer_service
from qwenserve.preflight import StartupError
from qwenserve.stage_auth import CREDENTIAL_METADATA_KEY, credential_interceptors
from qwenserve.stage_secret import StageSecret, load_stage_secret, per_run_secret_file, write_stage_secret
from qwenserve.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

pytestmark = pytest.mark.timeout(60)

SERVICE = "qwenserve.test.Echo"


def _echo_service() -> grpc.GenericRpcHandler:
    """One method of each call kind, on raw bytes: what the guard must refuse or let through, whatever the kind."""

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield request
        yield request

    async def client_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        return b"".join([r async for r in requests])

    async def both(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "Both": grpc.stream_stream_rpc_method_handler(both),
    })


async def _each_kind(channel: grpc.aio.Channel) -> list[object]:
    """Call every method once; each gives its answer, or the status code it was refused with."""
    answers: list[object] = []

    async def one(call: object) -> None:
        try:
            answers.append(await call)  # type: ignore[misc]
        except grpc.aio.AioRpcError as e:
            answers.append(e.code())

    async def two() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    await one(channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=10))

    async def collect_stream() -> list[bytes]:
        return [m async for m in channel.unary_stream(f"/{SERVICE}/ServerStream")(b"y", timeout=10)]

    async def collect_both() -> list[bytes]:
        return [m async for m in channel.stream_stream(f"/{SERVICE}/Both")(two(), timeout=10)]

    await one(collect_stream())
    await one(channel.stream_unary(f"/{SERVICE}/ClientStream")(two(), timeout=10))
    await one(collect_both())
    return answers


SERVED = [b"x", [b"y", b"y"], b"ab", [b"a", b"b"]]
REFUSED = [grpc.StatusCode.UNAUTHENTICATED] * 4


@pytest.fixture
def secret(tmp_path: Path) -> StageSecret:
    return StageSecret.from_file(write_stage_secret(tmp_path))


async def _started(secret: StageSecret | None) -> StageServer:
    server = StageServer(GrpcServerConfig(stage_secret=secret, grace_s=0), "auth-test", [SERVICE],
                         lambda s: s.add_generic_rpc_handlers((_echo_service(),)))
    await server.start()
    await server.set_serving()
    return server


def _refusals(reason: str) -> float:
    return REGISTRY.get_sample_value("qwenserve_stage_auth_refusals_total",
                                     {"service": SERVICE, "reason": reason}) or 0.0


async def test_a_call_without_the_credential_is_unauthenticated_and_counted_whatever_its_kind(
        secret: StageSecret) -> None:
    server = await _started(secret)
    before = _refusals("missing")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert await _each_kind(channel) == REFUSED
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary(f"/{SERVICE}/Unary")(b"x", timeout=10)
            assert "stage" in refused.value.details()
    finally:
        await server.stop()
    assert _refusals("missing") == before + 5


async def test_another_deployments_credential_is_refused(secret: StageSecret, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    other = StageSecret.from_file(write_stage_secret(tmp_path / "other"))
    server = await _started(secret)
    before = _refusals("wrong")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                             interceptors=credential_interceptors(other)) as channel:
            assert await _each_kind(channel) == REFUSED
        forged = [(CREDENTIAL_METADATA_KEY, secret.value.decode())]  # the secret itself is not the credential
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary(f"/{SERVICE}/Unary")(b"x", metadata=forged, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop()
    assert _refusals("wrong") == before + 5


async def test_the_deployments_credential_is_served_and_health_is_open_to_anyone(secret: StageSecret) -> None:
    server = await _started(secret)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                             interceptors=credential_interceptors(secret)) as channel:
            assert await _each_kind(channel) == SERVED
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop()


async def test_a_stage_without_a_secret_serves_any_caller_as_before() -> None:
    server = await _started(None)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert await _each_kind(channel) == SERVED
    finally:
        await server.stop()


async def test_kv_transfer_fetch_and_release_need_the_credential(secret: StageSecret) -> None:
    exporter = KVExporter(ExporterConfig(use_shm=False, transport=common_pb2.KV_TRANSPORT_GRPC,
                                         control_endpoint="127.0.0.1:1", pool_bytes=1 << 20, prefault=False,
                                         reap_orphans=False), kernels=None).start()
    server = StageServer(GrpcServerConfig(stage_secret=secret, grace_s=0), "prefill-test",
                         ["qwenserve.v1.KVTransfer"], lambda s: add_kv_transfer_service(s, exporter))
    await server.start()
    await server.set_serving()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as stranger:
            stub = kv_transfer_pb2_grpc.KVTransferStub(stranger)
            with pytest.raises(grpc.aio.AioRpcError) as fetch:
                [c async for c in stub.Fetch(kv_transfer_pb2.FetchRequest(handoff_id="someone.else"), timeout=10)]
            with pytest.raises(grpc.aio.AioRpcError) as release:
                await stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="someone.else"), timeout=10)
        assert (fetch.value.code(), release.value.code()) == (grpc.StatusCode.UNAUTHENTICATED,) * 2
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}",
                                             interceptors=credential_interceptors(secret)) as stage:
            stub = kv_transfer_pb2_grpc.KVTransferStub(stage)
            reply = await stub.Release(kv_transfer_pb2.ReleaseRequest(handoff_id="unknown"), timeout=10)
            assert reply.released is False  # served: the exporter answered
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                [c async for c in stub.Fetch(kv_transfer_pb2.FetchRequest(handoff_id="unknown"), timeout=10)]
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop()
        exporter.close()


def test_a_secret_file_is_refused_when_missing_or_short(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("hunter2\n")
    with pytest.raises(StartupError, match="fewer than"):
        load_stage_secret(str(short))
    with pytest.raises(StartupError, match="cannot read"):
        load_stage_secret(str(tmp_path / "absent"))
    assert load_stage_secret("") is None


def test_a_run_secret_is_random_and_readable_by_its_owner_only() -> None:
    first, second = per_run_secret_file(), per_run_secret_file()
    assert first.read_text() != second.read_text() and len(first.read_text()) >= 32
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    assert StageSecret.from_file(first).credential != first.read_text()


async def test_a_refused_request_stream_that_never_ends_is_cut_off(secret: StageSecret) -> None:
    server = await _started(secret)

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"z" * 1024
            await asyncio.sleep(0)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.stream_unary(f"/{SERVICE}/ClientStream")(endless(), timeout=20)
            # The client may see its own failed write (INTERNAL) rather than the status: it was still writing.
            assert refused.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
            assert time.monotonic() - t0 < 5.0
    finally:
        await server.stop()
