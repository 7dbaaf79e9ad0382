"""Hostile input over HTTP is a client error in OpenAI's shape, never a 5xx, and never echoed back unbounded.

The app runs in-process around a real Router whose workers do not exist: every request here must be
answered without contacting them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from qwenserve.ratelimit import InProcessRateLimiter
from qwenserve.router.config import RouterConfig
from qwenserve.router.gatekeeper import Gatekeeper
from qwenserve.router.generation import Router
from qwenserve.router.openai_http import build_app
from qwenserve.tenancy import KeyStore, Tenant, key_digest
from qwenserve.untrusted_input import MAX_FIELD_CHARS, MAX_MESSAGE_CHARS

KEY = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
CHAT = {"model": "qwen-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CONTEXT = 4096


class DigitsDetokenizer:
    """Each id as its decimal digits and a space: enough to see which ids were detokenized."""

    def push(self, ids: Sequence[int]) -> str:
        return "".join(f"{i} " for i in ids)

    def flush(self) -> str:
        return ""


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    dead = "127.0.0.1:1"
    router = Router(RouterConfig(dead, [dead], [dead], max_model_len=CONTEXT), lambda skip: DigitsDetokenizer())
    router.vocab_size = 151_936  # as if start() had asked the tokenizer
    keys = KeyStore([Tenant("t")], [(key_digest("sk-test"), "t")])
    app = build_app(router, Gatekeeper(keys, InProcessRateLimiter()), "qwen-test", max_body_bytes=8 << 20)
    async with TestClient(TestServer(app)) as c:
        yield c
    await router.close()


async def error_of(response: aiohttp.ClientResponse, status: int) -> dict:
    assert response.status == status, (await response.text())[:2000]
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def nested_text(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [20_000, 40])
async def test_guided_json_sent_as_deeply_nested_text_is_400_naming_it(client: TestClient, depth: int) -> None:
    # The reproducer (20,000 levels: a RecursionError and a 500) and one the parser survives.
    body = {**CHAT, "guided_json": nested_text(depth)}
    error = await error_of(await client.post("/v1/chat/completions", data=json.dumps(body), headers=KEY), 400)
    assert error["param"] == "guided_json" and "nested too deeply" in error["message"], error
    assert "32" in error["message"]


async def test_guided_json_text_with_a_lone_surrogate_is_400_naming_where(client: TestClient) -> None:
    schema = '{"type": "object", "properties": {"a": {"const": "\\udc80"}}}'
    body = {**CHAT, "guided_json": schema}
    error = await error_of(await client.post("/v1/chat/completions", data=json.dumps(body), headers=KEY), 400)
    assert error["param"] == "guided_json.properties.a.const" and "surrogate" in error["message"], error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
async def test_a_megabyte_model_name_is_404_with_a_short_message(client: TestClient, path: str) -> None:
    name = "m" * (1 << 20)
    body = {**CHAT, "model": name, "prompt": "hi", "tokens": [1]}
    error = await error_of(await client.post(path, data=json.dumps(body), headers=KEY), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert len(error["message"]) <= MAX_MESSAGE_CHARS and f"{1 << 20} characters" in error["message"]


async def test_a_key_of_a_megabyte_is_not_echoed_back_whole(client: TestClient) -> None:
    kwargs = {"k" * (1 << 20): ["\ud800"]}
    body = json.dumps({**CHAT, "chat_template_kwargs": kwargs})
    error = await error_of(await client.post("/v1/chat/completions", data=body, headers=KEY), 400)
    assert "surrogate" in error["message"]
    assert len(error["message"]) <= MAX_MESSAGE_CHARS and len(error["param"]) <= MAX_FIELD_CHARS


async def test_detokenize_takes_at_most_a_context_of_ids_and_refuses_more_at_once(client: TestClient) -> None:
    ok = await client.post("/detokenize", data=json.dumps({"tokens": [7] * CONTEXT}), headers=KEY)
    assert ok.status == 200 and (await ok.json())["prompt"] == "7 " * CONTEXT
    # The 1.9M ids (it held the router ~2 s): refused before any id is looked at.
    raw = json.dumps({"tokens": [1] * 1_900_000}).encode()
    started = time.monotonic()
    error = await error_of(await client.post("/detokenize", data=raw, headers=KEY), 413)
    assert time.monotonic() - started < 2.0
    assert error["param"] == "tokens" and f"limit of {CONTEXT}" in error["message"]
    error = await error_of(await client.post("/detokenize", data=json.dumps({"tokens": [1] * (CONTEXT + 1)}),
                                             headers=KEY), 413)
    assert error["code"] == "request_too_large" and f"{CONTEXT + 1} ids" in error["message"]
