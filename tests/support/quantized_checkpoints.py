"""Quantized copies of a plain checkpoint, written from each format's documented layout (independently of
qwenserve's unpacking), with the reference dequantization of every weight they quantize.

Each quantizer takes a weight W [out, in] in fp32 and returns the tensors the format stores for it and the weight
they stand for, (q - zero) * scale computed from the integers before they were packed. `quantize_checkpoint`
applies one to every linear of the decoder layers (the LM head, embeddings and norms stay plain, as quantizers
leave them) and `write_reference` writes the reference weights as a plain checkpoint for transformers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# AutoAWQ's order: the k-th 4-bit value of a word is column AWQ_ORDER[k] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Quantized = tuple[dict[str, torch.Tensor], torch.Tensor]  # (the stored parts by name, the reference weight)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the int32 tensors checkpoints store (top bit set: negative)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned `bits`-bit values [rows, n] -> int32 words [rows, ceil(n * bits / 32)] along the rows: value k of
    word j in bits [k*bits, (k+1)*bits) holds column j*p + order[k] (p = 32 // bits; sequential when no order), the
    last word padded with zeros."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    rows, n = values.shape
    count = -(-n // per_word)
    padded = torch.zeros(rows, count * per_word, dtype=torch.int64)
    padded[:, :n] = values.to(torch.int64)
    # [rows, words, per_word] with slot k holding column j*p + order[k], each slot shifted to its bits.
    slots = padded.view(rows, count, per_word)[:, :, list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (slots << shifts).sum(dim=2)  # the slots' bits do not overlap: their sum is their bitwise or
    return as_int32(words)


def _group_min_max(w: torch.Tensor, groups: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of input columns (groups[i] is column i's) and output row: min and max of W [out, in], [count, out]."""
    index = groups.expand(w.shape[0], -1)
    empty = torch.zeros(w.shape[0], count, dtype=w.dtype)
    lo = empty.scatter_reduce(1, index, w, "amin", include_self=False)
    hi = empty.scatter_reduce(1, index, w, "amax", include_self=False)
    return lo.t().contiguous(), hi.t().contiguous()


def quantize_awq(w: torch.Tensor, group_size: int) -> Quantized:
    """AutoAWQ GEMM: asymmetric 4-bit per group of input rows, fp16 scales, qweight/qzeros in AWQ's order."""
    out_features, in_features = w.shape
    grouped = w.view(out_features, in_features // group_size, group_size)  # AWQ's groups are contiguous columns
    lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)  # [out, groups]
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = (-lo / scales.float()).round().clamp(0, 15).to(torch.int32)
    q = ((grouped / scales.float()[:, :, None]).round().to(torch.int32) + zeros[:, :, None]).clamp(0, 15)
    reference = ((q - zeros[:, :, None]).float() * scales.float()[:, :, None]).view(out_features, in_features)
    q_in_out = q.view(out_features, in_features).t()
    parts = {"qweight": pack_rows(q_in_out, 4, AWQ_ORDER), "qzeros": pack_rows(zeros.t(), 4, AWQ_ORDER),
             "scales": scales.t().contiguous()}
    return parts, reference


