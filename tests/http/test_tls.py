"""TLS on the router's ports: HTTP (aiohttp) and gRPC with a certificate made in the test, and mutual TLS."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
import time

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from qwenserve.router.openai_http import serve_http
from qwenserve.router.tls import TlsConfig, TlsConfigError, grpc_server_credentials, http_ssl_context
from tests.support.ports import free_port


def hello_app() -> web.Application:
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/health", hello)
    return app


def client_context(certs, with_client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if with_client_cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return context


async def get(url: str, context: ssl.SSLContext | None) -> int:
    async with aiohttp.ClientSession() as session, session.get(url, ssl=context if context else False) as r:
        return r.status


async def test_http_serves_tls_and_refuses_plaintext(certs) -> None:
    tls = TlsConfig.from_flags(certs.server_cert, certs.server_key)
    port = free_port()
    runner = await serve_http(hello_app(), "127.0.0.1", port, http_ssl_context(tls))
    try:
        assert await get(f"https://127.0.0.1:{port}/health", client_context(certs, False)) == 200
        with pytest.raises(aiohttp.ClientError):
            await get(f"http://127.0.0.1:{port}/health", None)
        # A client that does not trust our CA refuses the server.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get(f"https://127.0.0.1:{port}/health", ssl.create_default_context())
    finally:
        await runner.cleanup()


async def test_http_with_a_client_ca_requires_a_client_certificate(certs) -> None:
    tls = TlsConfig.from_flags(certs.server_cert, certs.server_key, certs.ca)
    port = free_port()
    runner = await serve_http(hello_app(), "127.0.0.1", port, http_ssl_context(tls))
    try:
        assert await get(f"https://127.0.0.1:{port}/health", client_context(certs, True)) == 200
        with pytest.raises(aiohttp.ClientError):
            await get(f"https://127.0.0.1:{port}/health", client_context(certs, False))
    finally:
        await runner.cleanup()


async def grpc_check(port: int, credentials: grpc.ChannelCredentials | None) -> int:
    channel = (grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) if credentials
               else grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


@pytest.mark.parametrize("mutual", [False, True])
async def test_grpc_serves_tls_and_optionally_requires_client_certificates(certs, mutual: bool) -> None:
    tls = TlsConfig.from_flags(certs.server_cert, certs.server_key, certs.ca if mutual else None)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port(f"127.0.0.1:{free_port()}", grpc_server_credentials(tls))
    await server.start()
    ca = certs.ca.read_bytes()
    try:
        with_cert = grpc.ssl_channel_credentials(ca, certs.client_key.read_bytes(), certs.client_cert.read_bytes())
        assert await grpc_check(port, with_cert) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await grpc_check(port, None)  # plaintext
        if mutual:
            with pytest.raises(grpc.aio.AioRpcError):
                await grpc_check(port, grpc.ssl_channel_credentials(ca))
        else:
            assert await grpc_check(port, grpc.ssl_channel_credentials(ca)) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


def test_half_a_tls_configuration_is_an_error_not_plaintext(certs, tmp_path) -> None:
    assert TlsConfig.from_flags(None, None) is None
    with pytest.raises(TlsConfigError, match="both"):
        TlsConfig.from_flags(certs.server_cert, None)
    with pytest.raises(TlsConfigError, match="--tls-client-ca needs"):
        TlsConfig.from_flags(None, None, certs.ca)
    with pytest.raises(TlsConfigError, match="not a readable file"):
        TlsConfig.from_flags(tmp_path / "missing.pem", certs.server_key)
    mismatched = TlsConfig.from_flags(certs.server_cert, certs.client_key)
    with pytest.raises(TlsConfigError, match="matching"):
        http_ssl_context(mismatched)


async def test_the_router_process_serves_grpc_over_tls(certs) -> None:
    """The real router entry point binds its gRPC port with TLS when given a certificate and key."""
    from qwenserve.default_model import ensure_default_model

    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "qwenserve.cli", "serve", "router", "--port", str(port),
         "--model", str(ensure_default_model()), "--tokenizer", f"127.0.0.1:{free_port()}",
         "--decode", f"127.0.0.1:{free_port()}", "--no-auth",
         "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        credentials = grpc.ssl_channel_credentials(certs.ca.read_bytes())
        deadline = time.monotonic() + 60
        while True:  # NOT_SERVING until a tokenizer answers (there is none here): the port is up all the same
            try:
                status = await grpc_check(port, credentials)
                break
            except grpc.aio.AioRpcError:
                assert router.poll() is None and time.monotonic() < deadline, "the router never served TLS"
                await asyncio.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await grpc_check(port, None)  # plaintext is refused
    finally:
        router.terminate()
        router.wait(20)
