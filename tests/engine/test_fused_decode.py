"""A bf16 model's decode steps through every layer in one C call (cpu_kernels/decode_stack.c, models/fused_decode.py):
the same tokens and the same logprobs, bit for bit, as the layer-by-layer path, for Qwen3 (q/k norms, GQA), Qwen2
(q/k/v bias) and weights kept as 4- and 8-bit codes (GPTQ's act order included), in batches whose rows come and go;
the steps it does not take (prefill chunks, MoE and hybrid models) go layer by layer; bad slots are refused before
anything is written."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from qwenserve.cpu_kernels import linear_probe
from qwenserve.cpu_kernels.decode_stack import DecodeStack
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models.fused_decode import decode_stack_of
from qwenserve.models.quantized_linear import AMX_MIN_ROWS
from tests.engine.test_precision import probe_result
from tests.support import quantized_checkpoints as qc
from tests.support.checkpoints import tiny_checkpoint
from tests.support.engine_checkpoints import SPECS, random_prompts, write_checkpoint

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the kernels cannot be built here")

BF16 = torch.bfloat16
SAMPLED = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """folders(name) -> a tiny checkpoint: an engine_checkpoints SPEC, or 'awq' / 'gptq4_act_order' / 'gptq8' (4- and
    8-bit codes of one plain checkpoint)."""
    made: dict[str, Path] = {}
    quantized = {"awq": ("awq", dict(group_size=32)),
                 "gptq4_act_order": ("gptq", dict(bits=4, group_size=32, desc_act=True)),
                 "gptq8": ("gptq", dict(bits=8, group_size=32))}

    def get(name: str) -> Path:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            if name in quantized:
                method, options = quantized[name]
                base = tiny_checkpoint(root / "plain", seed=11, intermediate_size=160)
                qc.quantize_checkpoint(base, root / "quantized", method, **options)
                made[name] = root / "quantized"
            else:
                write_checkpoint(root, SPECS[name])
                made[name] = root
        return made[name]

    return get


@pytest.fixture
def engines() -> Iterator[Callable[..., LLMEngine]]:
    made: list[LLMEngine] = []

    def make(folder: Path, **overrides: object) -> LLMEngine:
        settings = dict(dtype="bfloat16", num_kv_blocks=96, block_size=8, max_num_batched_tokens=64, num_threads=2)
        engine = LLMEngine.from_pretrained(folder, EngineConfig(**{**settings, **overrides}))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        assert engine.wait_until_idle(timeout=30) and engine.stats().kv_blocks_used == 0
        engine.shutdown()


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every fused call made during the test."""
    calls: list[int] = []
    original = CpuKernels.decode_stack_bf16

    def counted(self: CpuKernels, stack: DecodeStack, x: torch.Tensor, *args: torch.Tensor) -> None:
        calls.append(x.shape[0])
        original(self, stack, x, *args)

    monkeypatch.setattr(CpuKernels, "decode_stack_bf16", counted)
    return calls


def outputs(engine: LLMEngine, prompts: list[list[int]]) -> list[list[tuple]]:
    """Each request's tokens with their logprobs and top alternatives, exactly as floats; request i stops after
    12 - 2i tokens, so the decode batch shrinks to one row."""
    params = [dataclasses.replace(SAMPLED, max_tokens=SAMPLED.max_tokens - 2 * i) for i in range(len(prompts))]
    results = engine.generate_sync_outputs(prompts, params)
    return [[(lp.token_id, lp.logprob, lp.top)
             for out in outs for lp in (out.logprobs or [])] for outs in results]


@pytest.mark.parametrize("name", ["qwen3_gqa4", "qwen2_bias", "awq", "gptq4_act_order", "gptq8"])
def test_fused_decode_steps_equal_the_layer_by_layer_path_bit_for_bit(
        name: str, folders: Callable[[str], Path], engines: Callable[..., LLMEngine], fused_calls: list[int]) -> None:
    # Prompts of different lengths and max_tokens reached at different steps: the decode batch grows and shrinks,
    # and prefill chunks share steps with decode rows (those steps go layer by layer).
    prompts = random_prompts(5, 3, 40, seed=len(name))
    layered = outputs(engines(folders(name), fused_decode=False), prompts)
    assert not fused_calls
    fused_engine = engines(folders(name))
    assert "+fused_decode<" in fused_engine.kernels.ops.name
    fused = outputs(fused_engine, prompts)
    assert fused == layered
    assert [len(tokens) for tokens in fused] == [12, 10, 8, 6, 4]
    assert fused_calls and max(fused_calls) > 1 and min(fused_calls) == 1, fused_calls
    assert isinstance(decode_stack_of(fused_engine.runner.model), DecodeStack)


