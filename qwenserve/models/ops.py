"""The ops a model's layers call, chosen once per engine (engine/kernels.py) and given to the model when it is built.

Model files call `ops.linear(x, w)`, `ops.embedding(table, ids)` and a Gated DeltaNet layer's recurrences
(`ops.gated_delta_step`, `ops.gated_delta_prefills`, `ops.short_conv_step`) and never ask which kernels run.
PyTorch's ops everywhere, except:
- on a CPU where the C kernels load: a hybrid model's recurrent update at decode runs in the C kernel (its state is
  fp32 whatever the serving dtype), and for fp32 (and bf16 over bf16 weights) `prepare` repacks the linear weights
  into `PackedWeight`s once after the checkpoint is loaded (in fp32, or in bf16 where the engine asks:
  `--cpu-weight-dtype`, `--dtype auto`), and `linear` runs the packed product;
- on CUDA, the recurrences run in flash-linear-attention's and causal-conv1d's kernels where those packages are
  installed (models/linear_attention_gpu.py); each is optional.
A model built without ops runs PyTorch's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qwenserve import progress
from qwenserve.cpu_kernels import onednn_weight
from qwenserve.cpu_kernels.amx_weight import AmxWeight
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PackedWeight, packable
from qwenserve.models import torch_forms
from qwenserve.models.gated_delta import (
    chunk_gated_delta_prefills,
    recurrent_gated_delta_step,
    short_conv_step,
)

# The weights packed for the CPU kernels: every matrix a token's hidden state is multiplied by.
PACKED_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "in_proj", "out_proj")

Weight = torch.Tensor | PackedWeight


@dataclass(frozen=True, slots=True)
class Ops:
    """What the layers compute with. `linear(x, w, bias)`: x · wᵀ (+ bias) in x's dtype; `logits(x, w, out)`: the
    LM head's x · wᵀ in fp32 for the sampler, into the fp32 buffer `out` where the op can use one;
    `embedding(table, ids)`: rows of a table; `prepare(model)`: adapt the loaded weights to these
    ops, returning how many it changed; `rms_norm`, `qk_norm_rope` and `silu_mul`: the elementwise math around the
    products, as models/torch_forms.py's functions of the same names (which are the defaults); `gated_delta_step(q, k, v, g, beta, states, slots)`: one decode token of
    the gated delta rule, the states updated in place; `gated_delta_prefills(q, k, v, g, beta, states, prefills)`:
    a step's prefill chunks; `short_conv_step(x, conv_state, weight, slots)`: the decode rows' convolution
    (models/gated_delta.py says the three contracts); `decode_layers(model, x, cos, sin, ctx)`: every decoder layer
    of a step in one call, or None where it does not apply and the layers run one by one (models/fused_decode.py)."""

    name: str
    linear: Callable[..., torch.Tensor]
    logits: Callable[..., torch.Tensor]
    embedding: Callable[[Weight, torch.Tensor], torch.Tensor]
    prepare: Callable[[nn.Module], int]
    rms_norm: Callable[..., torch.Tensor] = torch_forms.rms_norm
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = torch_forms.qk_norm_rope
    silu_mul: Callable[..., torch.Tensor] = torch_forms.silu_mul
    gated_delta_step: Callable[..., torch.Tensor] = recurrent_gated_delta_step
    gated_delta_prefills: Callable[..., torch.Tensor] = chunk_gated_delta_prefills
    short_conv_step: Callable[..., torch.Tensor] = short_conv_step
    decode_layers: Callable[..., torch.Tensor | None] = lambda model, x, cos, sin, ctx: None


def _torch_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _torch_logits(x: torch.Tensor, weight: Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight).float()


def _torch_embedding(table: Weight, ids: torch.Tensor) -> torch.Tensor:
    return table[ids]


def _nothing_to_prepare(model: nn.Module) -> int:
    return 0


TORCH_OPS = Ops("torch", _torch_linear, _torch_logits, _torch_embedding, _nothing_to_prepare)


def _packed_linear(kernels: CpuKernels, dense_rows: int | None, x: torch.Tensor, weight: Weight,
                   bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed product on PackedWeights, in x's dtype (fp32, or bf16: the panels' product reads fp32 rows, so a
    few rows are widened and the result rounded back); weights that could not be packed (rows not a multiple of 16)
    stay tensors and go to F.linear. From `dense_rows` rows up (None: never), a weight kept in bf16 for a many-row
    product too is multiplied there, x rounded to bf16: ours on AMX tiles, or PyTorch's. `out`: an fp32 buffer for a
    2-D product wanted in fp32 (the logits: fresh memory of that size would be faulted in page by page at every
    step)."""
    if not isinstance(weight, PackedWeight):
        y = F.linear(x, weight, bias)
        return y if out is None else y.float()
    if weight.dense is not None and dense_rows is not None and x.numel() >= dense_rows * x.shape[-1]:
        y = (_amx_linear(kernels, x, weight.dense, out) if isinstance(weight.dense, AmxWeight)
             else onednn_weight.linear(x.to(torch.bfloat16), weight.dense))
        if y is not None:
            y = y.to(x.dtype) if out is None else y.float()
            return y if bias is None else y.add_(bias)
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and out is None and x.stride(-1) == 1:
        y = kernels.linear_packed_bf16_io(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)
        return y if bias is None else y.add_(bias)
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    y = kernels.linear_packed(rows, weight, out if x.dim() == 2 else None)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if out is None and x.dtype != y.dtype:
        y = y.to(x.dtype)
    return y if bias is None else y.add_(bias)


