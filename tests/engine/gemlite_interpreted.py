"""Run under Triton's interpreter (TRITON_INTERPRET=1, set before triton loads): GemLite's W4A16 / W8A16 kernels on CPU
tensors, through models/gemlite_linear.py's glue, for tests/engine/test_gemlite_linear.py.

`python gemlite_interpreted.py` prints, as JSON, the largest relative difference between the glue's product and
PyTorch's on the dequantized weight for each case.

GemLite asks the CUDA driver for the device's name and target when it loads and when it picks a kernel; with no GPU
here, this process answers as a Hopper card would (for this process only), and the autotuner, which has no device
to time, takes each kernel's first configuration. The interpreter cannot add bf16 atomically (numpy has no bf16), so
the activations here are fp16; GemLite's own code runs unchanged.
"""

from __future__ import annotations

import json
import types

import torch
import triton.runtime
from triton.backends.compiler import GPUTarget
from triton.runtime import autotuner


class _Utils:
    @staticmethod
    def get_device_properties(*_: object) -> dict[str, int]:
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}


class _Hopper:
    utils = _Utils()

    @staticmethod
    def get_current_target() -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    @staticmethod
    def get_current_device() -> int:
        return 0


def _make_interpretable() -> None:
    triton.runtime.driver.set_active(_Hopper())
    torch.cuda.get_device_properties = lambda *_, **__: types.SimpleNamespace(  # type: ignore[assignment]
        name="interpreted", major=9, minor=0, multi_processor_count=132)
    torch.cuda.get_device_capability = lambda *_, **__: (9, 0)  # type: ignore[assignment]
    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]


_make_interpretable()

from qwenserve.models import gemlite_linear  # noqa: E402 - after the stand-ins it loads against
from qwenserve.models.ops import TORCH_OPS  # noqa: E402


def _case(bits: int, act_order: bool, rows: int, generator: torch.Generator) -> float:
    """Largest difference of a product through the glue from PyTorch's on the dequantized weight, relative to the
    largest value; the weight has a bias and x is [1, rows, k] (the model's 3-D activations). One row runs GemLite's
    GEMV kernel, 33 its GEMM; the interpreter runs no other sizes (their kernels loop over Triton scalars it lacks),
    which scripts/gpu_check.sh's engines run on the GPU."""
    n, k, group_size = 80, 256, 64
    codes = torch.randint(0, 1 << bits, (n, k), generator=generator, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=generator) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group_size), generator=generator).float()
    order = torch.arange(k) // group_size
    if act_order:
        order = order[torch.randperm(k, generator=generator)]
    weight = gemlite_linear.GemliteWeight.pack(codes, scales, zeros, bits, group_size, order if act_order else None,
                                               torch.device("cpu"), torch.float16)
    assert (weight.perm is not None) == act_order
    dense = ((codes.float() - zeros[:, order]) * scales[:, order]).half()
    bias = torch.randn(n, generator=generator).half()
    x = torch.randn(1, rows, k, generator=generator).half()
    ops = gemlite_linear.with_gemlite_linears(TORCH_OPS, f"w{bits}a16")
    ours = ops.linear(x, weight, bias).float()
    want = x.float() @ dense.float().T + bias.float()
    assert ours.shape == want.shape
    return float((ours - want).abs().max()) / float(want.abs().max())


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    found = {f"w{bits}a16 act_order={act_order} rows={rows}": _case(bits, act_order, rows, generator)
             for bits in (4, 8) for act_order in (False, True) for rows in (1, 33)}
    print(json.dumps({"products": found}))


if __name__ == "__main__":
    main()
