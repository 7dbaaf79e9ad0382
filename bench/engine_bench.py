"""Engine benchmark: our engine vs transformers on the same random checkpoint, plus physical bounds.

Run by hand (not a test):
    .venv/bin/python bench/engine_bench.py --small                  # quick shape, all baselines
    .venv/bin/python bench/engine_bench.py                          # Qwen3-0.6B shape (slow on 2 cores)
    .venv/bin/python bench/engine_bench.py --bounds-only            # memcpy / matmul bounds, batch-1/64 steps
    .venv/bin/python bench/engine_bench.py --precisions             # fp32 vs bf16 KV / weights vs --dtype auto
    .venv/bin/python bench/engine_bench.py --precisions --quantized # + W8A16 (GPTQ) and W4A16 (AWQ) checkpoints
    .venv/bin/python bench/engine_bench.py --quantized-steps        # their decode steps, engines in turn
    .venv/bin/python bench/engine_bench.py --quantized-steps --top-k 20  # the same, sampling as Qwen3 does
    .venv/bin/python bench/engine_bench.py --agreement              # W8A16 / W4A16 top-1 against bf16's
Options: --requests N, --hf-requests N (subset for sequential generate()), --cb-requests N (for transformers'
continuous batching), --skip-transformers.

All figures are measured in the same process run; ratios compare against those figures only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import resource
import statistics
import time
from pathlib import Path

import torch

from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.packed_weight import PackedWeight
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams

SHAPES = {
    # Qwen3-0.6B: hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, vocab 151936, tied.
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, vocab_size=8192, tie_word_embeddings=True),
}


def make_checkpoint(shape: str) -> Path:
    """A random Qwen3 checkpoint of `shape`, written once under /tmp with transformers' save_pretrained."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(f"/tmp/qwenserve-bench/{shape}")
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    cfg = Qwen3Config(max_position_embeddings=4096, **SHAPES[shape])
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(folder)
    return folder


# The quantized rows' checkpoints: the random checkpoint's decoder linears in GPTQ 8-bit and AWQ 4-bit, groups of 128
# (the LM head stays in 16 bits, as Qwen's own AWQ and GPTQ checkpoints leave it).
QUANTIZED = {"W8A16": ("gptq", dict(bits=8, group_size=128)), "W4A16": ("awq", dict(group_size=128))}


def make_quantized_checkpoint(shape: str, name: str) -> Path:
    """make_checkpoint(shape) with its decoder linears quantized as QUANTIZED[name] says, written once under /tmp by
    the formats' writers that the tests use (tests/support/quantized_checkpoints.py)."""
    folder = Path(f"/tmp/qwenserve-bench/{shape}-{name.lower()}")
    if (folder / "config.json").is_file():
        return folder
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, where tests/ lives
    from tests.support.quantized_checkpoints import quantize_checkpoint

    method, options = QUANTIZED[name]
    quantize_checkpoint(make_checkpoint(shape), folder, method, **options)
    return folder


def percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return f"p50 {q[49] * 1e3:.1f} ms, p90 {q[89] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms"


def measure_memcpy_gbps() -> float:
    src = torch.randn(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best / 1e9


def measure_matmul_gflops(hidden: int, inter: int, batch: int = 64, packed_kernel: bool = False) -> float:
    """Best-of rate of the model's largest projection (gate+up) on `batch` rows: PyTorch's BLAS, or with
    `packed_kernel` our CPU kernel on the packed weight."""
    x = torch.randn(batch, hidden)
    w = torch.randn(2 * inter, hidden)
    if packed_kernel:
        packed, kernels = PackedWeight.pack(w), loader.load()

        def product() -> None:
            kernels.linear_packed(x, packed)
    else:

        def product() -> None:
            torch.nn.functional.linear(x, w)
    for _ in range(3):
        product()
    best = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - t)
    return 2 * batch * hidden * 2 * inter / best / 1e9