def quantize_gptq(w: torch.Tensor, bits: int, group_size: int | None, desc_act: bool = False, sym: bool = True,
                  checkpoint_format: str = "gptq", seed: int = 0) -> Quantized:
    """GPTQ (round to nearest on GPTQ's grid): qweight packed along the input dimension, qzeros along the output,
    fp16 scales, g_idx. With desc_act the input rows are grouped in a random order, as activation order makes them.
    The 'gptq' checkpoint format stores each zero point minus one (AutoGPTQ's packer did), 'gptq_v2' as it is."""
    out_features, in_features = w.shape
    maxq = 2**bits - 1
    size = group_size or in_features
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed)) if desc_act \
        else torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // size).to(torch.int32)
    count = -(-in_features // size)
    lo, hi = _group_min_max(w, g_idx, count)
    if sym:
        scales = (torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-5) * 2 / maxq).half()
        zeros = torch.full_like(lo, (maxq + 1) // 2, dtype=torch.int32)
    else:
        scales = ((hi - lo).clamp(min=1e-5) / maxq).half()
        # 'gptq' can store no zero point of 0 (it would be -1 before packing): its packer's kernels read 16 there.
        zeros = (-lo / scales.float()).round().clamp(1 if checkpoint_format == "gptq" else 0, maxq).to(torch.int32)
    rows = g_idx.long()
    q = ((w.t() / scales.float()[rows]).round().to(torch.int32) + zeros[rows]).clamp(0, maxq)  # [in, out]
    reference = ((q - zeros[rows]).float() * scales.float()[rows]).t()
    stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
    parts = {"qweight": pack_rows(q.t(), bits).t().contiguous(), "qzeros": pack_rows(stored_zeros, bits),
             "scales": scales, "g_idx": g_idx}
    return parts, reference


def quantize_pack_quantized(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool = True,
                            scale_dtype: torch.dtype = torch.bfloat16) -> Quantized:
    """compressed-tensors pack-quantized: signed values (int4: -8..7) per group of input columns (None: per output
    row), stored plus 2^(bits-1) and packed along the input dimension; an asymmetric scheme's zero points the same
    way along the output dimension. Scales in `scale_dtype` (the model's, as llm-compressor writes them)."""
    out_features, in_features = w.shape
    size = group_size or in_features
    groups = torch.arange(in_features) // size
    lo, hi = _group_min_max(w, groups, in_features // size)  # [groups, out]
    q_min, q_max, offset = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, 2 ** (bits - 1)
    if symmetric:
        scales = (torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-5) / ((q_max - q_min) / 2)).to(scale_dtype)
        zeros = torch.zeros_like(lo, dtype=torch.int32)
    else:
        scales = ((hi - lo).clamp(min=1e-5) / (q_max - q_min)).to(scale_dtype)
        zeros = (q_min - lo / scales.float()).round().clamp(q_min, q_max).to(torch.int32)
    s, z = scales.float().t()[:, groups], zeros.t()[:, groups]  # [out, in]
    q = ((w / s).round().to(torch.int32) + z).clamp(q_min, q_max)
    reference = (q - z).float() * s
    parts = {"weight_packed": pack_rows(q + offset, bits), "weight_scale": scales.t().contiguous(),
             "weight_shape": torch.tensor([out_features, in_features])}
    if not symmetric:
        parts["weight_zero_point"] = pack_rows(zeros + offset, bits).t().contiguous()  # [ceil(out / p), groups]
    return parts, reference


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> Quantized:
    """Block-wise FP8 (e4m3): per block of R x C (partial at the edges) scale = amax / 448 in fp32, stored as
    weight_scale_inv, and the weight divided by it in float8_e4m3fn."""
    rows, cols = block
    out_features, in_features = w.shape
    scales = torch.empty(-(-out_features // rows), -(-in_features // cols))
    fp8 = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
    for r in range(scales.shape[0]):
        for c in range(scales.shape[1]):
            tile = w[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols]
            scales[r, c] = tile.abs().amax().clamp(min=1e-12) / FP8_MAX
            fp8[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols] = (tile / scales[r, c]).clamp(
                -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    full = scales.repeat_interleave(rows, 0)[:out_features].repeat_interleave(cols, 1)[:, :in_features]
    return {"weight": fp8, "weight_scale_inv": scales}, fp8.float() * full


# Format name -> (quantization_config for its options, quantizer for its options).
FORMATS: dict[str, Callable[..., tuple[dict[str, Any], Callable[[torch.Tensor], Quantized]]]] = {
    "awq": lambda group_size=32: (
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True,
         "modules_to_not_convert": None},
        lambda w: quantize_awq(w, group_size)),
    "gptq": lambda bits=4, group_size=64, desc_act=False, sym=True, checkpoint_format="gptq": (
        {"quant_method": "gptq", "bits": bits, "group_size": group_size or -1, "desc_act": desc_act, "sym": sym,
         "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "true_sequential": True, "lm_head": False},
        lambda w: quantize_gptq(w, bits, group_size, desc_act, sym, checkpoint_format)),
    "compressed-tensors": lambda bits=4, group_size=32, symmetric=True: (
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"], "kv_cache_scheme": None,
         "config_groups": {"group_0": {
             "targets": ["Linear"], "format": "pack-quantized", "input_activations": None, "output_activations": None,
             "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False, "actorder": None,
                         "strategy": "group" if group_size else "channel", "group_size": group_size,
                         "observer": "minmax"}}}},
        lambda w: quantize_pack_quantized(w, bits, group_size, symmetric)),
    "fp8": lambda block=(128, 128): (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)},
        lambda w: quantize_fp8(w, block)),
}


def is_decoder_linear(name: str) -> bool:
    """The weights quantizers quantize: the decoder layers' attention and MLP projections."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES


def quantize_checkpoint(src: Path, dst: Path, method: str, **options: Any) -> dict[str, torch.Tensor]:
    """Copy the plain checkpoint `src` to `dst` with every decoder linear stored in `method`'s format (options:
    FORMATS' keyword arguments); returns each quantized weight's reference dequantization, by weight name."""
    quantization_config, quantize = FORMATS[method](**options)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))  # written below
    tensors = load_file(src / "model.safetensors")
    stored: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not is_decoder_linear(name):
            stored[name] = tensor
            continue
        parts, reference[name] = quantize(tensor.float())
        prefix = name.removesuffix(".weight")
        stored.update({f"{prefix}.{part}": value for part, value in parts.items()})
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return reference


def write_reference(src: Path, dst: Path, reference: dict[str, torch.Tensor]) -> Path:
    """Copy the plain checkpoint `src` to `dst` with the weights in `reference` replaced by their fp32 values."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))  # written below
    tensors = {name: t.float() for name, t in load_file(src / "model.safetensors").items()}
    tensors.update(reference)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
