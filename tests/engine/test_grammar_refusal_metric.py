"""Operators see grammar refusals: each request a structured-output bound ends counts once in
qwenserve_grammar_refusals_total, labelled with the flag that sets the bound it hit."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.structured import GrammarLimitExceeded, StructuredOutput
from qwenserve.telemetry.metrics import EngineMetrics
from tests.support.checkpoints import tiny_checkpoint

METRIC = "qwenserve_grammar_refusals_total"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-grammar-refusals", seed=41,
                           max_position_embeddings=512)


def _refusals(registry: CollectorRegistry, limit: str) -> float:
    return registry.get_sample_value(METRIC, {"limit": limit}) or 0.0


def _counted(engine: LLMEngine) -> CollectorRegistry:
    registry = CollectorRegistry()
    engine.on_grammar_refusal(EngineMetrics(registry).record_grammar_refusal)
    return registry


def test_a_too_long_choice_list_counts_once_as_max_grammar_choices(model: Path) -> None:
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1,
                                                           max_grammar_choices=10))
    metrics = _counted(engine)
    choices = StructuredOutput("choice", json.dumps([f"answer {i}" for i in range(11)]))

    async def generate() -> None:
        async for _ in engine.generate("too-many", [1, 2, 3], SamplingParams(max_tokens=4, structured=choices)):
            pass

    try:
        with pytest.raises(GrammarLimitExceeded) as refused:
            asyncio.run(generate())
        assert refused.value.limit == "--max-grammar-choices"
        with pytest.raises(GrammarLimitExceeded):  # the synchronous path compiles in the engine's intake
            engine.generate_sync([[1, 2, 3]], SamplingParams(max_tokens=4, structured=choices))
    finally:
        engine.shutdown()
    assert _refusals(metrics, "max_grammar_choices") == 2
    assert _refusals(metrics, "grammar_mask_budget_ms") == 0


def test_a_mask_budget_overrun_counts_once_as_grammar_mask_budget_ms(model: Path) -> None:
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1,
                                                           grammar_mask_budget_ms=0.0001))
    metrics = _counted(engine)
    try:
        free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput("regex", r"[a-z ]+"))
        outputs = engine.generate_sync_outputs([[1, 2, 3], [1, 2, 3]], [free, constrained])
    finally:
        engine.shutdown()
    assert outputs[1][-1].finish_reason == "error" and "--grammar-mask-budget-ms" in (outputs[1][-1].error or "")
    assert outputs[0][-1].finish_reason == "length"
    assert _refusals(metrics, "grammar_mask_budget_ms") == 1
    assert _refusals(metrics, "max_grammar_choices") == 0


def test_an_unknown_flag_is_folded_into_other() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    metrics.record_grammar_refusal("--grammar-compile-memory-mb")
    metrics.record_grammar_refusal("--something-new")
    assert _refusals(registry, "grammar_compile_memory_mb") == 1
    assert _refusals(registry, "other") == 1
