"""Run under Triton's interpreter (TRITON_INTERPRET=1, set before triton loads): flash-linear-attention's kernels
on CPU tensors, through models/linear_attention_gpu.py's glue, for tests/engine/test_linear_attention_gpu.py.

`python fla_interpreted.py CHECKPOINT PROMPTS_JSON` prints, as JSON, the largest differences between the glue and the
PyTorch forms, the start-up check's verdict, and an engine's greedy tokens with the glue in its ops table (one process: importing is most of it). The chunked kernel's autotuner and one of its loops do not run in the interpreter, so prefill chunks go
through the fused recurrent kernel, which takes the same arguments (the varlen layout, the initial and final
states); the chunked kernel itself is tested on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import torch
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

from qwenserve.models import gated_delta
from qwenserve.models import linear_attention_gpu as gpu
from qwenserve.models.ops import TORCH_OPS

FLA_OPS = dataclasses.replace(
    TORCH_OPS, name="torch+fla (interpreted)", gated_delta_step=gpu.fla_gated_delta_step,
    gated_delta_prefills=functools.partial(gpu.fla_gated_delta_prefills, kernel=fused_recurrent_gated_delta_rule))


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
    prefills = [(2, 1, 3), (3, 5, 1), (8, 70, 5)]
    rows = _inputs(78, heads, dk, dv)
    pre_ref = gated_delta.chunk_gated_delta_prefills(*rows, ours, prefills)
    pre_out = FLA_OPS.gated_delta_prefills(*rows, theirs, prefills)
    return {"step": (step_ref - step_out).abs().max().item(), "prefills": (pre_ref - pre_out).abs().max().item(),
            "states": (ours - theirs).abs().max().item(),
            "others_untouched": bool(torch.equal(theirs[6:], states[6:]))}


def engine(checkpoint: str, prompts: list[list[int]]) -> dict[str, object]:
    from qwenserve.engine.config import EngineConfig
    from qwenserve.engine.engine import LLMEngine
    from qwenserve.engine.sampling_params import SamplingParams
    from qwenserve.models import qwen3

    qwen3.select_ops = lambda device, dtype: FLA_OPS  # what a CUDA device with the package would choose
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
