"""Quantized linears kept as codes (W4A16, W8A16) where the engine's kernels run them: as the checkpoint is read,
each of the model's linear weights whose rows all come from quantized linears of one layout is replaced by one
`QuantWeight` as soon as its last part arrives (a fused weight, q/k/v or gate/up, concatenates its parts' codes along
the output), and a stack of MoE experts' weights [experts, n, k] by a list of one QuantWeight per expert (the model
indexes it by expert); so no more than a few matrices' unpacked codes are held at once. What cannot be kept that way
is dequantized into its parameter as before: a weight only partly quantized, parts in different layouts (act-order
groups that differ between q, k and v), and the LM head, which is the tied embedding table too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qwenserve.cpu_kernels.quant_weight import QuantWeight
from qwenserve.engine.quantization.scheme import IntegerWeight
from qwenserve.models.gemlite_linear import GemliteWeight
from qwenserve.models.ops import PACKED_WEIGHTS

# The model's parameters that may hold codes: every packed linear weight but the LM head.
KEPT_WEIGHTS = tuple(name for name in PACKED_WEIGHTS if name != "lm_head")

# What packs one matrix's codes for the engine's kernels, in QuantWeight.pack's signature (codes, scales, zeros,
# bits, group_size, groups); ValueError where they do not take that layout. The result has `nbytes`.
CodePacker = Callable[..., object]


@dataclass(frozen=True)
class _Slot:
    """One parameter that may hold codes: `parts`, the checkpoint weights that fill it in row order; `experts`, how
    many matrices it stacks (1: a plain [n, k] weight)."""

    module: nn.Module
    attr: str
    parts: tuple[str, ...]
    experts: int


class CodePlacer:
    """Puts a model's kept linears in place as the loader reads them: `take` each linear read as codes, `finish`
    after the last. `replaced` counts the parameters now holding codes."""

    def __init__(self, model: nn.Module, targets: dict[str, torch.Tensor], pack: CodePacker = QuantWeight.pack
                 ) -> None:
        """`targets` maps each checkpoint weight name to the view of the model's parameter it fills; `pack` makes
        the kernels' weight of a matrix's codes (the CPU's QuantWeight unless the engine runs elsewhere)."""
        self._pack = pack
        by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, view in targets.items():
            by_storage.setdefault(view.untyped_storage().data_ptr(), []).append((name, view))
        self._slots: dict[str, _Slot] = {}
        for module in model.modules():
            for attr in KEPT_WEIGHTS:
                param = module._parameters.get(attr)
                if param is None or param.dim() not in (2, 3):
                    continue
                # A stack of experts is its experts' matrices one after the other: rows of [experts * n, k].
                rows = param.data.reshape(-1, param.shape[-1])
                parts = _parts_of(rows, by_storage.get(param.untyped_storage().data_ptr(), []))
                experts = param.shape[0] if param.dim() == 3 else 1
                if parts and len(parts) % experts == 0:
                    slot = _Slot(module, attr, tuple(parts), experts)
                    self._slots.update(dict.fromkeys(parts, slot))
        self._pending: dict[str, IntegerWeight] = {}
        self.replaced = 0

    def take(self, name: str, weight: IntegerWeight) -> list[tuple[str, IntegerWeight]]:
        """Keep checkpoint weight `name`'s codes; when they complete their parameter, it holds them from now on. Returns
        the parts to dequantize into their views instead (all of a parameter that cannot hold codes), else []."""
        slot = self._slots.get(name)
        if slot is None:
            return [(name, weight)]
        self._pending[name] = weight
        if any(part not in self._pending for part in slot.parts):
            return []
        weights = [self._pending.pop(part) for part in slot.parts]
        per_expert = len(weights) // slot.experts
        packed = [_packed(weights[e * per_expert:(e + 1) * per_expert], self._pack) for e in range(slot.experts)]
        if any(p is None for p in packed):
            return list(zip(slot.parts, weights, strict=True))
        slot.module._parameters.pop(slot.attr)
        # Plain attributes, as PackedWeights are: nothing trains or moves them.
        setattr(slot.module, slot.attr, packed if slot.experts > 1 else packed[0])
        self.replaced += 1
        return []

    def finish(self) -> list[tuple[str, IntegerWeight]]:
        """The parts whose parameter never completed (others of its parts were stored plain): to dequantize."""
        left = list(self._pending.items())
        self._pending.clear()
        return left


def codes_held(model: nn.Module) -> list[QuantWeight | GemliteWeight]:
    """Every weight the model holds as codes (QuantWeight, or GemLite's on CUDA), a stack of experts' one by one."""
    kinds = (QuantWeight, GemliteWeight)
    found: list[QuantWeight | GemliteWeight] = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, kinds):
                found.append(value)
            elif isinstance(value, list):
                found.extend(w for w in value if isinstance(w, kinds))
    return found


def _packed(parts: list[IntegerWeight], pack: CodePacker) -> object | None:
    """One matrix's parts (in row order) packed by `pack`, or None where they do not make one its kernel takes."""
    weight = _concatenated(parts)
    if weight is None:
        return None
    try:
        return pack(weight.codes, weight.scales, weight.zeros, weight.bits, weight.group_size, weight.groups)
    except ValueError:
        return None  # a layout the kernel does not take (a 4-bit group of odd size): dequantized instead


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
