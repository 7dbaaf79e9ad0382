"""The HTTP front refuses bad requests before they reach a worker: the right 4xx in OpenAI's error shape.

The app runs in-process around a real Router whose workers do not exist: every request here must
be answered without contacting them (a request that got through would fail with a 5xx instead).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from qwenserve.ratelimit import InProcessRateLimiter
from qwenserve.router.admission import Gatekeeper
from qwenserve.router.generation import Router, RouterConfig
from qwenserve.router.openai_http import build_app
from qwenserve.tenancy import KeyStore, Tenant, key_digest
from qwenserve.tokenizer.detokenizer import IncrementalDetokenizer
from qwenserve.tokenizer.tokenizer import Tokenizer

KEY = {"Authorization": "Bearer sk-test"}
CHAT = {"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}]}
LIMIT = 64 * 1024


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    router = Router(RouterConfig("127.0.0.1:1", ["127.0.0.1:1"], ["127.0.0.1:1"]), detokenizer_factory=None)  # type: ignore[arg-type]
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
    router = Router(RouterConfig("127.0.0.1:1", [], ["127.0.0.1:1"]), detokenizer_factory=None)  # type: ignore[arg-type]
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
    router = Router(RouterConfig(dead, [dead], [dead], connect_timeout_s=0.5),
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


async def test_a_failed_stream_ends_each_choice_with_finish_reason_error_never_empty_choices(
        dead_workers_client) -> None:
    body = {"model": "qwen-test", "prompt": [1, 2, 3], "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    response = await dead_workers_client.post("/v1/completions", json=body, headers=KEY)
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in (await response.text()).split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]
    for chunk in finals:
        choice = chunk["choices"][0]
        assert choice["finish_reason"] == "error" and choice["error"]["message"]
    # The usage chunk (OpenAI's shape: empty choices, only with include_usage) still comes last.
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 0
    assert chunks[-1]["usage"]["prompt_tokens"] == 3
