"""The official `openai` client, unchanged, against a real LocalCluster (tiny model, real Redis limiter).

Every test talks HTTP to the router process started by `qwen-serve up`'s launcher; tenants and
limits come from the key file in conftest.py. Tests that count tokens in a window use their own
tenant, so they never share a window with another test.
"""

from __future__ import annotations

import time

import grpc
import openai
import pytest

from qwenserve.v1 import router_pb2, router_pb2_grpc

PROMPT = [{"role": "user", "content": "Say something about the sea."}]


def client(base_url: str, key: str = "sk-acme") -> openai.OpenAI:
    # No retries: a 429 must surface, not be waited out by the client.
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def acme(base_url: str) -> openai.OpenAI:
    return client(base_url)


@pytest.fixture(scope="module")
def model(acme: openai.OpenAI) -> str:
    return acme.models.list().data[0].id


def test_models_lists_the_served_model(acme: openai.OpenAI, model: str) -> None:
    models = acme.models.list().data
    assert [m.id for m in models] == [model]
    assert acme.models.retrieve(model).id == model


def test_chat_answers_with_text_usage_and_length_finish(acme: openai.OpenAI, model: str) -> None:
    reply = acme.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_streaming_gives_the_same_text_and_usage_as_the_plain_answer(acme: openai.OpenAI, model: str) -> None:
    args = dict(model=model, messages=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    plain = acme.chat.completions.create(**args)
    chunks = list(acme.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_puts_running_usage_in_every_chunk(acme: openai.OpenAI, model: str) -> None:
    stream = acme.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    running = [c.usage.completion_tokens for c in chunks]
    assert running == sorted(running) and running[0] == 0 and running[-1] == 6
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_completions_stream_and_plain_agree(acme: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    plain = acme.completions.create(**args)
    assert plain.object == "text_completion" and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 6
    streamed = list(acme.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text


def test_a_stop_string_ends_the_answer_before_it(acme: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    full = acme.completions.create(**args).choices[0].text
    assert len(full) >= 4, full
    stop = full[2:4]
    expected = full[: full.index(stop)]
    stopped = acme.completions.create(**args, stop=[stop]).choices[0]
    assert stopped.text == expected and stopped.finish_reason == "stop"


def test_the_same_seed_gives_the_same_answer(acme: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        return acme.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=1.0,
                                            seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_n_answers_have_their_own_indexes_and_seeds(acme: openai.OpenAI, model: str) -> None:
    args = dict(model=model, messages=PROMPT, max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    one = acme.chat.completions.create(**args)
    two = acme.chat.completions.create(**args, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    # Answer 0 uses the request's seed itself; answer 1 a seed derived from it.
    assert two.choices[0].message.content == one.choices[0].message.content
    assert two.choices[1].message.content != two.choices[0].message.content
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is billed once
    assert two.usage.completion_tokens == 16
    streamed = list(acme.chat.completions.create(**args, n=2, stream=True))
    for index in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices and c.choices[0].index == index)
        assert text == two.choices[index].message.content


def test_logprobs_name_each_token_with_its_bytes_and_alternatives(acme: openai.OpenAI, model: str) -> None:
    reply = acme.chat.completions.create(model=model, messages=PROMPT, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and isinstance(item.token, str)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)


def test_errors_are_typed_for_the_client_and_never_500(base_url: str, acme: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(base_url, "sk-wrong").chat.completions.create(model=model, messages=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        acme.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=2)
    for bad in ({"temperature": -1}, {"top_p": 0}, {"max_tokens": 10**6}, {"presence_penalty": 5},
                {"extra_body": {"min_p": 2}}, {"top_logprobs": 30, "logprobs": True}):
        with pytest.raises(openai.BadRequestError) as info:
            acme.chat.completions.create(model=model, messages=PROMPT, **bad)
        assert info.value.status_code == 400
        assert info.value.body["message"], bad


def test_over_the_tokens_limit_is_429_with_retry_after_and_rate_limit_headers(base_url: str, model: str) -> None:
    tight = client(base_url, "sk-tight")  # 100 tokens per minute
    args = dict(model=model, prompt="hi", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    first = tight.completions.with_raw_response.create(**args)
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    with pytest.raises(openai.RateLimitError) as info:
        tight.completions.create(**args)
    headers = info.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == "100"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 61
    assert info.value.code == "rate_limit_exceeded"
    # A request larger than the whole limit: 429 without Retry-After (waiting would not help).
    with pytest.raises(openai.RateLimitError) as info:
        tight.completions.create(**{**args, "max_tokens": 150})
    assert "retry-after" not in info.value.response.headers
    assert "max_tokens" in info.value.message


def test_a_request_that_stops_early_gives_back_its_unused_budget(base_url: str, acme: openai.OpenAI,
                                                                 model: str) -> None:
    limit = 300  # the "refund" tenant's tokens per minute
    args = dict(model=model, prompt="Tell me a story", temperature=0, extra_body={"ignore_eos": True})
    probe = acme.completions.create(**args, max_tokens=4).choices[0].text
    assert probe, "the model produced no text to stop on"
    refund = client(base_url, "sk-refund")
    # Costs prompt + 200 up front; the stop string ends it after a token or two.
    early = refund.completions.create(**args, max_tokens=200, stop=[probe[:1]])
    assert early.choices[0].finish_reason == "stop"
    used = early.usage.prompt_tokens + early.usage.completion_tokens
    assert used < 50
    # Without the refund this second charge of prompt + 200 would not fit in 300.
    raw = refund.completions.with_raw_response.create(**args, max_tokens=200, stream=True)
    cost = early.usage.prompt_tokens + 200
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == limit - used - cost
    stream = raw.parse()
    next(iter(stream))
    stream.close()  # leave mid-stream: the router cancels the generation and settles what it used
    time.sleep(1.0)
    after = refund.completions.with_raw_response.create(**args, max_tokens=1)
    remaining = int(after.headers["x-ratelimit-remaining-tokens"])
    assert remaining > limit - used - cost - (early.usage.prompt_tokens + 1)


def test_a_tenant_output_cap_rejects_larger_budgets_and_clamps_the_default(base_url: str, model: str) -> None:
    capped = client(base_url, "sk-capped")  # max_tokens: 8
    with pytest.raises(openai.BadRequestError) as info:
        capped.chat.completions.create(model=model, messages=PROMPT, max_tokens=20)
    assert info.value.body["param"] == "max_tokens"
    reply = capped.chat.completions.create(model=model, messages=PROMPT, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"


def test_grpc_generate_checks_the_same_keys(cluster) -> None:
    request = router_pb2.GenerateRequest(prompt="hi")
    request.sampling.max_tokens = 2
    with grpc.insecure_channel(f"127.0.0.1:{cluster.router_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(stub.Generate(request, metadata=[("authorization", "Bearer sk-acme")], timeout=60))
        assert replies[-1].finish_reason and replies[-1].usage.prompt_tokens >= 1
        replies = list(stub.Generate(request, metadata=[("x-api-key", "sk-acme")], timeout=60))
        assert replies[-1].finish_reason


def test_prompt_logprobs_cross_the_handoff_streamed_or_not_and_skip_the_prefix_cache(acme: openai.OpenAI,
                                                                                      model: str) -> None:
    args = dict(model=model, messages=PROMPT, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1})
    first = acme.chat.completions.create(**args)
    again = acme.chat.completions.create(**args)  # the prompt's blocks are cached by now
    chunks = list(acme.chat.completions.create(**args, stream=True))
    streamed = [c.model_extra["prompt_logprobs"] for c in chunks if c.model_extra.get("prompt_logprobs")]
    assert len(streamed) == 1  # on the first chunk with tokens
    positions = first.model_extra["prompt_logprobs"]
    assert len(positions) == first.usage.prompt_tokens and positions[0] is None
    assert positions == again.model_extra["prompt_logprobs"] == streamed[0]
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    for entries in positions[1:]:
        assert 1 <= len(entries) <= 2 and all(e["logprob"] <= 0 and e["rank"] >= 1 for e in entries.values())


def test_n_answers_share_the_prompt_logprobs_of_one_computation(acme: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt="Four answers, one prompt to score.", max_tokens=2, temperature=1.0, seed=3,
                extra_body={"prompt_logprobs": 1})
    alone = acme.completions.create(**args).choices[0].model_extra["prompt_logprobs"]
    # Only the first copy asks for them, so the others may reuse the prompt's cached blocks.
    four = acme.completions.create(**args, n=4)
    assert [c.model_extra["prompt_logprobs"] for c in four.choices] == [alone] * 4
    streamed = [c for chunk in acme.completions.create(**args, n=4, stream=True) for c in chunk.choices
                if c.model_extra.get("prompt_logprobs")]
    assert sorted(c.index for c in streamed) == [0, 1, 2, 3]
    assert all(c.model_extra["prompt_logprobs"] == alone for c in streamed)
