"""A decode worker that never takes a call (no headers: a stopped process) is given up on within the router's
accept timeout, and what the client is told then names no stage address (only an admin's GetStatus shows those).
In-process fake stages: a tokenizer that answers GetInfo, decode workers whose Decode handler never answers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from qwenserve.router.config import RouterConfig
from qwenserve.router.errors import ServiceUnavailable
from qwenserve.router.generation import Router
from qwenserve.v1 import common_pb2, decode_pb2_grpc, router_pb2, tokenizer_pb2, tokenizer_pb2_grpc


class Tokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    async def GetInfo(self, request, context):  # noqa: N802 - gRPC method name
        return tokenizer_pb2.TokenizerInfo(vocab_size=1000)


class SilentDecode(decode_pb2_grpc.DecodeServicer):
    """Says it sends headers when it takes a call, then takes none: each Decode waits without a word, as a stopped
    process's would."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetInfo(self, request, context):  # noqa: N802 - gRPC method name
        return common_pb2.EngineInfo(max_model_len=512, kv_cache_tokens=512, sends_headers_on_accept=True)

    async def Decode(self, request, context):  # noqa: N802 - gRPC method name
        self.calls += 1
        await asyncio.sleep(3600)
        yield  # pragma: no cover - never reached; makes this a streaming handler


class Text:
    """A detokenizer that never needs the vocabulary: no token reaches it here."""

    def push(self, ids: Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


@contextlib.asynccontextmanager
async def stage(servicer: object, add: object) -> AsyncIterator[tuple[str, grpc.aio.Server]]:
    server = grpc.aio.server()
    add(servicer, server)  # type: ignore[operator]
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield address, server
    finally:
        await server.stop(None)


async def answer(router: Router) -> list[router_pb2.GenerateResponse]:
    request = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[5, 6, 7]))
    request.sampling.max_tokens = 4
    prep = await router.prepare(request)
    async with contextlib.aclosing(router.run(prep)) as stream:
        return [msg async for msg in stream]


async def test_decode_workers_that_take_no_call_are_given_up_on_within_the_accept_timeout() -> None:
    silent = [SilentDecode(), SilentDecode()]
    async with contextlib.AsyncExitStack() as stack:
        tokenizer, _ = await stack.enter_async_context(stage(Tokenizer(), tokenizer_pb2_grpc.add_TokenizerServicer_to_server))
        decodes = [(await stack.enter_async_context(stage(s, decode_pb2_grpc.add_DecodeServicer_to_server)))[0]
                   for s in silent]
        router = Router(RouterConfig(tokenizer, [], decodes, max_model_len=512, accept_timeout_s=0.5,
                                     stall_timeout_s=30.0), lambda skip: Text())
        try:
            await asyncio.wait_for(router.start(), 30)
            assert router.fleet.sends_headers_on_accept == set(decodes)
            started = time.monotonic()
            messages = await answer(router)
            took = time.monotonic() - started
        finally:
            await router.close()
    # Both workers were tried, half a second each, not the 30 s stall timeout; the request ends retryable, with
    # nothing sent (a model's fallback would answer it), and its message names neither worker.
    assert [s.calls for s in silent] == [1, 1]
    assert took < 5, took
    [last] = messages
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR and not last.token_ids and last.error.retryable
    assert last.error.code == "no_decode_worker", last.error
    assert not any(address in last.error.message for address in decodes), last.error.message
    assert not any(address.rsplit(":", 1)[1] in last.error.message for address in decodes), last.error.message


async def test_a_tokenizer_gone_after_start_is_a_503_that_names_no_address() -> None:
    async with stage(Tokenizer(), tokenizer_pb2_grpc.add_TokenizerServicer_to_server) as (tokenizer, server):
        router = Router(RouterConfig(tokenizer, [], ["127.0.0.1:1"], max_model_len=512, worker_info_wait_s=0.1,
                                     tokenizer_timeout_s=2.0), lambda skip: Text())
        router.vocab_size = 1000  # as if start() had heard from the tokenizer
        await server.stop(None)
        try:
            with pytest.raises(ServiceUnavailable) as refused:
                await router.prepare(router_pb2.GenerateRequest(prompt="hello"))
        finally:
            await router.close()
    assert "tokenizer" in refused.value.message and tokenizer.rsplit(":", 1)[1] not in refused.value.message, \
        refused.value.message