def workload(n: int, seed: int = 0, prompt_range=(64, 512), out_range=(32, 256), vocab: int = 151936):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outputs


# What a `--top-k` step samples with: Qwen3's generation_config (temperature 0.6, top_p 0.95, top_k 20).
QWEN_SAMPLING = {"temperature": 0.6, "top_p": 0.95}


def run_engine(engine: LLMEngine, prompts, out_lens, top_k: int = 0) -> dict:
    """Submit all requests at once; returns throughput, TTFT, ITL and each request's token arrival times. Greedy, or
    with `top_k` Qwen's sampling settings and that top_k."""
    import asyncio

    chosen = {"temperature": 0.0} if top_k == 0 else {**QWEN_SAMPLING, "top_k": top_k}

    async def one(i: int, t0: float, ttft: list, itl: list, arrivals: list) -> int:
        sampling = SamplingParams(max_tokens=out_lens[i], ignore_eos=True, seed=i, **chosen)
        last, n = None, 0
        async for out in engine.generate(f"bench-{i}-{t0}", prompts[i], sampling):
            now = time.perf_counter()
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last, n = now, n + len(out.new_token_ids)
            arrivals[i].append(now)
        return n

    async def main() -> dict:
        ttft, itl, arrivals = [], [], [[] for _ in prompts]
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, t0, ttft, itl, arrivals) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
        return dict(tokens=sum(counts), wall=wall, tok_s=sum(counts) / wall, ttft=ttft, itl=itl, arrivals=arrivals)

    return asyncio.run(main())


