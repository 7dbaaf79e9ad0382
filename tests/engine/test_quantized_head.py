"""--quantize-lm-head int8 (models/quantized_head.py): the head's codes span each group and keep 0 exact, and an
engine holding its head (and tied embedding table) as those codes gives transformers' greedy tokens on a checkpoint
whose head is their dequantization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve.cpu_kernels import loader
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models.quantized_head import quantize_rows
from tests.support.checkpoints import tiny_checkpoint
from tests.support.engine_checkpoints import load_reference, random_prompts, reference_greedy

needs_kernels = pytest.mark.skipif(loader.load() is None, reason="the C kernels do not build here")


def test_codes_span_each_group_and_dequantize_within_half_a_step() -> None:
    w = torch.tensor([[-1.0, 0.0, 0.5, 3.0, 2.0, 1.0],  # groups of 4: [-1, 3] and [1, 2] (0 is kept in range)
                      [0.25, 0.25, 0.25, 0.25, -0.5, -0.5]]).repeat(8, 1)  # 16 rows: one panel
    q = quantize_rows(w, bits=8, group=4)
    assert q.bits == 8 and q.group_size == 4 and q.shape == (16, 6)
    scales = q.scales[0, :, :2].T.float()  # [rows 0 and 1, groups]: the span / 255, rounded up to an fp16
    expected = torch.tensor([[4.0 / 255, 2.0 / 255], [0.25 / 255, 0.5 / 255]])
    assert bool((scales >= expected).all()) and torch.allclose(scales, expected, rtol=2**-10, atol=0)
    back = q.dequantize()
    assert torch.all((back - w).abs() <= scales.repeat(8, 1).repeat_interleave(4, dim=1)[:, :6] / 2 + 1e-7)
    assert back[0, 1] == 0.0 and bool((back[1, :4] > 0).all())
    assert q.codes[0, 0, 0] == 0 and q.codes[0, 3, 0] == 255  # the group's minimum and maximum: the codes' ends


def test_constant_and_zero_groups_are_exact() -> None:
    w = torch.zeros(16, 8)
    w[3] = 0.75
    back = quantize_rows(w, group=4).dequantize()
    assert torch.equal(back[:3], w[:3]) and torch.allclose(back[3], w[3], atol=0.75 / 255 / 2)


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_greedy_tokens_equal_transformers_on_the_dequantized_head(tied: bool, tmp_path: Path) -> None:
    folder = tiny_checkpoint(tmp_path / "model", seed=21, tie_word_embeddings=tied)
    tensors = load_file(folder / "model.safetensors")
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    reference = tmp_path / "reference"
    reference.mkdir()
    for path in folder.iterdir():
        if path.name != "model.safetensors":
            (reference / path.name).write_bytes(path.read_bytes())
    head = tensors[head_name]
    tensors[head_name] = quantize_rows(head).dequantize().to(head.dtype)
    assert not torch.equal(tensors[head_name], head)
    save_file(tensors, reference / "model.safetensors")

    prompts = random_prompts(3, 5, 30, seed=4)
    hf = load_reference(reference)
    expected = [reference_greedy(hf, p, 8)[0] for p in prompts]
    engine = LLMEngine.from_pretrained(folder, EngineConfig(dtype="float32", num_kv_blocks=32, block_size=8,
                                                            num_threads=2, quantize_lm_head="int8"))
    try:
        model = engine.runner.model
        assert "+head_w8" in model.ops.name and "lm_head=w8a16" in engine.precision.name
        assert torch.equal(model.lm_head.dequantize(), tensors[head_name])
        ids = torch.tensor([0, 17, 151_000])
        table = model.lm_head if tied else model.embed_tokens
        assert torch.equal(model.ops.embedding(table, ids), load_file(reference / "model.safetensors")[
            "model.embed_tokens.weight"][ids])
        assert engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) == expected
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tied", [True, False])
def test_kv_of_embeddings_read_from_codes_is_not_the_plain_models(tied: bool, tmp_path: Path) -> None:
    from qwenserve.engine.weights import embedded_by_codes
    from qwenserve.models import ModelConfig

    cfg = ModelConfig.from_folder(tiny_checkpoint(tmp_path, tie_word_embeddings=tied))
    assert embedded_by_codes("f" * 32, cfg, None) == "f" * 32
    assert (embedded_by_codes("f" * 32, cfg, "w8a16") != "f" * 32) is tied  # an untied head changes no KV


@needs_kernels
def test_many_rows_of_a_bf16_models_head_go_to_amx_where_it_runs(tmp_path: Path) -> None:
    from qwenserve.cpu_kernels import builder
    from qwenserve.engine.kernels import select_kernels
    from qwenserve.models import ModelConfig

    cfg = ModelConfig.from_folder(tiny_checkpoint(tmp_path))
    cpu = torch.device("cpu")
    bf16 = select_kernels(EngineConfig(dtype="bfloat16", quantize_lm_head="int8"), cpu, cfg)
    assert "+head_w8" in bf16.ops.name and bf16.precision.lm_head == "w8a16"
    assert ("+head_w8+amx>=8" in bf16.ops.name) == ("amx_bf16" in builder.cpu_flags())
    fp32 = select_kernels(EngineConfig(dtype="float32", quantize_lm_head="int8"), cpu, cfg)
    assert "+head_w8" in fp32.ops.name and "amx" not in fp32.ops.name  # fp32 never rounds x
    plain = select_kernels(EngineConfig(dtype="bfloat16"), cpu, cfg)
    assert "head_w8" not in plain.ops.name and plain.precision.lm_head is None