def _amx_linear(kernels: CpuKernels, x: torch.Tensor, weight: AmxWeight, out: torch.Tensor | None
                ) -> torch.Tensor | None:
    """x [..., k] @ Wᵀ on AMX tiles (linear_amx.c), x rounded to bf16: bf16, or fp32 in `out` for a 2-D x;
    None where the kernel cannot run here."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    into = out if out is not None and x.dim() == 2 and out.is_contiguous() and out.dtype == torch.float32 else None
    y = kernels.linear_bf16_amx(rows, weight, into)
    return None if y is None else y.view(*x.shape[:-1], weight.n)


def _packed_logits(kernels: CpuKernels, dense_rows: int | None, x: torch.Tensor, weight: Weight,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head's product in fp32 (`out`: a buffer for it): a bf16 model's hidden rows are widened first, so the
    panels' product of its few sampled rows is fp32 throughout."""
    if not isinstance(weight, PackedWeight):
        return F.linear(x, weight).float()
    return _packed_linear(kernels, dense_rows, x.float(), weight, None, out)


def _packed_embedding(dtype: torch.dtype, table: Weight, ids: torch.Tensor) -> torch.Tensor:
    """A tied LM head is packed; its rows are the embeddings (in the model's `dtype`)."""
    return table.rows(ids).to(dtype) if isinstance(table, PackedWeight) else table[ids]


def _bf16_rms_norm(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   zero_centered: bool = False) -> torch.Tensor:
    """torch_forms.rms_norm in one C call for a bf16 model's rows (bf16_layer.c); the PyTorch form elsewhere."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return torch_forms.rms_norm(x, weight, eps, zero_centered)
    rows = x.reshape(-1, x.shape[-1])
    return kernels.rms_norm_bf16(rows, weight, eps, zero_centered).view(x.shape)


def _bf16_qk_norm_rope(kernels: CpuKernels, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, zero_centered: bool, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_forms.qk_norm_rope in one C call, in place, for a bf16 model's q and k whose heads lie side by side
    in each token's row (views into the fused q/k/v product); the PyTorch form elsewhere."""
    dim = q.shape[-1]
    if (q.dtype == k.dtype == cos.dtype == torch.bfloat16 and q.stride(-1) == k.stride(-1) == 1
            and q.stride(-2) == k.stride(-2) == dim and cos.is_contiguous() and sin.is_contiguous()):
        kernels.qk_norm_rope_bf16(q, k, q_weight, k_weight, cos, sin, eps, zero_centered)
        return q, k
    return torch_forms.qk_norm_rope(q, k, q_weight, k_weight, eps, zero_centered, cos, sin)


