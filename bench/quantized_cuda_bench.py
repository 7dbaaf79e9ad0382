"""Quantized checkpoints on CUDA, in one run on one GPU: the random Qwen3 checkpoint of engine_bench.py in bf16, its AWQ
4-bit copy with the codes kept (on CUDA for GemLite's W4A16 kernels, models/gemlite_linear.py; on a CPU for ours) and
the same copy dequantized to bf16 at load (the path without them), and its GPTQ 8-bit copy with the codes kept.

Reported per engine: the kernels chosen, the weights' memory on the GPU, the median decode step at batch 1 and 32
(sampling included) and its tokens/s; then, teacher-forced over every position of a few prompts, the top-1 agreement
of the kept W4A16 with the dequantized W4A16 (the same weights, another product) and of both with bf16, and whether
their greedy continuations are the same. It needs torch, safetensors and transformers (to write the checkpoint), with
gemlite carried beside the repository (scripts/gpu_check.sh).

    PYTHONPATH=.venv/gpu:. python bench/quantized_cuda_bench.py             # Qwen3-0.6B shape
    PYTHONPATH=.venv/gpu:. python bench/quantized_cuda_bench.py --small     # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engine_bench import (  # noqa: E402 - after the path that finds it
    decode_step_seconds,
    make_checkpoint,
    make_quantized_checkpoint,
    top_predictions,
)

from qwenserve.engine.config import EngineConfig  # noqa: E402
from qwenserve.engine.engine import LLMEngine  # noqa: E402
from qwenserve.engine.sampling_params import SamplingParams  # noqa: E402


def measure(name: str, folder: Path, device: str, prompts: list[list[int]], greedy_tokens: int,
            **overrides: object) -> dict:
    """One engine's figures and its predictions on `prompts`."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    # No C kernels: on CUDA they would only mask grammars' logits, and building them is a start-up cost here.
    engine = LLMEngine.from_pretrained(folder, EngineConfig(device=device, dtype="bfloat16", kv_cache_memory_gb=4,
                                                            enable_prefix_caching=False, cpu_kernel=device == "cpu",
                                                            **overrides))
    start_s = time.perf_counter() - started
    kv = engine.runner.kv_cache
    kv_bytes = kv.numel() * kv.element_size()
    weights = torch.cuda.memory_allocated() - before - kv_bytes if cuda else 0
    row = dict(name=name, kernels=engine.precision.name, ops=engine.runner.model.ops.name, start_s=round(start_s, 1),
               weights_gib=round(weights / 2**30, 3))
    print(f"{name}: {row['kernels']} | {row['ops']} | start {start_s:.1f} s | weights {row['weights_gib']} GiB",
          flush=True)
    for batch in (1, 32):
        decode_step_seconds(engine, batch, steps=4)  # warm-up: Triton's compilation and autotuning at this size
        step = decode_step_seconds(engine, batch)
        row[f"step_ms_{batch}"] = round(1e3 * step, 3)
        row[f"tok_s_{batch}"] = round(batch / step, 1)
        print(f"  batch {batch}: {1e3 * step:.2f} ms a step, {batch / step:.0f} tok/s", flush=True)
    row["top"] = [t for per_prompt in top_predictions(engine, prompts) for t in per_prompt]
    row["greedy"] = engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=greedy_tokens,
                                                                 ignore_eos=True))
    engine.shutdown()
    del engine
    gc.collect()  # the next engine's memory is measured from what this one leaves
    return row


def agreement(a: dict, b: dict, margin: float = 0.1) -> str:
    """Teacher-forced top-1 agreement of `a` with `b` over every position, and where b's top-1 leads by `margin`."""
    same = [x[0][0] == y[0][0] for x, y in zip(a["top"], b["top"], strict=True)]
    clear = [i for i, y in enumerate(b["top"]) if y[0][1] - y[1][1] >= margin]
    return (f"{sum(same) / len(same):.1%} of {len(same)} positions, {sum(same[i] for i in clear) / max(len(clear), 1):.1%}"
            f" of the {len(clear)} where {b['name']} leads by >= {margin} nat")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    shape = "small" if args.small else "0.6b"
    print(torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device, "torch", torch.__version__,
          flush=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 8000 if args.small else 150_000) for _ in range(args.length)]
               for _ in range(args.prompts)]
    rows = [measure("bf16", make_checkpoint(shape), args.device, prompts, 32)]
    awq = make_quantized_checkpoint(shape, "W4A16")
    rows.append(measure("W4A16 kept", awq, args.device, prompts, 32))
    rows.append(measure("W4A16 dequantized", awq, args.device, prompts, 32, dequantize_weights=True))
    rows.append(measure("W8A16 kept", make_quantized_checkpoint(shape, "W8A16"), args.device, prompts, 32))
    bf16 = rows[0]
    print("\n| engine | kernels | weights GiB | batch 1 ms (tok/s) | batch 32 ms (tok/s) | x bf16 at 1 |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['ops']} | {r['weights_gib']} | {r['step_ms_1']} ({r['tok_s_1']}) | "
              f"{r['step_ms_32']} ({r['tok_s_32']}) | {bf16['step_ms_1'] / r['step_ms_1']:.2f} |")
    gem, deq = rows[1], rows[2]
    print(f"\nW4A16 kept against W4A16 dequantized: {agreement(gem, deq)}; greedy continuations equal: "
          f"{sum(a == b for a, b in zip(gem['greedy'], deq['greedy'], strict=True))} of {len(prompts)}")
    for r in rows[1:]:
        print(f"{r['name']} against bf16: {agreement(r, bf16)}")
    if args.out:
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k not in ("top", "greedy")}
                                              for r in rows], indent=1))


if __name__ == "__main__":
    main()
