"""The router's context limit: the smallest max_model_len its engine workers report, enforced before any work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from qwenserve.router.config import RouterConfig
from qwenserve.router.errors import ContextLengthExceeded, ServiceUnavailable
from qwenserve.router.generation import Router
from qwenserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.support.ports import free_port


class Tokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    async def GetInfo(self, request, context):  # noqa: N802 - gRPC method name
        return tokenizer_pb2.TokenizerInfo(vocab_size=1000)


def engine_stage(base: type, limit: int) -> object:
    """A Prefill or Decode servicer that only answers GetInfo, with `limit`."""

    class Stage(base):  # type: ignore[misc, valid-type]
        async def GetInfo(self, request, context):  # noqa: N802 - gRPC method name
            return common_pb2.EngineInfo(max_model_len=limit, kv_cache_tokens=limit)

    return Stage()


Servicers = list[tuple[Callable[[object, grpc.aio.Server], None], object]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """serve(servicers, port=0) -> the address of an in-process gRPC server with them."""
    servers: list[grpc.aio.Server] = []

    async def start(servicers: Servicers, port: int = 0) -> str:
        server = grpc.aio.server()
        for add, servicer in servicers:
            add(servicer, server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{bound}"

    yield start
    for server in servers:
        await server.stop(None)


def decode(limit: int) -> Servicers:
    return [(decode_pb2_grpc.add_DecodeServicer_to_server, engine_stage(decode_pb2_grpc.DecodeServicer, limit))]


def prefill(limit: int) -> Servicers:
    return [(prefill_pb2_grpc.add_PrefillServicer_to_server, engine_stage(prefill_pb2_grpc.PrefillServicer, limit))]


async def started_router(tokenizer: str, prefill_addresses: list[str], decode_addresses: list[str],
                         **settings: object) -> Router:
    router = Router(RouterConfig(tokenizer, prefill_addresses, decode_addresses, max_model_len=40960, **settings),
                    detokenizer_factory=None)  # type: ignore[arg-type]
    await asyncio.wait_for(router.start(), timeout=30)
    return router


async def test_the_limit_is_the_smallest_any_worker_reports(serve) -> None:
    tokenizer = await serve([(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, Tokenizer())])
    decodes = [await serve(decode(512)), await serve(decode(384))]
    prefills = [await serve(prefill(448))]
    router = await started_router(tokenizer, prefills, decodes)
    try:
        assert router.config.max_model_len == 384
        assert router.fleet.worker_limits == {decodes[0]: 512, decodes[1]: 384, prefills[0]: 448}
    finally:
        await router.close()


async def test_a_worker_that_says_nothing_sets_no_limit(serve) -> None:
    # A server without GetInfo (here: the tokenizer's) answers UNIMPLEMENTED: the others decide.
    tokenizer = await serve([(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, Tokenizer())])
    router = await started_router(tokenizer, [tokenizer], [await serve(decode(640))])
    try:
        assert router.config.max_model_len == 640
    finally:
        await router.close()


async def test_a_worker_that_reports_after_the_start_lowers_the_limit_then(serve) -> None:
    tokenizer = await serve([(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, Tokenizer())])
    late = f"127.0.0.1:{free_port()}"
    router = await started_router(tokenizer, [late], [await serve(decode(512))], worker_info_wait_s=0.2)
    try:
        assert router.config.max_model_len == 512 and late not in router.fleet.worker_limits
        await serve(prefill(300), port=int(late.rsplit(":", 1)[1]))
        for _ in range(200):
            if router.config.max_model_len == 300:
                break
            await asyncio.sleep(0.1)
        assert router.config.max_model_len == 300 and router.fleet.worker_limits[late] == 300
    finally:
        await router.close()


def token_request(n: int, max_tokens: int | None) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[5] * n))
    if max_tokens is not None:
        req.sampling.max_tokens = max_tokens
    return req


async def test_a_prompt_one_token_over_the_limit_is_refused_before_any_worker_call() -> None:
    # Every worker address is dead: a request that got past prepare() could only fail on a connection.
    dead = "127.0.0.1:1"
    router = Router(RouterConfig(dead, [dead], [dead], max_model_len=64), detokenizer_factory=None)  # type: ignore[arg-type]
    router.vocab_size = 1000  # as if start() had run
    try:
        fits = await router.prepare(token_request(63, 1))
        assert fits.sampling.max_tokens == 1
        with pytest.raises(ContextLengthExceeded) as over:
            await router.prepare(token_request(64, 1))
        assert over.value.code == "context_length_exceeded" and over.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert "64 tokens" in over.value.message and "at most 63" in over.value.message
        with pytest.raises(ContextLengthExceeded, match="lower max_tokens to at most 4"):
            await router.prepare(token_request(60, 5))
        # Without max_tokens the output budget is what remains of the context, never a refusal.
        assert (await router.prepare(token_request(60, None))).sampling.max_tokens == 4
    finally:
        await router.close()


async def test_a_request_that_arrives_while_the_router_starts_waits_for_the_tokenizer(serve) -> None:
    # The router's ports open before its tokenizer answers: a first request is checked once the vocabulary is known,
    # not refused; one whose deadline comes first is told the router is starting.
    port = free_port()
    router = Router(RouterConfig(f"127.0.0.1:{port}", [], [await serve(decode(512))], max_model_len=64),
                    detokenizer_factory=None)  # type: ignore[arg-type]
    starting = asyncio.create_task(router.start())
    try:
        with pytest.raises(ServiceUnavailable, match="the router is starting"):
            await router.prepare(token_request(8, 1), deadline=time.monotonic() + 0.3)
        early = asyncio.create_task(router.prepare(token_request(8, 1)))
        await asyncio.sleep(0.5)
        assert not early.done()
        await serve([(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, Tokenizer())], port=port)
        prepared = await asyncio.wait_for(early, timeout=30)
        assert prepared.prompt_ids == [5] * 8 and router.vocab_size == 1000
        await asyncio.wait_for(starting, timeout=30)
    finally:
        starting.cancel()
        await router.close()
