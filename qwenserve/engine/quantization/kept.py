"""Quantized linears kept as codes (W4A16, W8A16) where the engine's kernels run them: after the checkpoint is read,
each of the model's linear weights whose rows all come from quantized linears of one layout is replaced by one
`QuantWeight` (a fused weight, q/k/v or gate/up, concatenates its parts' codes along the output), and a stack of
MoE experts' weights [experts, n, k] by a list of one QuantWeight per expert (the model indexes it by expert). What
cannot be kept that way is dequantized into its parameter as before: a weight only partly quantized, parts in
different layouts (act-order groups that differ between q, k and v), and the LM head, which is the tied embedding
table too."""

from __future__ import annotations

import torch
from torch import nn

from qwenserve.cpu_kernels.quant_weight import QuantWeight
from qwenserve.engine.quantization.scheme import IntegerWeight
from qwenserve.models.ops import PACKED_WEIGHTS

# The model's parameters that may hold codes: every packed linear weight but the LM head.
KEPT_WEIGHTS = tuple(name for name in PACKED_WEIGHTS if name != "lm_head")


def keep_codes(model: nn.Module, targets: dict[str, torch.Tensor],
               kept: dict[str, IntegerWeight]) -> tuple[int, dict[str, IntegerWeight]]:
    """Replace the model's linear weights made only of `kept` (checkpoint weight name -> codes; `targets` maps each
    name to the view of the parameter it fills) by QuantWeights. Returns how many were replaced and the kept weights
    left over, which the caller dequantizes into their views."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, view in targets.items():
        by_storage.setdefault(view.untyped_storage().data_ptr(), []).append((name, view))
    left = dict(kept)
    replaced = 0
    for module in model.modules():
        for attr in KEPT_WEIGHTS:
            param = module._parameters.get(attr)
            if param is None or param.dim() not in (2, 3):
                continue
            # A stack of experts is its experts' matrices one after the other: rows of [experts * n, k].
            rows = param.data.reshape(-1, param.shape[-1])
            parts = _parts_of(rows, by_storage.get(param.untyped_storage().data_ptr(), []))
            if not parts or any(name not in left for name in parts):
                continue
            experts = param.shape[0] if param.dim() == 3 else 1
            per_expert = len(parts) // experts
            packed = [_packed([left[name] for name in parts[e * per_expert:(e + 1) * per_expert]])
                      for e in range(experts)] if len(parts) % experts == 0 else [None]
            if any(p is None for p in packed):
                continue
            module._parameters.pop(attr)
            setattr(module, attr, packed if param.dim() == 3 else packed[0])  # plain attributes, as PackedWeights
            for name in parts:
                del left[name]
            replaced += 1
    return replaced, left


def _packed(parts: list[IntegerWeight]) -> QuantWeight | None:
    """One matrix's parts (in row order) as a QuantWeight, or None where they do not make one our kernel takes."""
    weight = _concatenated(parts)
    if weight is None:
        return None
    try:
        return QuantWeight.pack(weight.codes, weight.scales, weight.zeros, weight.bits, weight.group_size,
                                weight.groups)
    except ValueError:
        return None  # a layout our kernel does not take (a 4-bit group of odd size): dequantized instead


def codes_held(model: nn.Module) -> list[QuantWeight]:
    """Every QuantWeight the model holds, a stack of experts' one by one."""
    found: list[QuantWeight] = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QuantWeight):
                found.append(value)
            elif isinstance(value, list):
                found.extend(w for w in value if isinstance(w, QuantWeight))
    return found


def _parts_of(param: torch.Tensor, views: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The checkpoint weights that fill `param` [n, k], in row order, when they are row blocks that cover it
    exactly; [] otherwise."""
    k = param.shape[1]
    blocks = sorted(((view.storage_offset() - param.storage_offset()) // k, name, view.shape[0])
                    for name, view in views if view.dim() == 2 and view.shape[1] == k)
    row = 0
    for start, _, rows in blocks:
        if start != row:
            return []
        row += rows
    return [name for _, name, _ in blocks] if row == param.shape[0] else []


def _concatenated(parts: list[IntegerWeight]) -> IntegerWeight | None:
    """The parts stacked along the output, or None where they do not share bits, group size and groups."""
    first = parts[0]
    for part in parts[1:]:
        if part.bits != first.bits or part.group_size != first.group_size or not torch.equal(
                part.group_of_inputs(), first.group_of_inputs()):
            return None
    if len(parts) == 1:
        return first
    return IntegerWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                         torch.cat([p.zeros for p in parts]), first.bits, first.group_size, first.groups)
