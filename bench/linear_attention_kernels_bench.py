"""The Gated DeltaNet recurrences through flash-linear-attention and causal-conv1d against PyTorch's forms, in one run
on one device: the ops a Qwen3.5 linear-attention layer runs at prefill and at decode (models/linear_attention_gpu.py
against models/gated_delta.py), each timed and checked against the other.

Reported: for a step's prefill chunks (`--prefills` sequences of `--chunk` tokens), the decode step at several batch
sizes and, where causal-conv1d imports, the decode convolution: milliseconds per call for both, the speed-up, and the
largest difference in the outputs and the states. It needs nothing but torch and the kernel packages, so it runs on
a bare GPU machine with fla-core carried beside the repository (scripts/gpu_check.sh).

    PYTHONPATH=.venv/fla:. python bench/linear_attention_kernels_bench.py           # 0.8B shapes
    PYTHONPATH=.venv/fla:. python bench/linear_attention_kernels_bench.py --small   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from qwenserve.models import gated_delta
from qwenserve.models import linear_attention_gpu as gpu
from qwenserve.models.gated_delta import PrefillChunks

# Qwen3.5-0.8B's linear layers: 16 key heads and 16 value heads of 128, a 4-tap convolution.
SHAPES = {"0.8b": dict(heads=16, dk=128, dv=128, conv_taps=4), "small": dict(heads=4, dk=16, dv=16, conv_taps=4)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: compilation, autotuning
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _rows(n: int, heads: int, dk: int, dv: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    q = gated_delta.l2_normalize(torch.randn(n, heads, dk, device=device)) * dk**-0.5
    k = gated_delta.l2_normalize(torch.randn(n, heads, dk, device=device))
    return (q, k, torch.randn(n, heads, dv, device=device), -0.5 * torch.rand(n, heads, device=device),
            torch.rand(n, heads, device=device))


def _compare(name: str, ours: Callable[[torch.Tensor], torch.Tensor], theirs: Callable[[torch.Tensor], torch.Tensor],
             states: torch.Tensor, device: torch.device, repeats: int) -> dict[str, object]:
    """Run both on copies of `states` once to compare, then time each on its own copy."""
    a, b = states.clone(), states.clone()
    expected, got = ours(a), theirs(b)
    row = {"case": name, "out_max_diff": (got.float() - expected.float()).abs().max().item(),
           "state_max_diff": (b.float() - a.float()).abs().max().item()}
    row["torch_ms"] = _ms(lambda: ours(a), device, repeats)
    row["kernel_ms"] = _ms(lambda: theirs(b), device, repeats)
    row["speedup"] = row["torch_ms"] / row["kernel_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny shape")
    parser.add_argument("--prefills", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="also write the rows here, as JSON")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = SHAPES["small" if args.small else "0.8b"]
    heads, dk, dv = shape["heads"], shape["dk"], shape["dv"]
    chunk = 24 if args.small else args.chunk
    batches = [1, 3] if args.small else [int(b) for b in args.batches.split(",")]
    repeats = 2 if args.small else args.repeats
    torch.manual_seed(0)
    slots = max(max(batches), args.prefills) + 2
    states = 0.1 * torch.randn(slots, heads, dk, dv, device=device)
    rows = []

    prefills = PrefillChunks([(i * chunk, chunk, slots - 1 - i) for i in range(args.prefills)])
    x = _rows(chunk * args.prefills, heads, dk, dv, device)
    rows.append(_compare(
        f"prefill {args.prefills}x{chunk} tokens",
        lambda s: gated_delta.chunk_gated_delta_prefills(*x, s, prefills),
        lambda s: gpu.fla_gated_delta_prefills(*x, s, prefills), states, device, repeats))
    for batch in batches:
        x = _rows(batch, heads, dk, dv, device)
        index = torch.arange(batch, device=device)
        rows.append(_compare(
            f"decode step, batch {batch}", lambda s, x=x, i=index: gated_delta.recurrent_gated_delta_step(*x, s, i),
            lambda s, x=x, i=index: gpu.fla_gated_delta_step(*x, s, i), states, device, repeats))
    if device.type == "cuda" and gpu.causal_conv1d_available():
        channels, taps = 2 * heads * dk + heads * dv, shape["conv_taps"]
        weight = torch.randn(channels, taps, device=device, dtype=torch.bfloat16)
        conv = torch.randn(slots, channels, taps - 1, device=device, dtype=torch.bfloat16)
        for batch in batches:
            x = torch.randn(batch, channels, device=device, dtype=torch.bfloat16)
            index = torch.arange(batch, device=device)
            rows.append(_compare(
                f"decode convolution (bf16), batch {batch}",
                lambda s, x=x, i=index: gated_delta.short_conv_step(x, s, weight, i),
                lambda s, x=x, i=index: gpu.causal_conv1d_step(x, s, weight, i), conv, device, repeats))
    else:
        rows.append({"case": "decode convolution", "skipped": "causal-conv1d does not import here (or no CUDA)"})

    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
              "torch": torch.__version__, "shape": shape, "rows": rows}
    for row in rows:
        if "skipped" in row:
            print(f"{row['case']:<40} skipped: {row['skipped']}")
        else:
            print(f"{row['case']:<40} torch {row['torch_ms']:9.3f} ms  kernel {row['kernel_ms']:9.3f} ms  "
                  f"x{row['speedup']:6.2f}  max diff out {row['out_max_diff']:.2e} state {row['state_max_diff']:.2e}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
