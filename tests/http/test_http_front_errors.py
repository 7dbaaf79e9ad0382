"""The HTTP front refuses bad requests before they reach a worker: the right 4xx in OpenAI's error shape.

The app runs in-process around a real Router whose workers do not exist: every request here must
be answered without contacting them (a request that got through would fail with a 5xx instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from qwenserve.ratelimit import InProcessRateLimiter
from qwenserve.router.config import RouterConfig
from qwenserve.router.front_door import FrontConfig, add_front_flags, start_http_front
from qwenserve.router.gatekeeper import Gatekeeper
from qwenserve.router.generation import Router
from qwenserve.router.openai_http import build_app
from qwenserve.tenancy import KeyStore, Tenant, key_digest
from qwenserve.tokenizer.detokenizer import IncrementalDetokenizer
from qwenserve.tokenizer.tokenizer import Tokenizer
from tests.support.ports import free_port

KEY = {"Authorization": "Bearer sk-test"}
CHAT = {"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}]}
LIMIT = 64 * 1024


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    router = Router(RouterConfig("127.0.0.1:1", ["127.0.0.1:1"], ["127.0.0.1:1"], max_model_len=4096), detokenizer_factory=None)  # type: ignore[arg-type]
    router.vocab_size = 151_936  # as if start() had asked the tokenizer
    keys = KeyStore([Tenant("t")], [(key_digest("sk-test"), "t")])
    app = build_app(router, Gatekeeper(keys, InProcessRateLimiter()), "qwen-test", max_body_bytes=LIMIT)
    async with TestClient(TestServer(app)) as c:
        yield c
    await router.close()


async def error_of(response: aiohttp.ClientResponse, status: int) -> dict:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


async def test_missing_and_wrong_keys_are_401(client: TestClient) -> None:
    err = await error_of(await client.post("/v1/chat/completions", json=CHAT), 401)
    assert err["code"] == "invalid_api_key" and "Bearer" in err["message"]
    await error_of(await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer no"}), 401)
    await error_of(await client.get("/v1/models", headers={"x-api-key": "wrong"}), 401)


async def test_x_api_key_header_is_accepted(client: TestClient) -> None:
    response = await client.get("/v1/models", headers={"x-api-key": "sk-test"})
    assert response.status == 200
    assert [m["id"] for m in (await response.json())["data"]] == ["qwen-test"]


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b"{not json", "body", "not valid JSON"),
        (b'"a string"', "body", "JSON object"),
        (b'{"data": {"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}]}}', "data", "wrapped"),
        (b'{"model": "qwen-test", "messages": [{"role": "user", "content": 5}]}', "messages[0].content", "string"),
        (b'{"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}',
         "max_tokens", "integer"),
        (b'{"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}], "n": 99}', "n", "n must"),
    ],
)
async def test_malformed_bodies_are_400_saying_what_is_wrong(client: TestClient, raw: bytes, param: str,
                                                             words: str) -> None:
    response = await client.post("/v1/chat/completions", data=raw, headers={**KEY, "Content-Type": "application/json"})
    err = await error_of(response, 400)
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


async def test_token_ids_outside_the_vocabulary_are_400_on_the_prompt(client: TestClient) -> None:
    # Router.prepare() rejects these; its "input" field is reported as OpenAI's "prompt".
    response = await client.post("/v1/completions", json={"model": "qwen-test", "prompt": [10**9]}, headers=KEY)
    err = await error_of(response, 400)
    assert err["param"] == "prompt" and "vocabulary" in err["message"]


async def test_a_router_still_starting_answers_503_not_a_vocabulary_error() -> None:
    # A request waits for the tokenizer within the tokenizer call's bound (30 s by default) before the 503.
    router = Router(RouterConfig("127.0.0.1:1", [], ["127.0.0.1:1"], max_model_len=4096, tokenizer_timeout_s=1.0),
                    detokenizer_factory=None)  # type: ignore[arg-type]
    keys = KeyStore([Tenant("t")], [(key_digest("sk-test"), "t")])
    app = build_app(router, Gatekeeper(keys, InProcessRateLimiter()), "qwen-test")
    async with TestClient(TestServer(app)) as c:
        response = await c.post("/v1/completions", json={"model": "qwen-test", "prompt": [5]}, headers=KEY)
        err = await error_of(response, 503)
    await router.close()
    assert "starting" in err["message"]


async def test_an_unknown_model_is_404(client: TestClient) -> None:
    err = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, headers=KEY), 404)
    assert err["code"] == "model_not_found" and "qwen-test" in err["message"]
    await error_of(await client.get("/v1/models/gpt-9", headers=KEY), 404)


async def test_oversized_bodies_are_413_with_or_without_a_content_length(client: TestClient) -> None:
    big = b'{"model": "qwen-test", "messages": [{"role": "user", "content": "' + b"a" * LIMIT + b'"}]}'
    err = await error_of(await client.post("/v1/chat/completions", data=big, headers=KEY), 413)
    assert str(LIMIT) in err["message"]

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    await error_of(await client.post("/v1/chat/completions", data=chunks(), headers=KEY), 413)


async def test_unknown_routes_and_methods_answer_in_the_error_shape(client: TestClient) -> None:
    await error_of(await client.post("/v1/embeddings", json={}, headers=KEY), 404)
    await error_of(await client.get("/v1/chat/completions", headers=KEY), 405)
    assert (await client.get("/health")).status == 200


@pytest.fixture
async def dead_workers_client() -> AsyncIterator[TestClient]:
    """A front whose router knows the vocabulary but whose prefill and decode workers are all down."""
    dead = "127.0.0.1:1"
    tokenizer = Tokenizer.builtin()
    router = Router(RouterConfig(dead, [dead], [dead], max_model_len=4096, connect_timeout_s=0.5),
                    lambda skip: IncrementalDetokenizer(tokenizer, skip))
    router.vocab_size = 1000
    keys = KeyStore([Tenant("t")], [(key_digest("sk-test"), "t")])
    app = build_app(router, Gatekeeper(keys, InProcessRateLimiter()), "qwen-test")
    async with TestClient(TestServer(app)) as c:
        yield c
    await router.close()


async def test_a_failed_generation_without_streaming_is_a_503_in_the_error_shape(dead_workers_client) -> None:
    body = {"model": "qwen-test", "prompt": [1, 2, 3], "max_tokens": 4}
    err = await error_of(await dead_workers_client.post("/v1/completions", json=body, headers=KEY), 503)
    assert err["type"] == "server_error" and "decode worker" in err["message"]


async def test_a_stream_that_fails_before_its_first_token_is_a_plain_503_not_a_200_stream(
        dead_workers_client) -> None:
    # The headers wait for the first message, so the status can still say what happened (and a
    # client's retry logic sees a 503), instead of a 200 stream with a made-up finish_reason.
    body = {"model": "qwen-test", "prompt": [1, 2, 3], "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    response = await dead_workers_client.post("/v1/completions", json=body, headers=KEY)
    err = await error_of(response, 503)
    assert err["type"] == "server_error" and "decode worker" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "model": "\ud800"}, "model"),
        ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f\udfff", "arguments": "{}"}}]}]},
         "messages[0].tool_calls[0].function.name"),
        ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"\ud83d": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls[0].function"),
        ({**CHAT, "chat_template_kwargs": {"x": ["\udc80"]}}, "chat_template_kwargs.x[0]"),
        ({**CHAT, "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages[0].name"),
        ({**CHAT, "stop": ["ok", "\ud800"]}, "stop"),
    ],
)
async def test_lone_surrogates_in_any_string_are_400_naming_the_field(client: TestClient, body: dict,
                                                                       param: str) -> None:
    # "\ud800" is valid JSON but not encodable text: protobuf and the tokenizer would fail on it later.
    raw = json.dumps(body).encode()
    assert b"\\ud8" in raw or b"\\udf" in raw or b"\\udc" in raw
    response = await client.post("/v1/chat/completions", data=raw, headers={**KEY, "Content-Type": "application/json"})
    err = await error_of(response, 400)
    assert err["param"] == param and "surrogate" in err["message"], err


async def test_deeply_nested_json_is_400_and_logged_in_one_line(client: TestClient,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="qwenserve.router.openai_http")
    deep = b'{"model": "qwen-test", "messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    response = await client.post("/v1/chat/completions", data=deep, headers={**KEY, "Content-Type": "application/json"})
    err = await error_of(response, 400)
    assert err["param"] == "body" and "nested too deeply" in err["message"]
    # Nesting that the parser survives is still bounded where we pass JSON on (the tokenizer renders it).
    kwargs: object = 1
    for _ in range(40):
        kwargs = {"k": kwargs}
    response = await client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs}, headers=KEY)
    err = await error_of(response, 400)
    assert err["param"] == "chat_template_kwargs" and "nested" in err["message"]
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 2 and not any(r.exc_info for r in caplog.records)
    assert "400 invalid_request" in refused[0].getMessage()


async def test_the_x_request_id_header_is_echoed_only_when_it_is_a_safe_token(dead_workers_client) -> None:
    body = {"model": "qwen-test", "prompt": [1, 2, 3], "max_tokens": 2}
    for given, echoed in [("client-42.a:b_c", True), ("x" * 129, False), ("a b", False), ("ü", False)]:
        headers = {**KEY, "X-Request-Id": given.encode().decode("latin-1")}
        response = await dead_workers_client.post("/v1/completions", json=body, headers=headers)
        assert response.status == 503
        assert (response.headers["X-Request-Id"] == given) is echoed
        assert response.headers["X-Request-Id"].startswith("cmpl-") is not echoed


async def _raw_post(port: int, auth: bytes, body: bytes, content_length: int,
                    connection: bytes = b"keep-alive") -> tuple[bytes, float]:
    """Send headers and `body` (maybe less than Content-Length); the server's whole answer and how long
    until it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + auth + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(content_length).encode() + b"\r\n"
                 b"Connection: " + connection + b"\r\n\r\n" + body)
    await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(), timeout=10)  # read() returns at EOF: the server closed
    finally:
        writer.close()
    return answer, time.monotonic() - started


