"""Streams and size limits as a client sees them from a real cluster, with the official `openai` client.

The cluster serves a tiny checkpoint built to answer only special tokens, which
`skip_special_tokens` leaves out of the text: every token decodes to nothing, the case in which
chunks used to be withheld until the end. Its KV caches hold 512 tokens while the model has 1,024
positions, so the engines serve a max_model_len of 512 and the router learns it: a request that asks
for more is a 400 `context_length_exceeded` when max_tokens says so, the most that fits when
max_tokens is left out.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve.launcher import LocalCluster
from tests.support.checkpoints import tiny_checkpoint

# <|object_ref_start|> and <|object_ref_end|>: special, never end a request, never shown as text.
SILENT_TOKENS = (151646, 151647)
CONTEXT = 1024
KV_POOL_TOKENS = 512  # 32 blocks of 16 tokens
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers x (K, V) x kv heads x head_dim x fp32
PROMPT = [{"role": "user", "content": "Say something."}]


def silent_checkpoint(path: Path) -> Path:
    """The tiny checkpoint whose logits are 0 everywhere but +-h[0] on the two silent tokens, so greedy
    decoding always picks one of them (h is the final norm's output, kept only in dimension 0)."""
    tiny_checkpoint(path, seed=5, max_position_embeddings=CONTEXT, tie_word_embeddings=False)
    weights = load_file(str(path / "model.safetensors"))
    head = torch.zeros_like(weights["lm_head.weight"])
    head[SILENT_TOKENS[0], 0], head[SILENT_TOKENS[1], 0] = 1.0, -1.0
    norm = torch.zeros_like(weights["model.norm.weight"])
    norm[0] = 1.0
    weights.update({"lm_head.weight": head, "model.norm.weight": norm})
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("silent")
    env = {"QWENSERVE_KV_CACHE_GB": str(KV_POOL_TOKENS * KV_BYTES_PER_TOKEN / 2**30), "QWENSERVE_THREADS": "1",
           "QWENSERVE_KV_POOL_MIB": "8", "QWENSERVE_DTYPE": "float32"}  # KV_BYTES_PER_TOKEN is fp32's
    with LocalCluster(model=silent_checkpoint(tmp / "model"), env=env, log_dir=tmp / "logs") as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_tokens_that_decode_to_no_text_each_reach_the_client_in_their_own_chunk(client: openai.OpenAI,
                                                                               model: str) -> None:
    chunks = list(client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c for c in chunks[1:] if c.choices and c.choices[0].finish_reason is None]
    assert deltas, "every token was withheld"
    assert all(c.choices[0].delta.content == "" for c in deltas)
    running = [c.usage.completion_tokens for c in deltas]
    # The prefill worker's first token comes alone, then decode's: more than one chunk, and each one
    # carries new tokens (the count grows at every chunk), up to all twelve.
    assert len(running) >= 2 and running == sorted(set(running)) and running[0] >= 1 and running[-1] == 12, running
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and chunks[-1].usage.completion_tokens == 12


def test_legacy_completions_stream_empty_text_chunks_too(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=6, temperature=0,
                                            stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(texts) >= 2 and set(texts) == {""}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_a_request_without_max_tokens_gets_what_the_kv_cache_holds(client: openai.OpenAI, model: str) -> None:
    # The model's positions (1,024) would need 64 blocks of a 32-block cache; the context is what it holds.
    reply = client.chat.completions.create(model=model, messages=PROMPT, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == KV_POOL_TOKENS


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_beyond_the_kv_cache_is_400_context_length_exceeded_naming_the_limit(
        client: openai.OpenAI, model: str, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        # Within the model's positions (1,024), beyond the cache (512); a stream too is refused with a status.
        client.chat.completions.create(model=model, messages=PROMPT, max_tokens=600, stream=stream)
    assert refused.value.code == "context_length_exceeded"
    assert f"{KV_POOL_TOKENS} tokens" in refused.value.message and "max_tokens" in refused.value.message


def test_a_prompt_longer_than_the_kv_cache_is_400_context_length_exceeded(client: openai.OpenAI,
                                                                         model: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=[7] * (KV_POOL_TOKENS + 10), max_tokens=1)
    assert refused.value.code == "context_length_exceeded" and str(KV_POOL_TOKENS) in refused.value.message


def test_two_requests_in_flight_with_one_x_request_id_both_finish(client: openai.OpenAI, model: str) -> None:
    args = dict(model=model, messages=PROMPT, max_tokens=40, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "same-id-1"})
    first = client.chat.completions.with_raw_response.create(**args)
    first_chunks = iter(first.parse())
    opened = [next(first_chunks), next(first_chunks)]  # in flight: its role chunk and first token are here
    second = client.chat.completions.with_raw_response.create(**args)
    second_chunks = list(second.parse())
    first_all = opened + list(first_chunks)
    for raw, chunks in ((first, first_all), (second, second_chunks)):
        assert raw.headers["X-Request-Id"] == "same-id-1"
        assert {c.id for c in chunks} == {"same-id-1"}
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert chunks[-1].usage.completion_tokens == 40


def test_a_failure_mid_stream_is_an_error_event_then_done_never_a_finish_reason(cluster: LocalCluster,
                                                                               model: str) -> None:
    # Kills the only decode worker: keep this test last in the module.
    body = {"model": model, "messages": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events: list[str] = []
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        for raw in response:  # lines, as they arrive
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if len(events) == 3:  # the role chunk and two with tokens: decode is under way
                decode = cluster.child("decode-0").process
                assert decode is not None
                decode.send_signal(signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = openai_error(events[-2])
    assert error["code"] and error["message"] and error["type"] == "server_error"
    assert '"finish_reason":"error"' not in "".join(events) and '"finish_reason":"abort"' not in "".join(events)


def openai_error(event: str) -> dict:
    body = json.loads(event)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
