"""Quantized checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized, block FP8) load dequantized to the serving
dtype: hand-packed words give the stated values, every unpacked weight equals the reference dequantization of the
integers the checkpoint was written from, greedy tokens equal transformers' on those dequantized weights, and what
is not supported is refused in one line that names it."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import CheckpointError
from qwenserve.engine.quantization import awq, compressed_tensors, fp8, gptq, quantization_of
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.weights import load_checkpoint
from qwenserve.models import ModelConfig, model_class
from tests.support import quantized_checkpoints as qc
from tests.support.checkpoints import tiny_checkpoint
from tests.support.engine_checkpoints import load_reference, random_prompts, reference_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# (method, options) per checkpoint the model-level tests write; intermediate_size 160 leaves GPTQ's group of 64 and
# FP8's 128x128 blocks partial at the MLP's edges.
CHECKPOINTS = {
    "awq_g32": ("awq", dict(group_size=32)),
    "gptq4_g64_desc_act": ("gptq", dict(bits=4, group_size=64, desc_act=True)),
    "gptq8_g32_asym_v2": ("gptq", dict(bits=8, group_size=32, sym=False, checkpoint_format="gptq_v2")),
    "gptq4_one_group": ("gptq", dict(bits=4, group_size=None)),
    "pack_quantized_int4_g32": ("compressed-tensors", dict(bits=4, group_size=32)),
    "pack_quantized_int8_channel_asym": ("compressed-tensors", dict(bits=8, group_size=None, symmetric=False)),
    "fp8_128x128": ("fp8", dict(block=(128, 128))),
}
# One per format through the engine (the others differ only in what the loader-level test checks exactly).
GREEDY_CHECKPOINTS = ["awq_g32", "gptq4_g64_desc_act", "pack_quantized_int4_g32", "fp8_128x128"]


def words(*values: int) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 tensor a checkpoint stores."""
    return qc.as_int32(torch.tensor(values, dtype=torch.int64))


# --- (a) hand-checked vectors -------------------------------------------------------------------------------------


def test_awq_words_unpack_in_awq_interleaved_order():
    # One input row, eight outputs: the word's values 0..7 (lowest nibble first) belong to columns 0,2,4,6,1,3,5,7.
    parts = {
        "qweight": words(0x76543210).reshape(1, 1),
        "qzeros": words(0x11111111).reshape(1, 1),  # zero point 1 for every column
        "scales": torch.full((1, 8), 0.5, dtype=torch.float16),
    }
    w = awq.AwqLayout(group_size=1).dequantize(parts, 8, 1)
    # q by column: [0, 4, 1, 5, 2, 6, 3, 7]; (q - 1) * 0.5
    assert w.squeeze(1).tolist() == [-0.5, 1.5, 0.0, 2.0, 0.5, 2.5, 1.0, 3.0]


def test_gptq_words_unpack_along_the_input_with_the_v1_zero_offset():
    # Eight input rows in one word per column: column 0 holds 0..7, column 1 holds 15 eight times.
    qweight = words(0x76543210, 0xFFFFFFFF, *[0] * 6).reshape(1, 8)
    scales = torch.full((1, 8), 0.25, dtype=torch.float16)
    # A symmetric 4-bit checkpoint in AutoGPTQ's format stores its zero point 8 as 7.
    v1 = gptq.GptqLayout(4, None, zero_offset=1).dequantize(
        {"qweight": qweight, "qzeros": words(0x77777777).reshape(1, 1), "scales": scales}, 8, 8)
    assert v1[0].tolist() == [-2.0, -1.75, -1.5, -1.25, -1.0, -0.75, -0.5, -0.25]
    assert v1[1].tolist() == [1.75] * 8
    # gptq_v2 stores 8 itself.
    v2 = gptq.GptqLayout(4, None, zero_offset=0).dequantize(
        {"qweight": qweight, "qzeros": words(0x88888888).reshape(1, 1), "scales": scales}, 8, 8)
    assert torch.equal(v1, v2)


def test_gptq_desc_act_takes_each_input_rows_group_from_g_idx():
    qweight = words(0x11111111, *[0] * 7).reshape(1, 8)  # column 0: q = 1 on every input row
    scales = torch.tensor([[1.0] * 8, [3.0] * 8], dtype=torch.float16)
    parts = {"qweight": qweight, "qzeros": words(0xFFFFFFFF).reshape(1, 1).repeat(2, 1), "scales": scales,
             "g_idx": torch.tensor([1, 0, 0, 1, 1, 0, 1, 0], dtype=torch.int32)}
    w = gptq.GptqLayout(4, 4, zero_offset=0).dequantize(parts, 8, 8)
    # (1 - 15) * scale of the row's group
    assert w[0].tolist() == [-42.0, -14.0, -14.0, -42.0, -42.0, -14.0, -42.0, -14.0]


