"""GemLite's W4A16 product (models/gemlite_linear.py) against PyTorch's bf16 F.linear on Qwen3-0.6B's decoder linears,
one GPU, in one run: per call as the engine calls them one after another (launches included), and the kernels alone
(the same calls replayed from a CUDA graph), at the row counts of decode steps and a prefill chunk.

    PYTHONPATH=.venv/gemlite:. python bench/gemlite_linear_bench.py
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from qwenserve.models.gemlite_linear import GemliteWeight

# Qwen3-0.6B: q/k/v fused (1024 -> 4096), o (2048 -> 1024), gate/up fused (1024 -> 6144), down (3072 -> 1024).
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def _ms(fn: Callable[[], object], repeats: int = 50) -> float:
    """Milliseconds a call, `repeats` calls back to back, after warm-up (compilation, autotuning)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _graph_ms(fn: Callable[[], object], repeats: int = 50) -> float | None:
    """The same calls replayed from a CUDA graph (the kernels without Python's launch cost); None where capture fails."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                fn()
        return _ms(graph.replay, 5) / repeats
    except Exception as exc:
        print(f"  (graph capture failed: {exc.__class__.__name__})", flush=True)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{torch.cuda.get_device_name()}: ms a call, eager (launches included) / CUDA graph (kernels)", flush=True)
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
        scales = torch.rand(n, k // 128, generator=generator) * 0.01
        zeros = torch.full((n, k // 128), 8.0)
        weight = GemliteWeight.pack(codes, scales, zeros, 4, 128, None, device, dtype)
        order = torch.arange(k) // 128
        dense = ((codes.float() - zeros[:, order]) * scales[:, order]).to(device=device, dtype=dtype)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=generator).to(device=device, dtype=dtype)
            row = dict(linear=name, rows=rows,
                       torch_ms=_ms(lambda x=x, dense=dense: torch.nn.functional.linear(x, dense)),
                       gemlite_ms=_ms(lambda x=x, weight=weight: weight(x)),
                       torch_graph_ms=_graph_ms(lambda x=x, dense=dense: torch.nn.functional.linear(x, dense)),
                       gemlite_graph_ms=_graph_ms(lambda x=x, weight=weight: weight(x)))
            results.append(row)
            graph = (f"{row['torch_graph_ms']:.4f} / {row['gemlite_graph_ms']:.4f}"
                     if row["torch_graph_ms"] and row["gemlite_graph_ms"] else "n/a")
            print(f"{name:8s} rows {rows:4d}: eager torch {row['torch_ms']:.4f} gemlite {row['gemlite_ms']:.4f} | "
                  f"graph torch / gemlite {graph}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
