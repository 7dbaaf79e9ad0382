"""Every gRPC field that carries JSON is read with the HTTP body's limits: a client's mistake there is
INVALID_ARGUMENT, not retryable, naming the field; and no error repeats unbounded input in its metadata.

The router's Generate runs in-process (the library's `grpc_generate.generate`, as the router stage serves it)
around a real Router whose tokenizer and workers do not exist: each request here must be refused before any
of them is called (one that got through would end UNAVAILABLE instead).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from qwenserve.ratelimit import InProcessRateLimiter
from qwenserve.router import grpc_generate
from qwenserve.router.config import RouterConfig
from qwenserve.router.gatekeeper import Gatekeeper
from qwenserve.router.generation import Router
from qwenserve.rpc_errors import detail_of
from qwenserve.tenancy import KeyStore, Tenant, key_digest
from qwenserve.untrusted_input import MAX_JSON_DEPTH, MAX_MESSAGE_CHARS
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc

METADATA = (("authorization", "Bearer sk-test"),)
TOOL = '{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}'


class Front(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, gatekeeper: Gatekeeper) -> None:
        self.router = router
        self.gatekeeper = gatekeeper

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        async for msg in grpc_generate.generate(self.router, self.gatekeeper, request, context):
            yield msg


@pytest.fixture
async def stub() -> AsyncIterator[router_pb2_grpc.RouterStub]:
    dead = "127.0.0.1:1"
    router = Router(RouterConfig(dead, [dead], [dead], max_model_len=4096, model_name="qwen-test"),
                    detokenizer_factory=None)  # type: ignore[arg-type]
    router.vocab_size = 151_936  # as if start() had asked the tokenizer
    gatekeeper = Gatekeeper(KeyStore([Tenant("t")], [(key_digest("sk-test"), "t")]), InProcessRateLimiter())
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(Front(router, gatekeeper), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield router_pb2_grpc.RouterStub(channel)
    await server.stop(None)
    await router.close()


async def refusal(stub: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in stub.Generate(request, metadata=METADATA, timeout=10):
            pass
    return refused.value


def chat(**fields: object) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(chat=common_pb2.ChatInput(
        messages=[common_pb2.ChatMessage(role="user", content="hi")], **fields))
    request.sampling.max_tokens = 4
    return request


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def with_tool_call(raw: str) -> router_pb2.GenerateRequest:
    request = chat()
    request.chat.messages.add(role="assistant", tool_calls_json=[raw])
    return request


def with_schema(schema: str) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1, 2, 3]))
    request.sampling.max_tokens = 4
    request.sampling.structured.json_schema = schema
    return request


SURROGATE_TOOL = '{"type": "function", "function": {"name": "\\ud800"}}'
CASES = {
    # The reproducers: UNAVAILABLE marked retryable, and RecursionErrors (UNKNOWN / UNAVAILABLE).
    "lone_surrogate_in_tools_json": (chat(tools_json=[SURROGATE_TOOL]), "chat.tools_json[0].function.name",
                                     "surrogate"),
    "lone_surrogate_in_tools_json_not_offered": (chat(tools_json=[SURROGATE_TOOL], tool_choice="none"),
                                                 "chat.tools_json[0].function.name", "surrogate"),
    "deep_tools_json": (chat(tools_json=[TOOL, nested(100_000)]), "chat.tools_json[1]", "nested too deeply"),
    "deep_chat_template_kwargs_json": (chat(chat_template_kwargs_json=nested(100_000)),
                                       "chat.chat_template_kwargs_json", "nested too deeply"),
    "deep_tool_calls_json": (with_tool_call(nested(100_000)), "chat.messages[1].tool_calls_json[0]",
                             "nested too deeply"),
    "just_too_deep_tools_json": (chat(tools_json=[nested(MAX_JSON_DEPTH + 1)]), "chat.tools_json[0]",
                                 f"limit of {MAX_JSON_DEPTH}"),
    "tools_json_not_an_object": (chat(tools_json=["[1]"]), "chat.tools_json[0]", "JSON object"),
    "kwargs_not_json": (chat(chat_template_kwargs_json="{nope"), "chat.chat_template_kwargs_json",
                        "not valid JSON"),
    # Small enough to be parsed at the router; a larger one is parsed only where it is compiled, but its nesting
    # is counted at the router all the same.
    "deep_json_schema": (with_schema(nested(2_000)), "sampling.structured", "nested too deeply"),
    "large_deep_json_schema": (with_schema(nested(100_000)), "sampling.structured", "nested too deeply"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_json_fields_past_the_limits_are_invalid_argument_naming_the_field(
    stub: router_pb2_grpc.RouterStub, case: str
) -> None:
    request, field, words = CASES[case]
    error = await refusal(stub, request)
    detail = detail_of(error)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert detail is not None and not detail.retryable
    assert detail.field == field and words in detail.message, detail


async def test_a_megabyte_model_name_is_invalid_argument_with_bounded_metadata(
    stub: router_pb2_grpc.RouterStub,
) -> None:
    # The client saw RESOURCE_EXHAUSTED: the name came back whole in the status's trailing metadata.
    request = router_pb2.GenerateRequest(prompt="hi", model="m" * (1 << 20))
    error = await refusal(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), (error.details() or "")[:200])
    detail = detail_of(error)
    assert detail is not None and detail.code == "model_not_found" and detail.field == "model"
    assert len(error.details()) <= MAX_MESSAGE_CHARS and f"{1 << 20} characters" in error.details()
    trailing = error.trailing_metadata() or ()
    assert sum(len(key) + len(value) for key, value in trailing) < 4 * MAX_MESSAGE_CHARS
