"""Structured output through the official `openai` client: every answer parses and validates, greedy or sampled.

A random-weight model is the hardest client of a grammar (it wants any token at all), and each answer
here goes through prefill (the first token) and a handoff to decode (the rest), so both engines keep
the same grammar state. Schemas bound their strings and numbers: an unbounded one lets a model write
digits until max_tokens, which no grammar can prevent. Chat requests turn thinking off (the template then closes an
empty block in the prompt and the grammar applies from the first token): asked to think, a random model may think
until max_tokens, as the grammar lets it (tests/http/test_reasoning_and_tools.py covers thinking first).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
import xgrammar

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.launcher import LocalCluster
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Berlin", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "member"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def is_json_prefix(text: str) -> bool:
    """Whether `text` begins some JSON value (xgrammar's own JSON grammar, independent of ours)."""
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"])).compile_builtin_json_grammar()
    return xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True).accept_string(text)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    model = write_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-structured",
                             {**TINY_CONFIG, "max_position_embeddings": 1024}, seed=29)
    logs = tmp_path_factory.mktemp("structured-logs")
    with LocalCluster(model=Path(model), prefill=1, decode=1, log_dir=logs,
                      extra_worker_args=["--kv-cache-gb", "0.05"]) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_thirty_sampled_answers_to_a_json_schema_all_validate(client: openai.OpenAI) -> None:
    model = _model(client)
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(seed: int) -> tuple[str, str]:
        reply = client.chat.completions.create(model=model, messages=ASK, response_format=response_format,
                                               max_tokens=200, temperature=1.0, seed=seed,
                                               extra_body=NO_THINKING)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(30)))
    for text, finish in answers:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in answers}) > 10  # sampled: different people, each valid


def test_greedy_and_streamed_answers_validate_too(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    greedy = client.chat.completions.create(model=_model(client), messages=ASK, response_format=response_format,
                                            max_tokens=200, temperature=0, extra_body=NO_THINKING)
    jsonschema.validate(json.loads(greedy.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model=_model(client), messages=ASK, response_format=response_format,
                                            max_tokens=200, temperature=0, stream=True, extra_body=NO_THINKING)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == greedy.choices[0].message.content


def test_json_object_regex_and_choice_in_openai_and_vllm_spellings(client: openai.OpenAI) -> None:
    model = _model(client)

    def reply(response_format: dict | None = None, extra_body: dict | None = None) -> tuple[str, str]:
        more = {"response_format": response_format} if response_format else {}
        choice = client.chat.completions.create(model=model, messages=ASK, max_tokens=120, temperature=1.0, seed=7,
                                                extra_body={**NO_THINKING, **(extra_body or {})}, **more).choices[0]
        return choice.message.content or "", choice.finish_reason

    def answer(response_format: dict | None = None, extra_body: dict | None = None) -> str:
        return reply(response_format, extra_body)[0]

    # Any JSON object is unbounded: a random model closes a string only when it happens to draw a quote, so an
    # answer may reach max_tokens inside one. Then it must be the start of an object that the grammar could finish.
    for spelling in ({"response_format": {"type": "json_object"}},
                     {"extra_body": {"structured_outputs": {"json_object": True}}}):
        text, finish = reply(**spelling)
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length" and text.startswith("{") and is_json_prefix(text), text
    jsonschema.validate(json.loads(answer(extra_body={"guided_json": PERSON})), PERSON)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", answer(extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{4}"}))
    assert answer(extra_body={"guided_choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    assert answer(extra_body={"structured_outputs": {"choice": ["red", "blue"]}}) in ("red", "blue")
    legacy = client.completions.create(model=model, prompt="Colour:", max_tokens=20, temperature=1.0, seed=3,
                                       extra_body={"guided_choice": ["red", "blue"]})
    assert legacy.choices[0].text in ("red", "blue")


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "structured"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "structured"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 5}, "min_tokens"),
])
def test_a_constraint_that_cannot_be_used_is_a_400_naming_it(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=8, extra_body=extra)
    assert refused.value.body["param"] == param, refused.value.body


def test_grpc_generate_takes_the_constraint_in_its_sampling(cluster: LocalCluster) -> None:
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=11, max_tokens=200,
                                         structured=common_pb2.StructuredOutput(json_schema=json.dumps(PERSON)))
    request = router_pb2.GenerateRequest(prompt="Person:", sampling=sampling)
    with grpc.insecure_channel(f"127.0.0.1:{cluster.router_port}") as channel:
        replies = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60))
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads("".join(r.text for r in replies)), PERSON)


def test_a_hostile_grammar_is_a_400_naming_its_limit_and_the_next_request_is_served(client: openai.OpenAI) -> None:
    model = _model(client)
    hostile = [
        ({"guided_choice": [f"w{i:05d}" * 7 for i in range(20_000)]}, "--max-grammar-choices"),
        ({"guided_json": {"enum": [f"value-{i}" for i in range(50_000)]}}, "--max-grammar-chars"),
        ({"guided_regex": r"[^\s\S]"}, "matches nothing"),
    ]
    for extra, words in hostile:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=8,
                                           extra_body={**NO_THINKING, **extra}, timeout=15)
        assert words in refused.value.body["message"], refused.value.body
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=20, temperature=1.0, seed=5,
                                           extra_body={**NO_THINKING, "guided_choice": ["yes", "no"]})
    assert reply.choices[0].message.content in ("yes", "no")


def _streamed_token_times(client: openai.OpenAI, max_tokens: int) -> list[float]:
    """When each chunk of a free (unconstrained) completion stream arrived, from the request's start; checks that
    the stream brought all `max_tokens` tokens (a loaded server may send two in one chunk)."""
    times, tokens = [time.monotonic()], 0
    stream = client.completions.create(model=_model(client), prompt="Once upon a time", max_tokens=max_tokens,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic())
    assert tokens == max_tokens, tokens
    return times


def _worst_gap(times: list[float]) -> float:
    return max(b - a for a, b in itertools.pairwise(times))


def test_grammars_that_get_slower_every_step_are_refused_naming_the_mask_budget_and_a_victim_streams_on(
        client: openai.OpenAI) -> None:
    # Each step of this regex's mask costs more than the last (a few ms, then seconds: the issue's
    # "(\w+\s?){1,5000}" cut to a size that compiles in well under a second): past 10 times the
    # --grammar-mask-budget-ms a step stops waiting for it and the request is refused.
    hostile = {**NO_THINKING, "guided_regex": r"(\w+\s?){1,300}"}
    # Each worker builds its vocabulary's grammar tables (seconds) on its first constrained request: not timed here.
    client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=4,
                                   extra_body={**NO_THINKING, "guided_choice": ["yes", "no"]})
    baseline = _worst_gap(_streamed_token_times(client, 60))  # what this machine's load already costs the stream

    def refused(_: int) -> tuple[float, dict]:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=40, temperature=1.0,
                                           extra_body=hostile, timeout=30)
        return time.monotonic() - started, error.value.body

    with ThreadPoolExecutor(5) as pool:
        victim = pool.submit(_streamed_token_times, client, 60)
        time.sleep(0.3)
        answers = list(pool.map(refused, range(4)))  # a flood: four at once beside the victim
        times = victim.result()
    for took, body in answers:
        assert "--grammar-mask-budget-ms" in body["message"] and took < 15, (took, body)
    assert len(times) >= 2  # the victim's 60 tokens all came (_streamed_token_times), in one chunk or more
    assert _worst_gap(times) < 3.0 + 3 * baseline, (_worst_gap(times), baseline)
