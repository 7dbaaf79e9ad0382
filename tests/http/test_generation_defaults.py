"""The checkpoint's generation_config.json sets the sampling a request leaves out (the request's own wins); echo
repeats the prompt before a legacy completion (greedy by those defaults, so the two answers can be compared)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from qwenserve.default_model import GENERATION_CONFIG
from qwenserve.launcher import LocalCluster
from qwenserve.router.generation_defaults import (
    GenerationConfigError,
    load_generation_defaults,
    with_defaults,
)
from qwenserve.v1 import common_pb2
from tests.support.checkpoints import tiny_checkpoint

ASK = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose own defaults are greedy and 6 tokens long (as a checkpoint's file can say)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-greedy", seed=21,
                           generation_config={**GENERATION_CONFIG, "temperature": 0.0, "top_k": 20,
                                              "max_new_tokens": 6})


@pytest.fixture(scope="module")
def client(greedy_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    logs = tmp_path_factory.mktemp("defaults-logs")
    with LocalCluster(model=greedy_model, prefill=0, decode=1, log_dir=logs,
                      extra_worker_args=["--kv-cache-gb", "0.05"]) as running:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{running.http_port}/v1", api_key="none", max_retries=0,
                            timeout=120)


def _ask(client: openai.OpenAI, **settings: object) -> tuple[str, int]:
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK,
                                           extra_body={"ignore_eos": True}, **settings)
    return reply.choices[0].message.content or "", reply.usage.completion_tokens


def test_a_request_without_settings_samples_as_the_model_says(client: openai.OpenAI) -> None:
    answers = {_ask(client, seed=seed) for seed in (1, 2, 3)}
    assert len(answers) == 1, answers  # temperature 0 from the file: greedy whatever the seed
    ((_, tokens),) = answers
    assert tokens == 6  # max_new_tokens from the file


def test_the_requests_own_settings_win(client: openai.OpenAI) -> None:
    sampled = {_ask(client, seed=seed, temperature=1.0, top_p=1.0, max_tokens=12) for seed in (1, 2, 3)}
    assert len(sampled) > 1 and all(tokens == 12 for _, tokens in sampled), sampled


def test_generation_config_flag_reads_auto_a_folder_or_nothing(greedy_model: Path, tmp_path: Path) -> None:
    assert load_generation_defaults("auto", greedy_model) == {"temperature": 0.0, "top_k": 20, "max_tokens": 6}
    assert load_generation_defaults(str(greedy_model), None)["top_k"] == 20
    assert load_generation_defaults("vllm", greedy_model) == load_generation_defaults("none", greedy_model) == {}
    assert load_generation_defaults("auto", tmp_path) == {}  # a checkpoint without the file
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(GenerationConfigError, match="temperature must be a number"):
        load_generation_defaults("auto", tmp_path)


def test_defaults_fill_only_what_is_unset_and_max_tokens_fits_the_context() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 4096}
    given = common_pb2.SamplingParams(temperature=1.0, top_k=0)
    filled = with_defaults(given, defaults, room=100)
    assert (filled.temperature, filled.top_k, filled.max_tokens) == (1.0, 0, 100)
    assert not given.HasField("max_tokens")  # a copy


def test_echo_starts_each_answer_with_its_prompt(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
    echoed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text  # greedy by the model's defaults
    streamed = client.completions.create(model=model, prompt=[[9707, 1052]], max_tokens=5, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith("Hello there")


def test_prompt_logprobs_come_from_the_decode_worker_that_computed_the_prompt(client: openai.OpenAI) -> None:
    # prefill=0: the decode worker computes the prompt itself (the handoff path is in test_openai_cluster.py).
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=[9707, 1052, 374, 264], max_tokens=2,
                                      extra_body={"prompt_logprobs": 2})
    positions = reply.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == 4
    for token, entries in zip([1052, 374, 264], positions[1:], strict=True):
        assert entries[str(token)]["logprob"] <= 0 and entries[str(token)]["rank"] >= 1
        assert len(entries) in (2, 3)  # the token and the two most likely (it may be one of them)
        assert all(e["rank"] in (1, 2) for t, e in entries.items() if t != str(token))


def test_echo_with_logprobs_leads_with_the_prompts_tokens(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    for stream in (False, True):
        reply = client.completions.create(model=model, prompt=[9707, 1052, 374], max_tokens=3, echo=True, logprobs=2,
                                          stream=stream)
        chunks = list(reply) if stream else [reply]
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        values = [v for c in chunks if c.choices and c.choices[0].logprobs
                  for v in c.choices[0].logprobs.token_logprobs]
        assert len(tokens) == 6 and values[0] is None and all(v <= 0 for v in values[1:]), (tokens, values)
        assert "".join(tokens) == "".join(c.choices[0].text for c in chunks if c.choices)