def test_pack_quantized_words_hold_signed_values_with_an_offset():
    # One output row, 16 inputs: 0x76543210 is 0..7, 0xFEDCBA98 (a negative int32) is 8..15; minus 8, times 0.5.
    parts = {"weight_packed": words(0x76543210, 0xFEDCBA98).reshape(1, 2),
             "weight_scale": torch.full((1, 1), 0.5, dtype=torch.bfloat16), "weight_shape": torch.tensor([1, 16])}
    w = compressed_tensors.PackQuantizedLayout(4, None, symmetric=True).dequantize(parts, 1, 16)
    assert w[0].tolist() == [v / 2 for v in range(-8, 8)]


def test_pack_quantized_asymmetric_zero_points_are_packed_along_the_output():
    # Three output rows, 8 inputs of q = 0 (stored 8); zero points -1, 0, 2 stored +8 in one word down the outputs.
    parts = {"weight_packed": words(*[0x88888888] * 3).reshape(3, 1),
             "weight_scale": torch.ones(3, 1, dtype=torch.bfloat16), "weight_shape": torch.tensor([3, 8]),
             "weight_zero_point": words(0x00000A87).reshape(1, 1)}
    w = compressed_tensors.PackQuantizedLayout(4, None, symmetric=False).dequantize(parts, 3, 8)
    assert w[:, 0].tolist() == [1.0, 0.0, -2.0]


def test_fp8_blocks_multiply_by_their_scale_with_partial_edges():
    # e4m3 bytes: 0x38 = 1.0, 0x40 = 2.0, 0xC0 = -2.0, 0x3C = 1.5. A 3x3 weight in 2x2 blocks: scales [[1, 2], [4, 8]].
    raw = torch.tensor([[0x38, 0x40, 0x38], [0xC0, 0x3C, 0x40], [0x38, 0x38, 0xC0]], dtype=torch.uint8)
    parts = {"weight": raw.view(torch.float8_e4m3fn), "weight_scale_inv": torch.tensor([[1.0, 2.0], [4.0, 8.0]])}
    w = fp8.Fp8BlockLayout((2, 2)).dequantize(parts, 3, 3)
    assert w.tolist() == [[1.0, 2.0, 2.0], [-2.0, 1.5, 4.0], [4.0, 4.0, -16.0]]


# --- (b) our unpacking equals the reference dequantization -------------------------------------------------------


@pytest.mark.parametrize(("layout", "quantize", "shape"), [
    (awq.AwqLayout(32), lambda w: qc.quantize_awq(w, 32), (40, 96)),
    (awq.AwqLayout(64), lambda w: qc.quantize_awq(w, 64), (24, 192)),
    (gptq.GptqLayout(4, 32, 1), lambda w: qc.quantize_gptq(w, 4, 32, desc_act=True), (24, 104)),
    (gptq.GptqLayout(4, 64, 1), lambda w: qc.quantize_gptq(w, 4, 64, sym=False), (40, 136)),
    (gptq.GptqLayout(8, 32, 0), lambda w: qc.quantize_gptq(w, 8, 32, sym=False, checkpoint_format="gptq_v2"),
     (28, 100)),
    (gptq.GptqLayout(8, None, 1), lambda w: qc.quantize_gptq(w, 8, None, desc_act=True), (12, 36)),
    (compressed_tensors.PackQuantizedLayout(4, 32, True), lambda w: qc.quantize_pack_quantized(w, 4, 32), (21, 96)),
    (compressed_tensors.PackQuantizedLayout(4, None, False),
     lambda w: qc.quantize_pack_quantized(w, 4, None, symmetric=False), (21, 99)),
    (compressed_tensors.PackQuantizedLayout(8, 64, False),
     lambda w: qc.quantize_pack_quantized(w, 8, 64, symmetric=False), (13, 128)),
    (fp8.Fp8BlockLayout((128, 128)), lambda w: qc.quantize_fp8(w), (200, 72)),
    (fp8.Fp8BlockLayout((16, 32)), lambda w: qc.quantize_fp8(w, (16, 32)), (40, 70)),
], ids=["awq_g32", "awq_g64", "gptq4_g32_desc_act_partial", "gptq4_g64_asym_partial", "gptq8_g32_asym_v2_odd_in",
        "gptq8_one_group_desc_act", "pack_int4_g32", "pack_int4_channel_asym_odd_in", "pack_int8_g64_asym_odd_out",
        "fp8_128_partial", "fp8_16x32_partial"])
