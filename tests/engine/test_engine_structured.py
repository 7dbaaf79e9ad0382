"""Structured output in the engine: constrained and free requests share steps, and a resumed request keeps its
grammar's state (the tokens it already has are replayed into it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.engine.structured import StructuredOutput, StructuredOutputError
from qwenserve.tokenizer import Tokenizer
from tests.support.checkpoints import tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-grammar", seed=31, max_position_embeddings=512)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return Tokenizer.from_dir(model)


def _text(tokenizer: Tokenizer, engine: LLMEngine, ids: list[int]) -> str:
    return tokenizer.decode([t for t in ids if t not in engine.eos_token_ids])


def test_constrained_and_free_rows_share_a_step_and_free_ones_are_unchanged(engine: LLMEngine,
                                                                            tokenizer: Tokenizer) -> None:
    prompts = [tokenizer.encode(f"Item {i}:") for i in range(6)]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = engine.generate_sync(prompts[:3], free)
    mixed = engine.generate_sync(prompts, [free] * 3 + [SamplingParams(temperature=t, seed=i, max_tokens=60,
                                                                       structured=JSON)
                                                        for i, t in enumerate((0.0, 1.0, 1.0))])
    assert mixed[:3] == alone  # the masks touched only their own rows
    for ids in mixed[3:]:
        assert ids[-1] in engine.eos_token_ids  # the grammar ended the answer, not max_tokens
        jsonschema.validate(json.loads(_text(tokenizer, engine, ids)), SCHEMA)


def test_a_resumed_request_continues_inside_its_grammar(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Count:")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=60, structured=JSON)
    (whole,) = engine.generate_sync([prompt], params)
    # As after a failover: the first tokens are given, the engine goes on from there.
    (rest,) = engine.generate_sync([prompt], params, resume_token_ids=whole[:3])
    assert whole[:3] + rest == whole  # seeded by position: the same answer, its grammar state replayed

    with pytest.raises(StructuredOutputError, match="do not fit the grammar"):
        engine.generate_sync([prompt], params, resume_token_ids=tokenizer.encode("not json"))


def test_choice_and_regex_constraints(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Answer:")
    choice = StructuredOutput("choice", json.dumps(["alpha", "beta gamma"]))
    regex = StructuredOutput("regex", r"[a-c]{2,4}![0-9]")
    outputs = engine.generate_sync([prompt] * 6, [SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                                                                 structured=choice if i < 3 else regex)
                                                  for i in range(6)])
    texts = [_text(tokenizer, engine, ids) for ids in outputs]
    assert all(t in ("alpha", "beta gamma") for t in texts[:3]), texts
    assert all(re.fullmatch(r"[a-c]{2,4}![0-9]", t) for t in texts[3:]), texts


def test_what_cannot_be_constrained_is_refused() -> None:
    with pytest.raises(StructuredOutputError, match="kind must be one of"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(InvalidSamplingParams, match="min_tokens"):
        SamplingParams(min_tokens=3, structured=JSON)
    with pytest.raises(InvalidSamplingParams, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=JSON)
