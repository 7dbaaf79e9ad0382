"""OpenAI bodies to GenerateRequests: what is accepted, and the 400 (with param) for what is not."""

from __future__ import annotations

import json

import pytest

from qwenserve.router.errors import InvalidRequest
from qwenserve.router.openai_fields import parse_json_body
from qwenserve.router.openai_request import parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**extra: object):
    return parse_chat({**CHAT, **extra})


def rejected(fn, body: dict, param: str) -> str:
    with pytest.raises(InvalidRequest) as info:
        fn(body)
    assert info.value.field == param, info.value.message
    return info.value.message


def test_chat_parameters_reach_the_generate_request() -> None:
    parsed = chat(
        max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=-1, stop="END", presence_penalty=0.25,
        frequency_penalty=-0.5, top_k=-1, min_p=0.1, repetition_penalty=1.1, ignore_eos=True, min_tokens=2,
        chat_template_kwargs={"enable_thinking": False}, n=3, logprobs=True, top_logprobs=4, user="u-1",
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    req = parsed.prompts[0]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.min_tokens, s.top_k, s.ignore_eos) == (7, 0.5, 2, 0, True)
    assert s.seed == 2**64 - 1  # -1 maps onto the uint64 space
    assert list(req.stop) == ["END"]
    assert s.logprobs and s.top_logprobs == 4
    assert req.chat.messages[0].content == "hi" and req.chat.add_generation_prompt
    assert req.chat.HasField("enable_thinking") and not req.chat.enable_thinking
    assert json.loads(req.chat.chat_template_kwargs_json) == {"enable_thinking": False}
    assert (parsed.n, parsed.stream, parsed.include_usage, parsed.continuous_usage, parsed.user) == (
        3, True, True, True, "u-1")


def test_max_completion_tokens_wins_over_max_tokens_and_unset_leaves_the_router_default() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).prompts[0].sampling.max_tokens == 9
    assert not chat().prompts[0].sampling.HasField("max_tokens")


def test_content_parts_and_developer_role_are_accepted() -> None:
    parsed = parse_chat({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})
    messages = parsed.prompts[0].chat.messages
    assert (messages[0].role, messages[1].content) == ("system", "a\nb")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "temperature": True}, "temperature"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": -3}, "max_tokens"),
        ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "n": 1000}, "n"),
        ({**CHAT, "stop": 5}, "stop"),
        ({**CHAT, "stop": ["a", 1]}, "stop"),
        ({**CHAT, "seed": 2**70}, "seed"),
        ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
        ({**CHAT, "tools": {"type": "function"}}, "tools"),
        ({**CHAT, "tool_choice": "sometimes"}, "tool_choice"),
        ({**CHAT, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
        ({**CHAT, "chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ],
)
def test_bad_chat_bodies_name_the_parameter(body: dict, param: str) -> None:
    rejected(parse_chat, body, param)


def test_a_body_wrapped_in_data_says_so() -> None:
    message = rejected(parse_chat, {"data": CHAT}, "data")
    assert "wrapped" in message


def test_invalid_json_and_non_objects_are_explained() -> None:
    for raw, words in ((b"{", "not valid JSON"), (b"[1]", "must be a JSON object"), (b"", "empty"),
                       (b'{"temperature": NaN}', "not valid JSON"), (b"\xff\xfe", "UTF-8")):
        with pytest.raises(InvalidRequest) as info:
            parse_json_body(raw)
        assert words in info.value.message, info.value.message


def test_completion_prompts_string_ids_and_batches() -> None:
    assert parse_completion({"prompt": "abc"}).prompts[0].prompt == "abc"
    assert list(parse_completion({"prompt": [1, 2, 3]}).prompts[0].prompt_token_ids.ids) == [1, 2, 3]
    batch = parse_completion({"prompt": ["a", [4, 5]], "max_tokens": 3, "temperature": 0, "stop": ["x"]})
    assert [r.WhichOneof("input") for r in batch.prompts] == ["prompt", "prompt_token_ids"]
    # Every prompt of a batch carries the same settings.
    assert all(r.sampling.max_tokens == 3 and list(r.stop) == ["x"] for r in batch.prompts)
    assert parse_completion({"prompt": "a"}).prompts[0].sampling.max_tokens == 16  # the legacy default


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt[0]"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": {"text": "a"}}, "prompt"),
        ({"prompt": "a", "logprobs": 6}, "logprobs"),
        ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "a", "echo": "yes"}, "echo"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
    ],
)
def test_bad_completion_bodies_name_the_parameter(body: dict, param: str) -> None:
    rejected(parse_completion, body, param)


def test_echo_with_logprobs_asks_for_the_prompts_logprobs_with_as_many_alternatives() -> None:
    parsed = parse_completion({"prompt": ["a", "b"], "echo": True, "logprobs": 3, "prompt_logprobs": 1})
    assert parsed.echo_logprobs and parsed.prompt_logprobs == 1
    assert [p.sampling.prompt_logprobs for p in parsed.prompts] == [3, 3]