def test_unpacked_weights_equal_the_reference_dequantization_exactly(layout, quantize, shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    parts, reference = quantize(w)
    assert torch.equal(layout.dequantize(parts, *shape), reference)


def test_pack_quantized_matches_compressed_tensors_own_packing_and_decompression():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor, pack_to_int32
    from compressed_tensors.quantization import QuantizationScheme

    generator = torch.Generator().manual_seed(3)
    for bits in (4, 8):
        # Our writer packs signed values (weights along the input, zero points along the output) as compressed-tensors
        # does...
        half = 2 ** (bits - 1)
        values = torch.randint(-half, half, (13, 99), generator=generator, dtype=torch.int32)
        assert torch.equal(qc.pack_rows(values + half, bits), pack_to_int32(values.to(torch.int8), bits))
        assert torch.equal(qc.pack_rows(values.t() + half, bits).t(),
                           pack_to_int32(values.to(torch.int8), bits, packed_dim=0))
    for bits, group_size, symmetric, shape in [(4, 32, True, (21, 96)), (4, None, False, (21, 99)),
                                               (8, 64, False, (13, 128))]:
        w = torch.randn(shape, generator=generator)
        parts, _ = qc.quantize_pack_quantized(w, bits, group_size, symmetric)
        ours = compressed_tensors.PackQuantizedLayout(bits, group_size, symmetric).dequantize(parts, *shape)
        # ...and its decompression, which multiplies in the scale's dtype (bf16), is ours rounded once to it.
        scheme = QuantizationScheme(targets=["Linear"], weights={
            "num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": group_size,
            "strategy": "group" if group_size else "channel"})
        theirs = PackedQuantizationCompressor.decompress(dict(parts), scheme)["weight"]
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs, ours.to(torch.bfloat16)), (bits, group_size)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny fp32 Qwen3 checkpoint (the real vocabulary and tokenizer) whose MLP is 160 wide."""
    return tiny_checkpoint(tmp_path_factory.mktemp("plain"), seed=5, intermediate_size=160)


@pytest.fixture(scope="module")
def quantized(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """quantized(name) -> (the checkpoint in CHECKPOINTS[name]'s format, the plain checkpoint of its reference
    dequantization), written once per module."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            method, options = CHECKPOINTS[name]
            root = tmp_path_factory.mktemp(name)
            reference = qc.quantize_checkpoint(base, root / "quantized", method, **options)
            made[name] = root / "quantized", qc.write_reference(base, root / "reference", reference)
        return made[name]

    return get


def loaded_model(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The model of `folder` loaded by the engine's loader, without an engine."""
    cfg = ModelConfig.from_folder(folder)
    model = model_class(cfg)(cfg, dtype, 64)
    load_checkpoint(model, folder)
    return model


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_loaded_model_equals_its_reference_checkpoint_exactly(name, quantized):
    folder, reference = quantized(name)
    ours, theirs = loaded_model(folder).state_dict(), loaded_model(reference).state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_a_bf16_model_rounds_the_dequantized_weights_once(quantized):
    folder, reference = quantized("awq_g32")
    ours, theirs = loaded_model(folder, torch.bfloat16).state_dict(), loaded_model(reference, torch.bfloat16).state_dict()
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_the_load_logs_one_line_with_the_format_and_the_memory_the_weights_take(quantized, caplog):
    with caplog.at_level(logging.INFO, logger="qwenserve.engine"):
        loaded_model(quantized("gptq4_g64_desc_act")[0])
    lines = [r.getMessage() for r in caplog.records if "quantized checkpoint" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "GPTQ 4-bit, group size 64, symmetric, desc_act: 14 linear weights dequantized to float32" in lines[0]
    assert "GiB in memory" in lines[0]


# --- (c) greedy tokens equal transformers' on the dequantized weights --------------------------------------------


@pytest.mark.parametrize("name", GREEDY_CHECKPOINTS)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(name, quantized):
    folder, reference = quantized(name)
    prompts = random_prompts(3, 5, 30, seed=8)
    hf = load_reference(reference)
    expected = [reference_greedy(hf, p, GREEDY.max_tokens)[0] for p in prompts]
    engine = LLMEngine.from_pretrained(folder, EngineConfig(dtype="float32", num_kv_blocks=32, block_size=8,
                                                            num_threads=2))
    try:
        assert engine.generate_sync(prompts, GREEDY) == expected
    finally:
        engine.shutdown()


# --- (d) what is not supported, and broken checkpoints ------------------------------------------------------------


@pytest.mark.parametrize(("quantization_config", "words_in_message"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True}, ["AWQ", "'gemv'"]),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False, "sym": True}, ["GPTQ", "3 bits"]),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, ["'bitsandbytes'"]),
    ({"quant_method": "mystery-quant", "bits": 2}, ["'mystery-quant'"]),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
     ["compressed-tensors", "'float-quantized'"]),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, ["FP8", "'static'"]),
], ids=["awq_gemv", "gptq_3bit", "bitsandbytes", "unknown", "compressed_tensors_fp8", "fp8_static"])
def test_unsupported_quantization_is_refused_in_one_line_naming_it(base, tmp_path, quantization_config,
                                                                   words_in_message):
    folder = shutil.copytree(base, tmp_path / "refused")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(CheckpointError) as refused:
        loaded_model(folder)
    message = str(refused.value)
    assert "\n" not in message and "qwen-serve loads" in message
    assert all(word in message for word in words_in_message), message


