"""Each C kernel against the PyTorch op it replaces, at a Qwen3-0.6B layer's decode and prefill sizes.

Run by hand (not a test):
    .venv/bin/python bench/kernels_bench.py [--threads N] [--repeat N]

Prints, per kernel and size, the median time of both paths and their ratio (PyTorch / kernel: above 1 the kernel
wins), and the kernel's saving as a share of one whole decode step of that batch (28 layers' work, measured
here with PyTorch's ops), which is what decides whether a kernel earns its C. For the ops whose kernels were
deleted (RMSNorm, rotary, argmax) it prints PyTorch's share of a step: the most a kernel could give back.

The bf16-weights section (alone with --bf16-weights-only) times the packed product on fp32 and bf16 panels against
F.linear in fp32 and bf16, with each layer cycled through enough copies to overflow the last-level cache (as a
whole model's weights do at decode), and prints the weight bytes read per second at one row next to this machine's
memory bandwidth, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.packed_weight import PackedWeight

# Qwen3-0.6B: hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151936.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 1024, 28, 16, 8, 128, 3072, 151936
BLOCK = 16
PROJECTIONS = {"qkv": (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
               "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def median_s(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def row(name: str, torch_s: float, kernel_s: float, per_step: int, step_s: float | None) -> None:
    share = f"{(torch_s - kernel_s) * per_step / step_s * 100:6.1f}%" if step_s else "     -"
    print(f"{name:38s} torch {torch_s * 1e3:9.3f} ms  kernel {kernel_s * 1e3:9.3f} ms  "
          f"ratio {torch_s / kernel_s:5.2f}x  step saving {share}")


def decode_step_seconds(rows: int, context: int, repeat: int) -> float:
    """One decode step of `rows` sequences with PyTorch's ops alone: 28 layers' projections and attention,
    then the LM head. The denominator of 'step saving'."""

    x = torch.randn(rows, HIDDEN)
    weights = {name: torch.randn(*shape) for name, shape in PROJECTIONS.items()}
    head = torch.randn(VOCAB, HIDDEN)
    backend, k_cache, v_cache, batch = _attention_inputs(rows, context, use_kernel=False)
    meta = backend.prepare(batch, torch.device("cpu"))
    q = torch.randn(rows, HEADS, HEAD_DIM)

    def step() -> None:
        for _ in range(LAYERS):
            for w in weights.values():
                F.linear(x if w.shape[1] == HIDDEN else torch.randn(rows, w.shape[1]), w)
            backend.forward(q, q[:0, :KV_HEADS], q[:0, :KV_HEADS], k_cache, v_cache, meta)
        F.linear(x, head)

    return median_s(step, max(3, repeat // 10))


def _attention_inputs(rows: int, context: int, use_kernel: bool):
    from qwenserve.engine.attention.torch_backend import TorchAttentionBackend
    from qwenserve.models.forward_context import AttentionBatch

    blocks_each = -(-context // BLOCK)
    num_blocks = rows * blocks_each
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    order = torch.randperm(num_blocks).tolist()
    tables = [order[i * blocks_each : (i + 1) * blocks_each] for i in range(rows)]
    batch = AttentionBatch(query_lens=[1] * rows, context_lens=[context] * rows, block_tables=tables,
                           slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=rows)
    return TorchAttentionBackend(BLOCK, loader.load() if use_kernel else None), k_cache, v_cache, batch


def bench_paged_decode(rows: int, context: int, repeat: int, step_s: float | None) -> None:
    q = torch.randn(rows, HEADS, HEAD_DIM)
    times = []
    for use_kernel in (False, True):
        backend, k_cache, v_cache, batch = _attention_inputs(rows, context, use_kernel)
        meta = backend.prepare(batch, torch.device("cpu"))
        times.append(median_s(lambda b=backend, k=k_cache, v=v_cache, m=meta:
                              b.forward(q, q[:0, :KV_HEADS], q[:0, :KV_HEADS], k, v, m), repeat))
    row(f"paged_decode rows={rows} ctx={context}", times[0], times[1], LAYERS, step_s)


def bench_linear(rows: int, repeat: int, step_s: float | None) -> None:
    torch_total = packed_total = 0.0
    for shape in PROJECTIONS.values():
        x, w = torch.randn(rows, shape[1]), torch.randn(*shape)
        packed = PackedWeight.pack(w)
        torch_total += median_s(lambda x=x, w=w: F.linear(x, w), repeat)
        packed_total += median_s(lambda x=x, p=packed: loader.load().linear_packed(x, p), repeat)
    row(f"linear_packed (4 projections) rows={rows}", torch_total, packed_total, LAYERS, step_s)
    x, head = torch.randn(rows, HIDDEN), torch.randn(VOCAB, HIDDEN)
    packed = PackedWeight.pack(head)
    row(f"linear_packed lm_head rows={rows}", median_s(lambda: F.linear(x, head), repeat),
        median_s(lambda: loader.load().linear_packed(x, packed), repeat), 1, step_s)


def bench_returned_ops(rows: int, repeat: int, step_s: float | None) -> None:
    """RMSNorm, rotary and argmax, which run as PyTorch ops since their C kernels were deleted: PyTorch's time
    for a step's worth of each is the most a kernel could save, shown as a share of the step."""
    x, w = torch.randn(rows, HIDDEN), torch.randn(HIDDEN)
    qk, wq = torch.randn(rows * (HEADS + KV_HEADS), HEAD_DIM), torch.randn(HEAD_DIM)
    # Per layer: two hidden-state norms and the q and k head norms.
    norm = 2 * median_s(lambda: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), repeat) + median_s(
        lambda: wq * (qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6)), repeat)
    q = torch.randn(rows, HEADS, HEAD_DIM)
    cos, sin, half = torch.randn(rows, 1, HEAD_DIM), torch.randn(rows, 1, HEAD_DIM), HEAD_DIM // 2
    rotary = median_s(lambda: q * cos + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * sin, repeat)
    logits = torch.randn(rows, VOCAB)
    argmax = median_s(lambda: logits.argmax(dim=-1), repeat)
    for name, seconds, per_step in (("rms_norm (per layer)", norm, LAYERS), ("rotary (q)", rotary, 2 * LAYERS),
                                    ("argmax", argmax, 1)):
        share = f"{seconds * per_step / step_s * 100:6.2f}%" if step_s else "     -"
        print(f"{name + f' rows={rows}':38s} torch {seconds * 1e3:9.3f} ms  (no kernel)      "
              f"at most {share} of a step")


