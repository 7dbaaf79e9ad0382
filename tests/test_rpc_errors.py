"""An error status carries our ErrorDetail as google.rpc.Status details, readable by any gRPC client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from qwenserve.router.errors import ContextLengthExceeded, RateLimited, ServiceUnavailable
from qwenserve.router.failover import refusal
from qwenserve.router.grpc_generate import refuse
from qwenserve.rpc_errors import abort, detail_of, error_detail, retry_after_of, rich_status
from qwenserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

SAMPLING = error_detail("invalid_argument", "top_p must be in (0, 1]", field="sampling.top_p")
LIMITED = RateLimited("over 1 request per minute", {"Retry-After": "3", "X-RateLimit-Remaining-Requests": "0"},
                      ("requests",), retry_after_s=2.5)


class Refusing(tokenizer_pb2_grpc.TokenizerServicer):
    """GetInfo fails as the call's `fail` metadata says: our helper, a router error, or a bare abort."""

    async def GetInfo(
        self, request: tokenizer_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        metadata = dict(context.invocation_metadata() or ())
        match metadata.get("fail"):
            case "sampling":
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, SAMPLING)
            case "rate":
                await refuse(context, LIMITED)
            case "context":
                await refuse(context, ContextLengthExceeded("the prompt has 9 tokens; the context is 8", "input"))
            case "unavailable":
                await refuse(context, ServiceUnavailable("the router is starting"))
        await context.abort(grpc.StatusCode.INTERNAL, "a plain abort")


@pytest.fixture
async def stub() -> AsyncIterator[tokenizer_pb2_grpc.TokenizerStub]:
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Refusing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)
    await server.stop(None)


async def _fail(stub: tokenizer_pb2_grpc.TokenizerStub, how: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetInfo(tokenizer_pb2.GetInfoRequest(), metadata=(("fail", how),))
    return info.value


async def test_any_client_reads_the_error_detail_from_the_status(stub) -> None:
    error = await _fail(stub, "sampling")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == SAMPLING.message
    status = rpc_status.from_call(error)
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    (packed,) = status.details
    detail = common_pb2.ErrorDetail()
    assert packed.Unpack(detail) and detail == SAMPLING
    assert detail_of(error) == SAMPLING and retry_after_of(error) is None


async def test_a_rate_limited_call_says_when_to_retry_and_keeps_its_headers(stub) -> None:
    error = await _fail(stub, "rate")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    detail = detail_of(error)
    assert detail is not None
    assert (detail.code, detail.message, detail.retryable) == ("rate_limit_exceeded", LIMITED.message, True)
    assert retry_after_of(error) == 2.5
    status = rpc_status.from_call(error)
    assert status is not None and status.details[1].Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    trailing = dict(error.trailing_metadata())
    assert trailing["retry-after"] == "3" and trailing["x-ratelimit-remaining-requests"] == "0"


async def test_router_errors_carry_their_code_field_and_retryability(stub) -> None:
    too_long = detail_of(await _fail(stub, "context"))
    assert too_long is not None
    assert (too_long.code, too_long.field, too_long.retryable) == ("context_length_exceeded", "input", False)
    starting = detail_of(await _fail(stub, "unavailable"))
    assert starting is not None and (starting.code, starting.retryable) == ("service_unavailable", True)


async def test_a_status_without_details_has_no_error_detail(stub) -> None:
    error = await _fail(stub, "none")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert rpc_status.from_call(error) is None and detail_of(error) is None


def _stage_error(code: grpc.StatusCode, detail: common_pb2.ErrorDetail | None) -> grpc.aio.AioRpcError:
    """A stage's failed call as the router's client sees it."""
    trailing = rich_status(code, detail).trailing_metadata if detail is not None else ()
    message = detail.message if detail is not None else "refused"
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), message)


def test_the_router_relays_a_stages_own_error_detail_and_names_a_bare_status_by_its_code() -> None:
    too_long = error_detail("context_length_exceeded", "max_tokens 900 + prompt 200 exceeds 1024",
                            field="sampling.max_tokens")
    assert refusal(_stage_error(grpc.StatusCode.OUT_OF_RANGE, too_long)) == too_long
    bare = refusal(_stage_error(grpc.StatusCode.OUT_OF_RANGE, None))
    assert (bare.code, bare.message) == ("context_length_exceeded", "refused")
    assert refusal(_stage_error(grpc.StatusCode.INVALID_ARGUMENT, None)).code == "invalid_argument"