def test_a_batch_of_codes_from_amx_rows_up_runs_fused_and_equals_the_layer_by_layer_path(
        folders: Callable[[str], Path], engines: Callable[..., LLMEngine], fused_calls: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # From AMX_MIN_ROWS rows, layer by layer multiplies 4-bit codes on AMX tiles; the one call does too (where the
    # CPU has AMX: its x rounding differs from the few-row kernel's, so bit-equality shows which ran). One probe
    # result for both engines, so their LM heads multiply alike.
    monkeypatch.setattr(linear_probe, "measure", lambda *args: probe_result(2.0, 4, amx_time=0.5))
    rows = AMX_MIN_ROWS["w4a16"] + 2
    prompts = random_prompts(rows, 3, 20, seed=7)
    params = dataclasses.replace(SAMPLED, max_tokens=5)
    layered = engines(folders("awq"), fused_decode=False).generate_sync_outputs(prompts, params)
    assert not fused_calls
    fused_engine = engines(folders("awq"))
    fused = fused_engine.generate_sync_outputs(prompts, params)
    tokens = [[(lp.token_id, lp.logprob, lp.top) for out in outs for lp in (out.logprobs or [])] for outs in fused]
    assert tokens == [[(lp.token_id, lp.logprob, lp.top) for out in outs for lp in (out.logprobs or [])]
                      for outs in layered]
    assert max(fused_calls) >= AMX_MIN_ROWS["w4a16"], fused_calls


def test_bf16_steps_from_the_probes_rows_run_fused_on_our_amx_tiles(
        folders: Callable[[str], Path], engines: Callable[..., LLMEngine], fused_calls: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a CPU where the probe found our AMX product the fastest from 4 rows: layer by layer multiplies those
    # steps on its tiles, and the one call now runs them too, equal bit for bit. (Which product ran inside is not
    # visible at this size: the panels' and the tiles' fp32 sums differ only in their order, below bf16's rounding.)
    monkeypatch.setattr(linear_probe, "measure", lambda *args: probe_result(2.0, 4, amx_time=0.5))
    prompts = random_prompts(6, 3, 20, seed=3)
    params = dataclasses.replace(SAMPLED, max_tokens=5)
    layered = engines(folders("qwen3_gqa4"), fused_decode=False).generate_sync_outputs(prompts, params)
    assert not fused_calls
    fused_engine = engines(folders("qwen3_gqa4"))
    assert fused_engine.precision.dense_product == "amx" and fused_engine.precision.dense_rows == 4
    assert "+fused_decode<256" in fused_engine.kernels.ops.name
    fused = fused_engine.generate_sync_outputs(prompts, params)
    assert [[(lp.token_id, lp.logprob, lp.top) for out in outs for lp in (out.logprobs or [])] for outs in fused] == \
        [[(lp.token_id, lp.logprob, lp.top) for out in outs for lp in (out.logprobs or [])] for outs in layered]
    assert max(fused_calls) >= 4, fused_calls


def test_a_single_stream_runs_every_decode_step_fused(folders: Callable[[str], Path],
                                                       engines: Callable[..., LLMEngine], fused_calls: list[int]) -> None:
    engine = engines(folders("qwen3_gqa4"))
    engine.generate_sync([list(range(5, 25))], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    assert fused_calls == [1] * 8  # the first token comes from the prefill step


@pytest.mark.parametrize(("name", "overrides"), [("qwen3_moe", {}), ("qwen3_next", {}),
                                                 ("qwen3_gqa4", {"dtype": "float32"})])
def test_models_and_precisions_it_does_not_run_go_layer_by_layer(
        name: str, overrides: dict, folders: Callable[[str], Path], engines: Callable[..., LLMEngine],
        fused_calls: list[int]) -> None:
    engine = engines(folders(name), **overrides)
    assert len(engine.generate_sync([list(range(3, 12))], SAMPLED)[0]) == SAMPLED.max_tokens
    assert not fused_calls
    assert decode_stack_of(engine.runner.model) is None or "+fused_decode<" not in engine.kernels.ops.name


def test_a_slot_or_block_outside_the_cache_is_refused_before_anything_is_written(
        folders: Callable[[str], Path], engines: Callable[..., LLMEngine]) -> None:
    engine = engines(folders("qwen3_gqa4"))
    engine.generate_sync([list(range(3, 12))], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert engine.wait_until_idle(timeout=30)
    model, cache = engine.runner.model, engine.runner.kv_cache
    stack = decode_stack_of(model)
    assert stack is not None
    kernels = engine.kernels.cpu
    hidden, rot = model.cfg.hidden_size, model.rotary.cos.shape[-1]
    x = torch.randn(2, hidden).to(BF16)
    cos = torch.ones(2, rot, dtype=BF16)
    num_blocks, block_size = cache.shape[2], cache.shape[3]
    table = torch.zeros(2, 1, dtype=torch.long)
    lens = torch.ones(2, dtype=torch.long)
    before, x_before = cache.clone(), x.clone()
    for slots, blocks, context in ((torch.tensor([0, num_blocks * block_size]), table, lens),
                                   (torch.tensor([0, 1]), torch.tensor([[0], [num_blocks]]), lens),
                                   (torch.tensor([0, 1]), table, torch.tensor([1, block_size + 1]))):
        with pytest.raises(IndexError, match="outside the cache"):
            kernels.decode_stack_bf16(stack, x, cos, cos, slots, cache, blocks, context)
        assert torch.equal(cache, before) and torch.equal(x, x_before)
    with pytest.raises(ValueError, match="bf16"):
        kernels.decode_stack_bf16(stack, x.float(), cos, cos, torch.tensor([0, 1]), cache, table, lens)
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.decode_stack_bf16(stack, x, cos[:1], cos[:1], torch.tensor([0, 1]), cache, table, lens)