def decode_step_seconds(engine: LLMEngine, batch: int, context: int = 64, steps: int = 8, top_k: int = 0) -> float:
    """Median time of a decode step with exactly `batch` requests decoding (sampling included): the inter-token
    gaps after the last request got its first token and before the first one finished, when every step is
    `batch` one-token rows (earlier steps also carry prompt chunks, later ones fewer rows)."""
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(context)] for i in range(batch)]
    prefill_steps = -(-batch * context // engine.scheduler.limits.max_num_batched_tokens)
    arrivals = run_engine(engine, prompts, [steps + prefill_steps + 2] * batch, top_k)["arrivals"]
    all_decoding, first_done = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    gaps = sorted(b - a for times in arrivals for a, b in itertools.pairwise(times)
                  if all_decoding <= a and b <= first_done)
    assert gaps, "no step had every request decoding"
    return gaps[len(gaps) // 2]


def weight_bytes_held(engine: LLMEngine) -> int:
    """The bytes of the model's weights as the engine holds them: parameters, buffers and packed weights (their
    panels and any bf16 copy kept for PyTorch's product). Counted, not read from RSS: the engine keeps the memory
    an earlier engine freed (host_memory.py), so a process's RSS growth undercounts the next one."""
    from qwenserve.cpu_kernels.packed_weight import PackedWeight
    from qwenserve.engine.quantization.kept import codes_held

    model = engine.runner.model
    held = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    held += sum(w.nbytes for w in codes_held(model))
    if model.lm_head_screen is not None:  # the LM head's 8-bit codes beside it (models/screened_head.py)
        held += model.lm_head_screen.nbytes
    return held + sum(w.nbytes for m in model.modules() for w in vars(m).values() if isinstance(w, PackedWeight))


def measure_read_gbps(threads: int | None) -> float:
    """The best of five sums over 1 GiB of fp32: the rate at which this machine's threads read memory (a decode
    step only reads its weights and KV; memcpy also writes)."""
    data = torch.ones(2**28)
    data.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t)
    return data.nbytes / best / 1e9


def decode_bytes_read(engine: LLMEngine, context: int) -> tuple[int, int]:
    """What one decode step of one sequence at `context` tokens reads: every weight a token passes through in the
    form the decode products read it (packed panels, quantized codes; not the bf16 copies kept for many-row
    products, nor the embedding table, of which it reads one row), and its KV."""
    from qwenserve.engine.quantization.kept import codes_held

    model = engine.runner.model
    read = sum(w.nbytes for w in codes_held(model))
    for module in model.modules():
        read += sum(w.panels.nbytes for w in vars(module).values() if isinstance(w, PackedWeight))
        read += sum(p.nbytes for name, p in module._parameters.items() if p is not None and name != "embed_tokens")
    if model.lm_head_screen is not None:  # a greedy step reads the head's codes, not its panels (but a few)
        read += model.lm_head_screen.nbytes - model.lm_head.panels.nbytes
    cfg = engine.model_config
    kv = len(cfg.kv_layers) * 2 * context * cfg.num_kv_heads * cfg.head_dim * engine.runner.kv_cache.element_size()
    return read, kv


def precision_rates(folder: Path, threads: int | None, context: int = 1000, batches: tuple[int, ...] = (1, 32),
                    long_prompt: int = 2000, quantized: dict[str, Path] | None = None) -> None:
    """Per precision (fp32 throughout; bf16 KV; bf16 weights + bf16 KV; `--dtype auto`, which may add PyTorch's bf16
    product at many rows; and for each of `quantized`'s checkpoints (row name -> folder) its decoder linears kept as
    codes, the rest as in 'bf16 weights + KV', and W4A16 under --dtype auto): decode tokens/s at `context` tokens for each batch size, the time to
    first token of one `long_prompt`-token prompt (its prefill), and the memory its weights take
    (weight_bytes_held), with ratios to fp32; every engine has the same KV budget.
    The batch shares one prompt prefix, so its prefill runs once (prefix caching); every sequence's attention
    still reads its whole context, through its own block table."""
    bf16 = dict(dtype="float32", kv_cache_dtype="bfloat16", cpu_weight_dtype="bfloat16")
    settings = {"float32": (folder, dict(dtype="float32")),
                "bf16 KV": (folder, dict(dtype="float32", kv_cache_dtype="bfloat16")),
                "bf16 weights + KV": (folder, bf16),
                "auto": (folder, {})}
    settings.update({name: (path, bf16) for name, path in (quantized or {}).items()})
    if quantized and "W4A16" in quantized:
        # --dtype auto over the AWQ checkpoint: where the probe allows bf16 products, 4-bit products of many rows run
        # on AMX (models/quantized_linear.py).
        settings["W4A16 auto"] = (quantized["W4A16"], {})
    prefix = [(13 * j) % 1000 + 1 for j in range(context - 8)]
    rows: dict[str, dict[str, float]] = {}
    for name, (path, overrides) in settings.items():
        engine = LLMEngine.from_pretrained(path, EngineConfig(num_threads=threads, kv_cache_memory_gb=1.0,
                                                              max_num_seqs=64, **overrides))
        row = rows[name] = {"weights_gib": weight_bytes_held(engine) / 2**30}
        print(f"{name}: {engine.precision.name} ({engine.precision.reason})", flush=True)
        # Two different long prompts (no prefix shared), the better time: the first also pays first-call costs.
        row["ttft_2k_s"] = min(run_engine(engine, [[(11 * j + r) % 5000 + 7 for j in range(long_prompt)]],
                                          [1])["ttft"][0] for r in range(2))
        run_engine(engine, [prefix + [1]], [2])  # the shared prefix, prefilled (and cached) once
        for batch in batches:
            prompts = [prefix + [(5 * i + j) % 1000 + 1 for j in range(8)] for i in range(batch)]
            arrivals = run_engine(engine, prompts, [12] * batch)["arrivals"]
            all_decoding, first_done = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
            gaps = sorted(b - a for times in arrivals for a, b in itertools.pairwise(times)
                          if all_decoding <= a and b <= first_done)
            row[f"batch {batch} tok/s"] = batch / gaps[len(gaps) // 2]
            if batch == 1:
                weights, kv = decode_bytes_read(engine, context)
                row["batch 1 GB/s read"] = (weights + kv) * row["batch 1 tok/s"] / 1e9
        engine.shutdown()
        del engine
    base = rows["float32"]
    print(f"\n| precision | {' | '.join(base)} |\n|---|{'---|' * len(base)}")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.2f} ({v / base[k]:.2f}x)" for k, v in row.items()) + " |")
    bandwidth = measure_read_gbps(threads)
    print(f"\nmemory read bandwidth (sum over 1 GiB, same threads): {bandwidth:.1f} GB/s; a batch-1 decode step reads "
          + ", ".join(f"{name} {row['batch 1 GB/s read'] / bandwidth:.0%}" for name, row in rows.items()) + " of it")


def interleaved_decode_steps(folder: Path, quantized: dict[str, Path], threads: int | None, rounds: int = 5,
                             batches: tuple[int, ...] = (1, 32), top_k: int = 0) -> None:
    """Decode step times at each batch size for bf16 weights + KV, `--dtype auto` and each quantized checkpoint (as in
    precision_rates), every engine loaded at once and measured in turn, `rounds` times: on a shared machine, load that
    comes and goes then weighs on every row alike. Prints the median of each and its ratio to bf16 weights. Greedy
    steps, or with `top_k` Qwen's sampling settings (QWEN_SAMPLING) and that top_k."""
    bf16 = dict(dtype="float32", kv_cache_dtype="bfloat16", cpu_weight_dtype="bfloat16")
    # "layer by layer": the same engine with --no-fused-decode, what the decode step's per-layer calls cost; "full LM
    # head": with --no-screen-lm-head (the steps are greedy: screened by default, models/screened_head.py).
    head8, full_head = {"quantize_lm_head": "int8"}, {"screen_lm_head": False}
    settings = {"bf16 weights + KV": (folder, bf16), "auto": (folder, {}), "auto, full LM head": (folder, full_head),
                "auto, layer by layer": (folder, {"fused_decode": False}), "auto, LM head 8-bit": (folder, head8),
                **{name: (path, bf16) for name, path in quantized.items()}}
    if "W4A16" in quantized:
        settings["W4A16 auto"] = (quantized["W4A16"], {})
        settings["W4A16 auto, full LM head"] = (quantized["W4A16"], full_head)
        settings["W4A16 auto, layer by layer"] = (quantized["W4A16"], {"fused_decode": False})
        settings["W4A16 auto, LM head 8-bit"] = (quantized["W4A16"], head8)
    engines = {}
    for name, (path, overrides) in settings.items():
        engines[name] = LLMEngine.from_pretrained(path, EngineConfig(num_threads=threads, kv_cache_memory_gb=0.5,
                                                                     max_num_seqs=64, **overrides))
        print(f"{name}: {engines[name].precision.name}; ops {engines[name].kernels.ops.name}", flush=True)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for batch in batches:
            for name, engine in engines.items():
                times.setdefault((name, batch), []).append(decode_step_seconds(engine, batch, top_k=top_k))
    for engine in engines.values():
        engine.shutdown()
    steps = "greedy" if top_k == 0 else f"sampled: top_k {top_k}, " + ", ".join(f"{k} {v}" for k, v in QWEN_SAMPLING.items())
    print(f"\n| decode step ({steps}), median of {rounds} interleaved rounds | "
          + " | ".join(f"batch {b}" for b in batches)
          + f" |\n|---|{'---|' * len(batches)}")
    for name in engines:
        cells = []
        for batch in batches:
            ms, base = statistics.median(times[name, batch]), statistics.median(times["bf16 weights + KV", batch])
            cells.append(f"{ms * 1e3:.1f} ms, {batch / ms:.1f} tok/s ({base / ms:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if "W4A16 auto" in engines:
        # Issue 30's measure, W4A16 over bf16 (`auto` on both checkpoints), paired within each round: the two are
        # measured seconds apart, so the machine's drift over the rounds (10-20% on a shared VM) leaves the ratio.
        pairs = [("W4A16 auto", "auto"), ("W4A16 auto, full LM head", "auto, full LM head"),
                 ("auto", "auto, full LM head"), ("W4A16 auto", "W4A16 auto, full LM head")]
        for batch in batches:
            for faster, slower in pairs:
                ratios = [a / w for a, w in zip(times[slower, batch], times[faster, batch], strict=True)]
                print(f"\n{faster} over {slower} at batch {batch}, each round's pair: "
                      + ", ".join(f"{r:.2f}x" for r in ratios) + f" (median {statistics.median(ratios):.2f}x)")


def top_predictions(engine: LLMEngine, prompts: list[list[int]]) -> list[list[tuple[tuple[int, float], ...]]]:
    """Teacher-forced: for every position of every prompt after its first, the model's two most likely next tokens
    with their logprobs (prompt_logprobs), best first."""
    outputs = engine.generate_sync_outputs(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    return [[entry.top for entry in next(o for o in outs if o.prompt_logprobs is not None).prompt_logprobs]
            for outs in outputs]


def agreement(folder: Path, quantized: dict[str, Path], threads: int | None, prompts: int = 4,
              length: int = 256, margin: float = 0.1) -> None:
    """Teacher-forced top-1 agreement of each quantized checkpoint's engine (codes kept) with the bf16 engine over
    every position of `prompts` prompts of `length` tokens, as the field report judged its W4A16 choice: over all
    positions, and over those where bf16's top-1 leads its top-2 by at least `margin` nats (a clear choice)."""
    rng = random.Random(3)
    texts = [[rng.randrange(0, 150_000) for _ in range(length)] for _ in range(prompts)]
    settings = {"bf16": (folder, dict(dtype="bfloat16")),
                "bf16, LM head 8-bit": (folder, dict(dtype="bfloat16", quantize_lm_head="int8")),
                **{name: (path, dict(dtype="bfloat16")) for name, path in quantized.items()}}
    if "W4A16" in quantized:
        settings["W4A16, LM head 8-bit"] = (quantized["W4A16"], dict(dtype="bfloat16", quantize_lm_head="int8"))
    tops = {}
    for name, (path, overrides) in settings.items():
        engine = LLMEngine.from_pretrained(path, EngineConfig(num_threads=threads, kv_cache_memory_gb=0.5,
                                                              enable_prefix_caching=False, **overrides))
        print(f"{name}: {engine.precision.name}", flush=True)
        tops[name] = [top for per_prompt in top_predictions(engine, texts) for top in per_prompt]
        engine.shutdown()
    reference = tops["bf16"]
    clear = [i for i, top in enumerate(reference) if top[0][1] - top[1][1] >= margin]
    print(f"\n| against bf16, {len(reference)} positions ({prompts} x {length - 1}) | top-1 agreement | "
          f"where bf16 leads by >= {margin} nat ({len(clear)} positions) |\n|---|---|---|")
    for name in (n for n in settings if n != "bf16"):
        same = [tops[name][i][0][0] == reference[i][0][0] for i in range(len(reference))]
        print(f"| {name} | {sum(same) / len(same):.1%} | {sum(same[i] for i in clear) / max(len(clear), 1):.1%} |")


def transformers_baselines(folder: Path, prompts, out_lens, hf_requests: int, cb_requests: int) -> dict:
    """tok/s of: sequential generate() on the first `hf_requests`; padded batches of the first 8 and 32;
    continuous batching (generate_batch) on the first `cb_requests`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    res = {}
    sub_p, sub_o = prompts[:hf_requests], out_lens[:hf_requests]
    with torch.inference_mode():
        t = time.perf_counter()
        n = 0
        for p, o in zip(sub_p, sub_o, strict=True):
            model.generate(torch.tensor([p]), max_new_tokens=o, min_new_tokens=o, do_sample=False, pad_token_id=0)
            n += o
        res["sequential"] = n / (time.perf_counter() - t)
        for bs in (8, 32):
            if bs > len(prompts):
                continue
            bp, bo = prompts[:bs], out_lens[:bs]
            width = max(len(p) for p in bp)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in bp])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in bp])
            t = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=max(bo), min_new_tokens=max(bo),
                           do_sample=False, pad_token_id=0)
            # Only each request's own output length is useful work.
            res[f"padded_batch_{bs}"] = sum(bo) / (time.perf_counter() - t)
        # Continuous batching gets the whole workload, as ours does: batching is what it is for.
        sub_p, sub_o = prompts[:cb_requests], out_lens[:cb_requests]
        gen = GenerationConfig(max_new_tokens=max(sub_o), min_new_tokens=max(sub_o), do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        try:
            t = time.perf_counter()
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            # Size its KV cache for this workload: left to itself on CPU it claims most of the RAM.
            need = sum(len(p) for p in sub_p) + len(sub_p) * max(sub_o)
            cb = ContinuousBatchingConfig(num_blocks=need // 256 + 2 * len(sub_p), max_batch_tokens=512)
            outs = model.generate_batch(inputs=sub_p, generation_config=gen, continuous_batching_config=cb,
                                        warmup=False)
            produced = sum(len(o.generated_tokens) for o in outs.values())
            res["continuous_batching"] = produced / (time.perf_counter() - t)
        except Exception as exc:  # report, do not hide: the baseline is optional in old transformers
            res["continuous_batching_error"] = f"{type(exc).__name__}: {exc}"
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hf-requests", type=int, default=8, help="requests for sequential generate()")
    ap.add_argument("--cb-requests", type=int, default=32, help="requests for transformers' continuous batching")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--bounds-only", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-gb", type=float, default=4.0, help="KV cache size (allocated up front)")
    ap.add_argument("--token-budget", type=int, default=None, help="max_num_batched_tokens (default: the engine's)")
    ap.add_argument("--precisions", action="store_true",
                    help="only decode tok/s at ~1,000 tokens of context, a 2,000-token prefill and memory, for fp32, "
                         "bf16 KV, bf16 weights + KV and --dtype auto")
    ap.add_argument("--quantized", action="store_true",
                    help="with --precisions: W8A16 (GPTQ 8-bit) and W4A16 (AWQ 4-bit) rows too, groups of 128, "
                         "on the same random weights quantized")
    ap.add_argument("--quantized-steps", action="store_true",
                    help="only decode step times at batch 1 and 32 of bf16 weights, auto, W8A16 and W4A16, the "
                         "engines measured in turn (robust to load on a shared machine)")
    ap.add_argument("--rounds", type=int, default=5, help="with --quantized-steps: interleaved rounds")
    ap.add_argument("--top-k", type=int, default=0,
                    help="with --quantized-steps: the steps sample with this top_k, temperature 0.6 and top_p 0.95 "
                         "(Qwen3's generation_config) instead of greedily")
    ap.add_argument("--agreement", action="store_true",
                    help="only the teacher-forced top-1 agreement of W8A16 and W4A16 with bf16 on the same weights")
    args = ap.parse_args()
    shape = "small" if args.small else "0.6b"
    spec = SHAPES[shape]
    folder = make_checkpoint(shape)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.agreement:
        agreement(folder, {name: make_quantized_checkpoint(shape, name) for name in QUANTIZED}, args.threads)
        return
    if args.quantized_steps:
        interleaved_decode_steps(folder, {name: make_quantized_checkpoint(shape, name) for name in QUANTIZED},
                                 args.threads, rounds=args.rounds, top_k=args.top_k)
        return
    if args.precisions:
        quantized = {name: make_quantized_checkpoint(shape, name) for name in QUANTIZED} if args.quantized else None
        precision_rates(folder, args.threads, quantized=quantized)
        return
    print(f"shape {shape}: {json.dumps(spec)}; torch threads {torch.get_num_threads()}; "
          f"token budget {args.token_budget or 'the engine default'}")
    # Bounds are measured before the engine thread exists, so no second thread pool competes for the cores.
    memcpy = measure_memcpy_gbps()
    matmul = measure_matmul_gflops(spec["hidden_size"], spec["intermediate_size"])
    kernel_matmul = (measure_matmul_gflops(spec["hidden_size"], spec["intermediate_size"], packed_kernel=True)
                     if loader.load() is not None else None)
    config = EngineConfig(num_threads=args.threads, kv_cache_memory_gb=args.kv_gb,
                          max_num_batched_tokens=args.token_budget, max_num_seqs=128)
    engine = LLMEngine.from_pretrained(folder, config)
    # Packed weights are no longer parameters (nor checkpoint targets once packed): count them in the checkpoint.
    from safetensors import safe_open

    params = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            params += sum(torch.Size(f.get_slice(name).get_shape()).numel() for name in f.keys())
    weight_bytes = params * 4
    # Every decode step reads all matrices once: layers + the (tied) LM head; the embedding lookup is tiny.
    layer_params = params - spec["vocab_size"] * spec["hidden_size"] * (1 if spec["tie_word_embeddings"] else 2)
    step_flops_per_token = 2 * (layer_params + spec["vocab_size"] * spec["hidden_size"])
    print(f"weights {weight_bytes / 1e9:.2f} GB; memcpy {memcpy:.1f} GB/s; fp32 matmul (64 rows) {matmul:.1f} GFLOP/s"
          + (f" (BLAS), {kernel_matmul:.1f} GFLOP/s (our packed kernel)" if kernel_matmul else ""))

    run_engine(engine, [[1, 2, 3]], [4])  # warm-up
    step1 = decode_step_seconds(engine, 1)
    bound1 = weight_bytes / (memcpy * 1e9)
    print(f"decode step, batch 1: {step1 * 1e3:.1f} ms; bound weights/memcpy {bound1 * 1e3:.1f} ms "
          f"-> {bound1 / step1:.0%} of bound (target >= 80%)")
    step64 = decode_step_seconds(engine, 64)
    rate64 = 64 * step_flops_per_token / step64 / 1e9
    print(f"decode step, batch 64: {step64 * 1e3:.1f} ms = {rate64:.1f} GFLOP/s "
          f"-> {rate64 / matmul:.0%} of measured matmul rate (target >= 60%)"
          + (f"; {rate64 / kernel_matmul:.0%} of our kernel's rate" if kernel_matmul else ""))
    if args.bounds_only:
        engine.shutdown()
        return

    vocab = spec["vocab_size"]
    prompts, out_lens = workload(args.requests, vocab=vocab)
    ours = run_engine(engine, prompts, out_lens)
    stats = engine.stats()
    print(f"\nours: {args.requests} requests together, {ours['tokens']} output tokens in {ours['wall']:.1f} s "
          f"= {ours['tok_s']:.1f} tok/s; preemptions {stats.preemptions}")
    print(f"  TTFT {percentiles(ours['ttft'])}")
    print(f"  ITL  {percentiles(ours['itl'])}")
    engine.shutdown()
    if not args.skip_transformers:
        hf_n, cb_n = min(args.hf_requests, args.requests), min(args.cb_requests, args.requests)
        hf = transformers_baselines(folder, prompts, out_lens, hf_n, cb_n)
        print(f"\ntransformers (tok/s; rates compared directly): sequential on the first {hf_n} requests, "
              f"padded batches on the first 8 and 32, continuous batching on the first {cb_n}:")
        for k, v in hf.items():
            if isinstance(v, float):
                print(f"  {k:22s} {v:8.2f} tok/s   ours/them = {ours['tok_s'] / v:.1f}x")
            else:
                print(f"  {k}: {v}")
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