def bench_token_bitmask(rows: int, repeat: int, step_s: float | None) -> None:
    """Structured output's mask (token_bitmask.c) against the PyTorch unpack grammar.py falls back to."""
    from qwenserve.engine.grammar import _BITS

    logits = torch.randn(rows, VOCAB)
    words = (VOCAB + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32)
    index = torch.arange(rows)

    def torch_mask() -> None:
        allowed = _BITS[bitmask.view(torch.uint8).long()].view(rows, -1)[:, :VOCAB]
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    row(f"token_bitmask rows={rows}", median_s(torch_mask, repeat),
        median_s(lambda: loader.load().apply_token_bitmask(logits, index, bitmask), repeat), 1, step_s)


def bench_scatter(tokens: int, repeat: int) -> None:
    """The KV import's scatter into the paged cache (kv_checksum.c), the whole model's layers at once."""
    planes, slots = LAYERS * 2, tokens + 64
    dst = torch.zeros(planes, slots, KV_HEADS * HEAD_DIM)
    src = torch.randn(planes, tokens, KV_HEADS * HEAD_DIM)
    rows = torch.randperm(slots)[:tokens]
    row(f"kv scatter tokens={tokens}", median_s(lambda: dst.index_copy_(1, rows, src), repeat),
        median_s(lambda: loader.load().scatter_rows(dst, src, rows), repeat), 0, None)


