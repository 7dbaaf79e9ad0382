"""Thinking and tool calls as Qwen3 users call them, through the official `openai` client and gRPC.

The cluster serves a scripted checkpoint (tests/support/scripted_checkpoint.py): real weights that make the model
write, after the chat template's "assistant\\n", a thinking block and then a tool call:

    <think>I think</think><tool_call>{"name":"get_weather","arguments":{"city": "Paris"}}</tool_call>

With thinking turned off (the template's prompt then ends in an empty block) it writes only the call;
after a forced "<tool_call>" (tool_choice required) it writes the call's JSON.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from qwenserve.launcher import LocalCluster
from qwenserve.tokenizer import Tokenizer
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.scripted_checkpoint import script_ids, write_scripted_checkpoint

CALL = '{"name":"get_weather","arguments":{"city": "Paris"}}'
ARGUMENTS = {"city": "Paris"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer.builtin()
    call = script_ids(tokenizer, ["<tool_call>", CALL, "</tool_call>", "<|im_end|>"])
    thinking = script_ids(tokenizer, ["\n", "<think>", "I think", "</think>"]) + call
    after_empty_block = script_ids(tokenizer, ["\n\n"]) + call  # the prompt's "<think>\n\n</think>\n\n"
    return write_scripted_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-scripted",
                                     [thinking, after_empty_block])


KEYS = {"tenants": {"plain": None, "careful": {"content_filter": {"words": ["Paris"],
                                                                  "patterns": ["(?<=I )think"]}}},
        "keys": [{"tenant": "plain", "key": "sk-plain"}, {"tenant": "careful", "key": "sk-careful"}]}


@pytest.fixture(scope="module")
def cluster(scripted_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("scripted-logs")
    keys = logs / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with LocalCluster(model=scripted_model, prefill=1, decode=1, log_dir=logs, env={"QWENSERVE_API_KEYS_FILE": str(keys)},
                      extra_worker_args=["--kv-cache-gb", "0.05"]) as running:
        yield running


def _client(cluster: LocalCluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return _client(cluster, "sk-plain")


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_thinking_is_split_into_reasoning_content_and_counted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=64, temperature=0)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "I think"
    # Without tools, the call is the model's text: nothing parses it.
    assert message.content == f"<tool_call>{CALL}</tool_call>" and not message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    # <think>, "I", " think", </think>: the thinking tokens, out of all the completion's.
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4
    assert reply.usage.completion_tokens > 4


def test_a_tool_call_comes_back_parsed_whole_with_its_reasoning(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER, CLOCK],
                                           max_tokens=64, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.model_extra["reasoning_content"] == "I think"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert call.id.startswith("call_") and len(call.id) == 29


def test_a_streamed_tool_call_assembles_as_the_client_expects(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER], max_tokens=64,
                                            temperature=0.8, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, content, calls, finish, usage = "", "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == "I think" and content == "" and finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == ARGUMENTS and calls[0]["id"].startswith("call_")
    assert usage.completion_tokens_details.reasoning_tokens == 4


SKY = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]}}, "required": ["sky"],
       "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_model_reasons_freely_and_the_grammar_shapes_only_its_answer(client: openai.OpenAI,
                                                                                 stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SKY, "strict": True}}
    reply = client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=64, temperature=0,
                                           response_format=fmt, stream=stream)
    chunks = list(reply) if stream else []
    if stream:
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                            for c in chunks if c.choices)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reasoning, content = reply.choices[0].message.model_extra["reasoning_content"], reply.choices[0].message.content
    # The script's thinking came through untouched; after </think> the model wanted "<tool_call>", which the
    # schema does not allow: the answer is the schema's.
    assert reasoning == "I think"
    assert json.loads(content)["sky"] in ("clear", "cloudy") and set(json.loads(content)) == {"sky"}


def test_without_thinking_the_grammar_applies_from_the_first_token(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=16, temperature=0,
                                           extra_body={**NO_THINKING, "guided_choice": ["rain", "sun"]})
    assert reply.choices[0].message.content in ("rain", "sun")
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})


def test_thinking_turned_off_by_the_template_gives_no_reasoning(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER], max_tokens=64,
                                           temperature=0, extra_body=NO_THINKING)
    message = reply.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_tool_choice_required_forces_a_call_and_none_offers_no_tools(client: openai.OpenAI) -> None:
    forced = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER],
                                            tool_choice="required", max_tokens=64, temperature=0)
    (call,) = forced.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == ARGUMENTS and forced.choices[0].finish_reason == "tool_calls"
    # The answer began inside the call: no thinking, and the forced tag is not repeated.
    assert "reasoning_content" not in (forced.choices[0].message.model_extra or {})

    declined = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER],
                                              tool_choice="none", max_tokens=64, temperature=0)
    assert not declined.choices[0].message.tool_calls and declined.choices[0].finish_reason == "stop"
    assert declined.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"


def test_a_tool_result_in_a_later_turn_is_rendered(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER], max_tokens=64,
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    again = client.chat.completions.create(model=_model(client), messages=turns, tools=[WEATHER], max_tokens=64,
                                           temperature=0)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    assert again.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=4, extra_body=extra)
    assert refused.value.body["param"] == param, refused.value.body


def test_grpc_generate_carries_reasoning_tool_calls_and_their_finish(cluster: LocalCluster) -> None:
    chat = common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content=ASK[0]["content"])],
                                add_generation_prompt=True, tools_json=[json.dumps(WEATHER)])
    request = router_pb2.GenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=64))
    with grpc.insecure_channel(f"127.0.0.1:{cluster.router_port}") as channel:
        replies = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60,
                                                                    metadata=[("authorization", "Bearer sk-plain")]))
    assert "".join(r.reasoning_text for r in replies) == "I think"
    assert "".join(r.text for r in replies).strip() == ""
    (call,) = [c for r in replies for c in r.tool_calls]
    assert call.name == "get_weather" and json.loads(call.arguments_json) == ARGUMENTS
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert replies[-1].usage.reasoning_tokens == 4


def _post(cluster: LocalCluster, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer sk-plain"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_as_vllm_serves_them(cluster: LocalCluster) -> None:
    status, plain = _post(cluster, "/tokenize", {"prompt": "Hello there", "return_token_strs": True})
    assert status == 200 and plain["tokens"] == [9707, 1052] and plain["count"] == 2, plain
    assert plain["token_strs"] == ["Hello", " there"] and plain["max_model_len"] == 1024
    assert _post(cluster, "/detokenize", {"tokens": plain["tokens"]}) == (200, {"prompt": "Hello there"})

    # A conversation is tokenized as a generation sees it: template, tools, and a forced tool call's start.
    _, chat = _post(cluster, "/tokenize", {"messages": ASK, "add_generation_prompt": True})
    _, forced = _post(cluster, "/tokenize", {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    _, text = _post(cluster, "/detokenize", {"tokens": forced["tokens"]})
    assert chat["tokens"][-2:] == [77091, 198]  # "assistant", "\n"
    assert text["prompt"].endswith("<|im_start|>assistant\n<tool_call>") and '"get_weather"' in text["prompt"]

    status, error = _post(cluster, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = _post(cluster, "/tokenize", {"prompt": "hi", "model": "no-such-model"})
    assert status == 404 and error["error"]["param"] == "model"


def test_a_tenants_filtered_words_never_reach_it_and_end_the_answer(cluster: LocalCluster) -> None:
    careful = _client(cluster, "sk-careful")
    model = _model(careful)
    # Thinking off: the answer is the call's text, whose "Paris" is filtered (tools off: it is plain content).
    reply = careful.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0,
                                            extra_body=NO_THINKING)
    assert reply.choices[0].finish_reason == "content_filter"
    assert reply.choices[0].message.content == '<tool_call>{"name":"get_weather","arguments":{"city": "'
    stream = careful.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0, stream=True,
                                             extra_body=NO_THINKING)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content and "Paris" not in streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["content_filter"]
    # Reasoning is filtered too: "I think" stops at "think".
    thought = careful.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0)
    assert thought.choices[0].finish_reason == "content_filter"
    assert thought.choices[0].message.model_extra["reasoning_content"].strip() == "I"
    # Another tenant's answers are untouched.
    plain = _client(cluster, "sk-plain").chat.completions.create(model=model, messages=ASK, max_tokens=64,
                                                                 temperature=0, extra_body=NO_THINKING)
    assert "Paris" in plain.choices[0].message.content and plain.choices[0].finish_reason == "stop"