def _bf16_silu_mul(kernels: CpuKernels, gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """torch_forms.silu_mul in one C call for a bf16 model's rows; the PyTorch form elsewhere."""
    if gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return torch_forms.silu_mul(gate_up, n)
    return kernels.silu_mul_bf16(gate_up, n)


def pack_linear_weights(model: nn.Module, dtype: torch.dtype = torch.float32, dense: str | None = None) -> int:
    """Replace the model's packable linear weights by PackedWeights with panels in `dtype` (after the checkpoint
    is loaded: checkpoint_targets describes the unpacked layout), each kept in bf16 for the many-row product
    `dense` too ('amx', 'onednn'; None: not); returns how many were packed."""
    found = [(module, name) for module in model.modules() for name in PACKED_WEIGHTS
             if (param := module._parameters.get(name)) is not None and packable(param.data)]
    with progress.step("packing weights for the CPU kernels", total=len(found), unit="matrices",
                       total_bytes=sum(module._parameters[name].nbytes for module, name in found)) as step:
        for module, name in found:
            packed = PackedWeight.pack(module._parameters.pop(name).data, dtype, dense)
            setattr(module, name, packed)  # a plain attribute now: nothing trains or moves it
            step.advance(1, packed.nbytes)
    return len(found)


def cpu_kernel_ops(kernels: CpuKernels, dtype: torch.dtype, weight_dtype: torch.dtype = torch.float32,
                   dense_rows: int | None = None, dense_product: str = "onednn") -> Ops:
    """The C kernels' ops for a model in `dtype` on the CPU: for fp32 activations, and for bf16 activations over bf16
    weights, the packed product (the weights packed once after loading, in `weight_dtype`: fp32, or bf16 for half the
    bytes per decode step, widened to fp32 in the product; with bf16 weights and `dense_rows`, the many-row product
    `dense_product` from that many rows up: ours on AMX tiles ('amx') or PyTorch's bf16 product ('onednn'), on a
    bf16 copy laid out for it) and the recurrent update; for other bf16 / fp16 models PyTorch's products and the C
    kernel's recurrent update (a hybrid model's state is fp32 in every dtype)."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and weight_dtype == torch.bfloat16):
        dense_rows = dense_rows if weight_dtype == torch.bfloat16 else None
        name = "cpu_kernels" if weight_dtype == torch.float32 else "cpu_kernels+bf16_weights"
        name += "+bf16_activations" if dtype == torch.bfloat16 else ""
        name += f"+{dense_product}>={dense_rows}" if dense_rows else ""
        ops = Ops(name, functools.partial(_packed_linear, kernels, dense_rows),
                  functools.partial(_packed_logits, kernels, dense_rows),
                  functools.partial(_packed_embedding, dtype),
                  functools.partial(pack_linear_weights, dtype=weight_dtype,
                                    dense=dense_product if dense_rows else None),
                  gated_delta_step=kernels.gated_delta_step)
        if dtype == torch.bfloat16:  # fp32 keeps PyTorch's forms: token for token transformers'
            ops = dataclasses.replace(ops, name=f"{name}+bf16_layer",
                                      rms_norm=functools.partial(_bf16_rms_norm, kernels),
                                      qk_norm_rope=functools.partial(_bf16_qk_norm_rope, kernels),
                                      silu_mul=functools.partial(_bf16_silu_mul, kernels))
        return ops
    return dataclasses.replace(TORCH_OPS, name="torch+cpu_gated_delta", gated_delta_step=kernels.gated_delta_step)
