"""A dense model's decode steps through every decoder layer in one C call (cpu_kernels/decode_stack.c), the `Ops`
of a bf16 model on the C kernels (models/ops.py).

The layer-by-layer path makes about a dozen Python calls per layer, each a few tens of microseconds of checks,
tensors and an OpenMP region, ~18 ms of a single stream's 45-70 ms step for Qwen3-0.6B's 28 layers on this
project's Xeon; the products themselves are the same kernels either way, and the result is equal bit for bit.
It applies where every layer is a plain Qwen2 / Qwen3 block (grouped-query attention with optional bias and q/k
norm, a SwiGLU MLP) whose products are bf16 panels or 4- / 8-bit codes, the KV cache is bf16, every row of the step
is a decode token the CPU kernel attends, and the rows are within FusedRows' limits: from the row count where the
start-up probe found a many-row product faster than the panels, the call multiplies on AMX tiles as layer by layer
does (codes, and bf16 weights laid out for our AMX product); where that product is PyTorch's (oneDNN), which C cannot
call, steps of that many rows go layer by layer. Elsewhere it declines (None) and the layers run one by one."""

from __future__ import annotations

import dataclasses
import functools
import re

import torch
from torch import nn

from qwenserve.cpu_kernels.decode_stack import DecodeStack, LayerWeights
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.models.forward_context import ForwardContext
from qwenserve.models.layers import SwiGLUMLP
from qwenserve.models.ops import Ops
from qwenserve.models.qwen3 import QwenDecoderLayer

_STACK = "_decode_stack"  # the model's attribute holding its DecodeStack, or False where it has none


def decode_stack_of(model: nn.Module) -> DecodeStack | None:
    """The model's DecodeStack, built at its first decode step (after its weights were packed or kept as codes) and
    kept; None where a layer is not a plain dense block of bf16 panels or codes."""
    stack = model.__dict__.get(_STACK)
    if stack is None:
        stack = _build(model) or False
        model.__dict__[_STACK] = stack
    return stack or None


def _build(model: nn.Module) -> DecodeStack | None:
    cfg = getattr(model, "cfg", None)
    layers = getattr(model, "layers", None)
    if cfg is None or layers is None or cfg.is_hybrid or cfg.attn_output_gate or not len(layers):
        return None
    weights = []
    for layer in layers:
        if type(layer) is not QwenDecoderLayer or type(layer.mlp) is not SwiGLUMLP:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if layer.input_layernorm.zero_centered or layer.post_attention_layernorm.zero_centered:
            return None
        weights.append(LayerWeights(
            layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
            attn.q_norm.weight.data if attn.q_norm is not None else None,
            attn.k_norm.weight.data if attn.k_norm is not None else None,
            attn.qkv_bias.data if attn.qkv_bias is not None else None,
            attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    first = layers[0].self_attn
    rot = model.rotary.cos.shape[-1]
    qk_zero_centered = bool(first.q_norm.zero_centered) if first.q_norm is not None else False
    try:
        return DecodeStack(weights, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, rot, cfg.rms_norm_eps, qk_zero_centered)
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """Which decode steps run in one call: fewer rows than `max_rows`, and than `panel_rows` where a product is bf16
    panels without AMX tiles; codes on AMX tiles from `quant_amx_rows` rows, tiled bf16 weights from `panel_amx_rows`
    (None: never)."""

    max_rows: int
    panel_rows: int
    quant_amx_rows: int | None = None
    panel_amx_rows: int | None = None

    def label(self) -> str:
        """'+fused_decode<N', with ',codes<M' where only codes run past the panels' limit N."""
        if self.panel_amx_rows is not None or self.max_rows == self.panel_rows:
            return f"+fused_decode<{self.max_rows}"
        return f"+fused_decode<{self.panel_rows},codes<{self.max_rows}"


def fused_decode_layers(kernels: CpuKernels, limits: FusedRows, model: nn.Module, x: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
    """The hidden states after every decoder layer for the embeddings x [rows, hidden] (cos / sin: the rows'
    rotary tables), computed in one C call; None where the step or the model is not one it runs."""
    rows = x.shape[0]
    if rows >= limits.max_rows or x.dtype != torch.bfloat16 or ctx.kv_cache.dtype != torch.bfloat16 \
            or ctx.linear is not None:
        return None
    decode = ctx.decode_rows()
    if decode is None:
        return None
    stack = decode_stack_of(model)
    if stack is None or (stack.has_panels and rows >= limits.panel_rows
                         and (limits.panel_amx_rows is None or not stack.panels_tiled)):
        return None
    x = x.contiguous()
    kernels.decode_stack_bf16(stack, x, cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous(),
                              decode.slot_mapping, ctx.kv_cache, decode.block_table, decode.context_lens,
                              limits.quant_amx_rows, limits.panel_amx_rows)
    return x


def with_fused_decode(ops: Ops, kernels: CpuKernels, limits: FusedRows) -> Ops:
    """`ops` whose decode steps within `limits` run every layer in one call (named as FusedRows.label says)."""
    label = limits.label()
    name = re.sub(r"\+fused_decode<[\d,a-z<]+", label, ops.name) if "+fused_decode<" in ops.name else ops.name + label
    return dataclasses.replace(ops, name=name, decode_layers=functools.partial(fused_decode_layers, kernels, limits))
