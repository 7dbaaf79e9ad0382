"""Per-stage precision (the field report's bf16 prefill in front of a W4A16 decode): a prefill engine on a model's
plain checkpoint computes the prompt in bf16 and hands its KV to a decode engine on the same model's AWQ checkpoint
(4-bit codes multiplied by the W4A16 kernels where they load), which continues it when started with
`--kv-from-other-weights` and refuses it otherwise. KV of another architecture is refused either way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.kv_handoff import KVImport
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.kv_layout import KVLayout, KVLayoutMismatch
from qwenserve.protocol import kv_layout_from_proto, kv_layout_to_proto
from tests.support import quantized_checkpoints as qc
from tests.support.checkpoints import tiny_checkpoint
from tests.support.engine_checkpoints import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The plain (fp32) checkpoint, its AWQ copy, and a checkpoint of another shape."""
    root = tmp_path_factory.mktemp("per-stage")
    plain = tiny_checkpoint(root / "plain", seed=5, intermediate_size=160)
    qc.quantize_checkpoint(plain, root / "awq", "awq", group_size=32)
    return {"plain": plain, "awq": root / "awq", "wider": tiny_checkpoint(root / "wider", seed=5,
                                                                         intermediate_size=192)}


@pytest.fixture
def engine(checkpoints: dict[str, Path]) -> Iterator[Callable[..., LLMEngine]]:
    engines: list[LLMEngine] = []

    def make(name: str, **overrides: object) -> LLMEngine:
        settings = dict(num_kv_blocks=64, block_size=8, num_threads=2, dtype="bfloat16")
        engines.append(LLMEngine.from_pretrained(checkpoints[name], EngineConfig(**{**settings, **overrides})))
        return engines[-1]

    yield make
    try:
        for made in engines:
            assert made.wait_until_idle(timeout=30)
            assert made.stats().kv_blocks_used == 0, "KV blocks leaked"
    finally:
        for made in engines:
            made.shutdown()


def _prefill(prefill: LLMEngine, prompt: list[int]) -> tuple[int, KVImport]:
    """The first token and the prompt's KV, as a prefill worker hands them off."""
    kept: list[torch.Tensor] = []

    def sink(layout: KVLayout, num_tokens: int) -> torch.Tensor:
        kept.append(torch.empty(layout.token_shape(num_tokens), dtype=layout.torch_dtype()))
        return kept[-1]

    outs = prefill.generate_sync_outputs([prompt], GREEDY, kv_export=sink)[0]
    assert outs[-1].finish_reason == "export"
    (first,) = [t for o in outs for t in o.new_token_ids]
    return first, KVImport(kept[0], prefill.kv_layout())


def test_a_models_checkpoints_share_the_architecture_fingerprint_and_not_the_weights_one(engine) -> None:
    plain, awq, wider = (engine(name).kv_layout() for name in ("plain", "awq", "wider"))
    assert plain.architecture_fingerprint == awq.architecture_fingerprint != ""
    assert plain.model_fingerprint != awq.model_fingerprint
    assert wider.architecture_fingerprint != plain.architecture_fingerprint
    # The fingerprint travels with a handle; the receiving side's policy does not.
    policy = KVLayout(**{**{f: getattr(awq, f) for f in KVLayout.__dataclass_fields__}, "accepts_other_weights": True})
    sent = kv_layout_from_proto(kv_layout_to_proto(policy))
    assert sent.architecture_fingerprint == awq.architecture_fingerprint and not sent.accepts_other_weights


def test_a_w4a16_decode_continues_a_bf16_prefills_kv_only_when_told_to(engine) -> None:
    prefill = engine("plain")
    strict = engine("awq")
    mixed = engine("awq", kv_from_other_weights=True)
    assert mixed.precision.quantized in ("w4a16", None)  # W4A16 where the C kernels load
    prompt = random_prompts(1, 29, 29, seed=4)[0]
    first, handed = _prefill(prefill, prompt)

    with pytest.raises(KVLayoutMismatch, match="model_fingerprint.*--kv-from-other-weights"):
        strict.generate_sync([prompt], GREEDY, resume_token_ids=[first], kv_import=handed)

    rest = mixed.generate_sync([prompt], GREEDY, resume_token_ids=[first], kv_import=handed)[0]
    assert len(rest) == GREEDY.max_tokens - 1
    # The handed KV is what the decode engine attends over: the same start over KV of zeros continues otherwise.
    zeros = KVImport(torch.zeros_like(handed.kv), handed.layout)
    assert mixed.generate_sync([prompt], GREEDY, resume_token_ids=[first], kv_import=zeros)[0] != rest


def test_kv_of_another_architecture_is_refused_even_when_other_weights_are_accepted(engine) -> None:
    other = engine("wider")
    mixed = engine("awq", kv_from_other_weights=True)
    prompt = random_prompts(1, 17, 17, seed=6)[0]
    first, handed = _prefill(other, prompt)
    with pytest.raises(KVLayoutMismatch, match="model_fingerprint") as refused:
        mixed.generate_sync([prompt], GREEDY, resume_token_ids=[first], kv_import=handed)
    assert "--kv-from-other-weights" not in str(refused.value)
