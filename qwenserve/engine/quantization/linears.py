"""Which of a checkpoint's linear layers are stored quantized, and their weights once all their tensors are read.

The tensors' presence decides, as in vLLM's loaders: a linear whose `<prefix>.<marker>` (qweight, weight_packed,
weight_scale_inv) is in the checkpoint is stored quantized, any other one in plain weights (quantizers leave some
out without saying: the LM head, MoE routers). The config is checked in the other direction only: a module it says
is left unquantized must not be stored quantized.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qwenserve.engine.errors import CheckpointError
from qwenserve.engine.quantization.scheme import IntegerWeight, Part, Quantization

# The part that marks a stored quantized linear, in every format we know.
MARKERS = (".qweight", ".weight_packed", ".weight_scale_inv")


class QuantizedLinears:
    """The quantized linears of one checkpoint (weight name -> the parts it stores), found from the tensor names before
    any is read; `add` collects a linear's parts as they come (from any shard) and, when the last arrives, dequantizes
    it, or with `keep_codes` unpacks its integers (IntegerWeight) for the W4A16 / W8A16 kernels."""

    def __init__(self, quant: Quantization, stored: dict[str, dict[str, Part]], shapes: dict[str, tuple[int, int]],
                 keep_codes: bool = False) -> None:
        self.quant = quant
        self.keep_codes = keep_codes
        self._stored = stored
        self._shapes = shapes
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def find(cls, quant: Quantization | None, names: Iterable[str], targets: dict[str, torch.Tensor],
             keep_codes: bool = False) -> QuantizedLinears | None:
        """The quantized linears among the checkpoint's tensor `names` whose weight is one of the model's `targets`
        (others are left to the loader: skipped, or unexpected); None for a checkpoint in plain weights. `keep_codes`:
        `add` gives integer formats' linears as their codes.

        CheckpointError names the tensor when a linear lacks a part, is stored both plain and quantized, is stored
        quantized where the config says it is not, or when a checkpoint without a quantization_config holds one.
        """
        names = set(names)
        if quant is None:
            stray = sorted(n for n in names if n.endswith(MARKERS) and _weight_of(n) in targets)
            if stray:
                raise CheckpointError(f"tensor {stray[0]!r} is a quantized weight but config.json has no "
                                      "quantization_config (AutoGPTQ's quantize_config.json is not read: copy it there "
                                      "as quantization_config with quant_method 'gptq')", stray[0])
            return None
        layout, stored, shapes = quant.layout, {}, {}
        for name in sorted(n for n in names if n.endswith(f".{layout.marker}")):
            weight = _weight_of(name)
            if weight not in targets or targets[weight].dim() != 2:
                continue
            prefix = weight.removesuffix(".weight")
            if not quant.quantizes(prefix):
                raise CheckpointError(f"tensor {name!r} is stored quantized but config.json's quantization_config leaves "
                                      f"{prefix} unquantized ({', '.join(quant.not_converted) or 'lm_head'})", name)
            out_features, in_features = targets[weight].shape
            allowed = layout.parts(out_features, in_features)
            for part in layout.required:
                if f"{prefix}.{part}" not in names:
                    raise CheckpointError(f"tensor {prefix}.{part!r} is missing from the checkpoint: {name} is stored "
                                          f"as {quant.method}, which needs {', '.join(layout.required)}",
                                          f"{prefix}.{part}")
            if "weight" not in allowed and weight in names:
                raise CheckpointError(f"tensor {weight!r} is stored both plain and quantized ({name})", weight)
            stored[weight] = {part: spec for part, spec in allowed.items() if f"{prefix}.{part}" in names}
            shapes[weight] = (out_features, in_features)
        return cls(quant, stored, shapes, keep_codes)

    def __len__(self) -> int:
        return len(self._stored)

    def owns(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is a part of a quantized linear."""
        prefix, _, part = name.rpartition(".")
        return part in self._stored.get(f"{prefix}.weight", ())

    def add(self, name: str, tensor: torch.Tensor, source: str) -> tuple[str, torch.Tensor | IntegerWeight] | None:
        """Take part `name` (read from file `source`); when it is its linear's last, that linear's weight name and its
        dequantized fp32 value, or its codes where kept. CheckpointError names the tensor whose shape, dtype or values
        do not fit."""
        prefix, _, part = name.rpartition(".")
        weight = f"{prefix}.weight"
        spec = self._stored[weight][part]
        out_features, in_features = self._shapes[weight]
        if tuple(tensor.shape) != spec.shape or tensor.dtype not in spec.dtypes:
            raise CheckpointError(
                f"tensor {name!r} in {source} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} but "
                f"{self.quant.method} stores a [{out_features}, {in_features}] weight's {part} as "
                f"{'/'.join(str(d).removeprefix('torch.') for d in spec.dtypes)} {list(spec.shape)}", name)
        pending = self._pending.setdefault(weight, {})
        pending[part] = tensor
        if len(pending) < len(self._stored[weight]):
            return None
        del self._pending[weight]
        layout = self.quant.layout
        try:
            kept = layout.integer(pending, out_features, in_features) if self.keep_codes else None
            return weight, kept if kept is not None else layout.dequantize(pending, out_features, in_features)
        except ValueError as e:
            raise CheckpointError(f"{prefix} ({self.quant.method}): {e}", f"{prefix}.{self.quant.layout.marker}") from None


def _weight_of(name: str) -> str:
    """'<prefix>.<part>' -> '<prefix>.weight'."""
    return f"{name.rpartition('.')[0]}.weight"