def edited(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> Path:
    """A copy of checkpoint `src` whose tensors and config `edit` changed in place."""
    shutil.copytree(src, dst)
    tensors, config = load_file(dst / "model.safetensors"), json.loads((dst / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


K = "model.layers.1.self_attn.k_proj"


@pytest.mark.parametrize(("edit", "tensor", "words_in_message"), [
    (lambda t, c: t.pop(f"{K}.qzeros"), f"{K}.qzeros", ["missing"]),
    (lambda t, c: t.update({f"{K}.scales": t[f"{K}.scales"][:1]}), f"{K}.scales", ["[1, 64]", "[2, 64]"]),
    (lambda t, c: t.update({f"{K}.qweight": t[f"{K}.qweight"].float()}), f"{K}.qweight", ["float32", "int32"]),
    (lambda t, c: t.update({f"{K}.weight": torch.zeros(64, 64)}), f"{K}.weight", ["both plain and quantized"]),
    (lambda t, c: c.pop("quantization_config"), "model.layers.0.mlp.down_proj.qweight", ["no quantization_config"]),
    (lambda t, c: c["quantization_config"].update(modules_to_not_convert=["model.layers.1.self_attn.k_proj"]),
     f"{K}.qweight", ["leaves", "unquantized"]),
], ids=["missing_part", "misshaped_part", "wrong_dtype", "plain_and_quantized", "no_config", "not_converted"])
def test_broken_quantized_checkpoints_name_the_tensor(quantized, tmp_path, edit, tensor, words_in_message):
    folder = edited(quantized("awq_g32")[0], tmp_path / "broken", edit)
    with pytest.raises(CheckpointError) as broken:
        loaded_model(folder)
    assert broken.value.tensor == tensor
    assert all(word in str(broken.value) for word in words_in_message), str(broken.value)


# --- the description ---------------------------------------------------------------------------------------------


def test_quantization_config_is_described():
    # Qwen2.5-7B-Instruct-AWQ's and -GPTQ-Int4's configs, abridged.
    awq_q = quantization_of({"quantization_config": {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
                                                     "quant_method": "awq", "version": "gemm", "zero_point": True}})
    assert (awq_q.method, awq_q.bits, awq_q.group_size, awq_q.symmetric) == ("awq", 4, 128, False)
    assert awq_q.describe() == "AWQ 4-bit, group size 128, zero points"
    assert awq_q.quantizes("model.layers.0.mlp.down_proj") and not awq_q.quantizes("lm_head")
    gptq_q = quantization_of({"quantization_config": {"bits": 4, "group_size": 128, "desc_act": True, "sym": True,
                                                      "quant_method": "gptq", "lm_head": False}})
    assert (gptq_q.bits, gptq_q.desc_act, gptq_q.symmetric, gptq_q.layout.zero_offset) == (4, True, True, 1)
    ct_q = quantization_of({"quantization_config": qc.FORMATS["compressed-tensors"](bits=8, group_size=None)[0]})
    assert ct_q.describe() == "compressed-tensors 8-bit, one scale per output channel, symmetric"
    assert not ct_q.quantizes("lm_head") and ct_q.quantizes("model.layers.3.self_attn.o_proj")
    fp8_q = quantization_of({"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                     "quant_method": "fp8", "weight_block_size": [128, 128],
                                                     "modules_to_not_convert": ["mlp.gate"]}})
    assert fp8_q.describe() == "FP8 (e4m3), 128x128 blocks"
    assert not fp8_q.quantizes("model.layers.0.mlp.gate") and fp8_q.quantizes("model.layers.0.mlp.gate_proj")
    assert quantization_of({"model_type": "qwen3"}) is None


def test_a_multimodal_checkpoints_quantization_config_covers_its_language_model():
    config = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64},
              "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}}
    from qwenserve.checkpoint_config import language_model_config

    assert quantization_of(language_model_config(config)).group_size == 32
