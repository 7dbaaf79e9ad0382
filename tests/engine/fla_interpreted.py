"""Run under Triton's interpreter (TRITON_INTERPRET=1, set before triton loads): flash-linear-attention's kernels
on CPU tensors, through models/linear_attention_gpu.py's glue, for tests/engine/test_linear_attention_gpu.py.

`python fla_interpreted.py CHECKPOINT PROMPTS_JSON` prints, as JSON, the largest differences between the glue and the
PyTorch forms, the start-up check's verdict, and an engine's greedy tokens with the glue in its ops table (one
process: importing is most of it).

The interpreter lacks two things the chunked kernel needs, supplied here for this process only: the autotuner's
timing (there is no device to time: every configuration is as good, the first is taken) and Triton scalars from a
kernel's `for ... in range(...)` loop (the compiler's loop yields them, the interpreter's plain ints, which lack
`.to`). The kernels' own code runs unchanged.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import sys
from collections.abc import Iterator

import numpy as np
import torch
import triton.language as tl
from triton.runtime import autotuner
from triton.runtime.interpreter import TensorHandle

from qwenserve.models import gated_delta
from qwenserve.models import linear_attention_gpu as gpu
from qwenserve.models.gated_delta import PrefillChunks
from qwenserve.models.ops import TORCH_OPS

#: The flash-linear-attention modules whose kernels loop with `range` over values they then call `.to` on.
KERNEL_LOOP_MODULES = ("fla.ops.common.chunk_delta_h",)


def _kernel_range(*bounds: object) -> Iterator[tl.tensor]:
    """`range` as a compiled kernel's loop sees it: int32 scalars."""
    values = [b.handle.data.item() if isinstance(b, tl.tensor) else b for b in bounds]
    for i in builtins.range(*values):
        yield tl.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def _make_interpretable() -> None:
    import importlib

    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]
    for name in KERNEL_LOOP_MODULES:
        importlib.import_module(name).range = _kernel_range  # the module's kernels only: its host code has no loops


_make_interpretable()
FLA_OPS = dataclasses.replace(TORCH_OPS, name="torch+fla (interpreted)", gated_delta_step=gpu.fla_gated_delta_step,
                              gated_delta_prefills=gpu.fla_gated_delta_prefills)


def _inputs(n: int, heads: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    q = gated_delta.l2_normalize(torch.randn(n, heads, dk)) * dk**-0.5
    k = gated_delta.l2_normalize(torch.randn(n, heads, dk))
    return q, k, torch.randn(n, heads, dv), -0.5 * torch.rand(n, heads), torch.rand(n, heads)


def ops() -> dict[str, float | bool]:
    torch.manual_seed(0)
    heads, dk, dv = 4, 16, 8
    states = 0.1 * torch.randn(8, heads, dk, dv)  # slots 6 and 7 belong to no sequence here
    ours, theirs = states.clone(), states.clone()
    slots = torch.tensor([4, 0, 2])
    step = _inputs(3, heads, dk, dv)
    step_ref = gated_delta.recurrent_gated_delta_step(*step, ours, slots)
    step_out = gpu.fla_gated_delta_step(*step, theirs, slots)
    # Three chunks at slots 3, 1, 5 after two decode rows: one token, a few, more than one 64-token chunk.
    prefills = PrefillChunks([(2, 1, 3), (3, 5, 1), (8, 70, 5)])
    rows = _inputs(78, heads, dk, dv)
    pre_ref = gated_delta.chunk_gated_delta_prefills(*rows, ours, prefills)
    pre_out = FLA_OPS.gated_delta_prefills(*rows, theirs, prefills)
    return {"step": (step_ref - step_out).abs().max().item(), "prefills": (pre_ref - pre_out).abs().max().item(),
            "states": (ours - theirs).abs().max().item(),
            "others_untouched": bool(torch.equal(theirs[6:], states[6:]))}


def engine(checkpoint: str, prompts: list[list[int]]) -> dict[str, object]:
    from qwenserve.engine import kernels
    from qwenserve.engine.config import EngineConfig
    from qwenserve.engine.engine import LLMEngine
    from qwenserve.engine.sampling_params import SamplingParams

    kernels.model_ops = lambda config, device, dtype, cpu: FLA_OPS  # what a CUDA device with the package chooses
    llm = LLMEngine.from_pretrained(checkpoint, EngineConfig(num_kv_blocks=64, block_size=8, num_threads=2,
                                                             max_num_batched_tokens=48))
    try:
        tokens = llm.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        return {"ops": llm.runner.model.ops.name, "tokens": tokens}
    finally:
        llm.shutdown()


def self_check() -> bool:
    """The start-up check an engine on CUDA runs before it takes flash-linear-attention's kernels."""
    return gpu._self_check("flash-linear-attention", gpu.delta_rule_check(
        FLA_OPS.gated_delta_step, FLA_OPS.gated_delta_prefills, torch.device("cpu")))


if __name__ == "__main__":
    print(json.dumps({"ops": ops(), "self_check": self_check(),
                      "engine": engine(sys.argv[1], json.loads(sys.argv[2]))}))