async def test_an_api_key_that_is_not_utf8_is_401_not_a_crash(client: TestClient) -> None:
    body = json.dumps(CHAT).encode()
    answer, _ = await _raw_post(client.port, b"sk-\xff\xfe", body, len(body), connection=b"close")
    assert answer.startswith(b"HTTP/1.1 401 "), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_api_key"


async def test_a_half_sent_body_gets_408_and_the_connection_closed_at_the_body_timeout() -> None:
    parser = argparse.ArgumentParser()
    add_front_flags(parser)
    front = FrontConfig.from_args(parser.parse_args(["--http-body-timeout-s", "0.5", "--no-auth"]))
    router = Router(RouterConfig("127.0.0.1:1", [], ["127.0.0.1:1"], max_model_len=4096), detokenizer_factory=None)  # type: ignore[arg-type]
    router.vocab_size = 151_936
    keys = KeyStore([Tenant("t")], [(key_digest("sk-test"), "t")])
    port = free_port()
    runner = await start_http_front(router, Gatekeeper(keys, InProcessRateLimiter()), front, "qwen-test",
                                    "127.0.0.1", port, None)
    body = json.dumps(CHAT).encode()
    try:
        answer, took = await _raw_post(port, b"sk-test", body[: len(body) // 2], len(body))
    finally:
        await runner.cleanup()
        await router.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and error["param"] == "body" and "0.5 s" in error["message"]
    # Closed right after the answer: not held open for the rest of a body that never comes.
    assert 0.4 < took < 3.0