def bench_gated_delta(rows: int, repeat: int) -> None:
    """A hybrid model's recurrent update at decode (gated_delta.c) against its PyTorch step, at Qwen3.5's linear
    attention shape (16 value heads of 128, key heads of 128), one layer; the state slots in place."""
    from qwenserve.models.gated_delta import recurrent_gated_delta_step

    heads, dim = 16, 128
    states = torch.randn(max(rows, 8), heads, dim, dim) * 0.01
    q, k = (F.normalize(torch.randn(rows, heads, dim), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(rows, heads, dim), -torch.rand(rows, heads), torch.rand(rows, heads)
    slots = torch.randperm(states.shape[0])[:rows]
    row(f"gated delta step rows={rows}",
        median_s(lambda: recurrent_gated_delta_step(q, k, v, g, beta, states, slots), repeat),
        median_s(lambda: loader.load().gated_delta_step(q, k, v, g, beta, states, slots), repeat), 0, None)


def memory_bandwidth_gbs(megabytes: int, repeat: int) -> float:
    """Bytes read plus bytes written per second by a large tensor copy: what a memory-bound kernel can hope for."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_s(lambda: dst.copy_(src), max(3, repeat // 5)) / 1e9


def cold_median_s(fn: Callable[[object], object], weights: list, repeat: int) -> float:
    """fn(weight) timed with a different copy of the weight at each call, so the weights come from memory."""
    calls = iter(range(10**9))
    return median_s(lambda: fn(weights[next(calls) % len(weights)]), repeat)


def bench_bf16_weights(repeat: int, cold_mb: int) -> None:
    """The packed product on fp32 and bf16 panels and F.linear in fp32 and bf16, per layer shape and row count;
    ratios are F.linear fp32's time over each (above 1: faster than PyTorch fp32)."""
    kernels = loader.load()
    kinds: dict[str, tuple[Callable[[torch.Tensor], object], Callable[[torch.Tensor, object], object]]] = {
        "torch-fp32": (lambda w: w.clone(), lambda x, w: F.linear(x, w)),
        "torch-bf16": (lambda w: w.to(torch.bfloat16), lambda x, w: F.linear(x.to(torch.bfloat16), w)),
        "ours-fp32": (PackedWeight.pack, kernels.linear_packed),
        "ours-bf16-weights": (lambda w: PackedWeight.pack(w, torch.bfloat16), kernels.linear_packed),
    }
    rows_list = (1, 4, 16, 64)
    for n, k in ((3072, HIDDEN), (HIDDEN, INTER)):
        base = torch.randn(n, k)
        seconds: dict[str, dict[int, float]] = {}
        weight_bytes = {}
        for kind, (make, multiply) in kinds.items():
            first = make(base)
            weight_bytes[kind] = first.nbytes
            # Copies enough to overflow the caches; built one kind at a time to bound the memory held.
            copies = [first] + [make(base) for _ in range(-(-cold_mb * 2**20 // first.nbytes) - 1)]
            seconds[kind] = {}
            for rows in rows_list:
                x = torch.randn(rows, k)
                seconds[kind][rows] = cold_median_s(lambda w, x=x, f=multiply: f(x, w), copies, repeat)
            del copies, first
        print(f"-- layer {k}x{n} (x [rows, {k}] -> [rows, {n}]), weights cycled through {cold_mb} MB of copies")
        for kind in kinds:
            times = "  ".join(f"r{rows} {seconds[kind][rows] * 1e3:7.3f} ms ({seconds['torch-fp32'][rows] / seconds[kind][rows]:4.2f}x)"
                              for rows in rows_list)
            print(f"{kind:18s} {times}  1-row {weight_bytes[kind] / seconds[kind][1] / 1e9:5.1f} GB/s of weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--bf16-weights-only", action="store_true", help="run only the bf16-weights section")
    parser.add_argument("--cold-mb", type=int, default=1024,
                        help="bf16-weights section: MB of weight copies each layer cycles through (beyond the LLC)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = loader.load()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here: nothing to compare")
    print(f"threads {args.threads}, torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, kernels {kernels.variant}")
    print(f"-- bf16 weights: memory bandwidth (1 GB tensor copy, read + write) "
          f"{memory_bandwidth_gbs(1024, args.repeat):.1f} GB/s")
    bench_bf16_weights(args.repeat, args.cold_mb)
    if args.bf16_weights_only:
        return
    for rows in (1, 8, 64):
        step_s = decode_step_seconds(rows, 1024, args.repeat)
        print(f"-- decode batch {rows} (context 1024): one PyTorch-only step {step_s * 1e3:.1f} ms")
        bench_paged_decode(rows, 1024, args.repeat, step_s)
        bench_linear(rows, args.repeat, step_s)
        bench_token_bitmask(rows, args.repeat, step_s)
        bench_returned_ops(rows, args.repeat, step_s)
    print("-- prefill chunk of 512 tokens (no step share: prefill is priced per chunk)")
    bench_linear(512, max(5, args.repeat // 5), None)
    bench_returned_ops(512, args.repeat, None)
    print("-- KV import")
    bench_scatter(1024, args.repeat)
    print("-- hybrid models: the recurrent update of one linear-attention layer at decode")
    for rows in (1, 8, 32):
        bench_gated_delta(rows, args.repeat)


if __name__ == "__main__":
    main()
