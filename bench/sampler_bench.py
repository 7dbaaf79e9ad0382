"""The sampler's cost a step: ours against the textbook draw, on rows of the Qwen vocabulary.

Run by hand (not a test):
    .venv/bin/python bench/sampler_bench.py [--rows 1,8,32] [--threads 2]

Baseline, timed in the same run on the same logits: the exponential race every PyTorch sampler writes first
(softmax, a sort of the vocabulary for top-k / top-p, then argmax(probs / E) with E ~ Exp(1) drawn for every
entry), and torch.argmax for greedy rows. Ours: `Sampler` (engine/sampler.py) as the engine builds it, with the C
kernels where they load (the whole-vocabulary draw in one call, categorical_draw.c), and without them (PyTorch's
forms only). Settings: greedy;
temperature 1 (the OpenAI API's default); Qwen3's generation_config (temperature 0.6, top_k 20, top_p 0.95), which
`--generation-config auto` applies to every request that leaves them out. Prints ms a call and the ratio.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from qwenserve.cpu_kernels import loader
from qwenserve.engine.sampler import Sampler, SamplingRow
from qwenserve.engine.sampling_params import SamplingParams

VOCAB = 151_936
SETTINGS = {"greedy": SamplingParams(temperature=0.0), "temperature 1": SamplingParams(temperature=1.0),
            "Qwen3 defaults": SamplingParams(temperature=0.6, top_k=20, top_p=0.95)}


def textbook(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """The baseline: a full-vocabulary sort for top-k / top-p and one exponential per entry."""
    if p.greedy:
        return logits.argmax(dim=-1)
    scaled = logits / p.temperature
    if p.top_k or p.top_p < 1.0:
        values, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(values.shape[1])[None, :]
        remove = (ranks >= (p.top_k or values.shape[1])).expand_as(values).clone()
        probs = torch.softmax(values.masked_fill(remove, float("-inf")), dim=-1)
        remove |= (probs.cumsum(dim=-1) - probs) >= p.top_p
        scaled = scaled.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)


def best_ms(run: Callable[[], object], seconds: float = 0.5) -> float:
    run()
    calls, started = 0, time.perf_counter()
    best = float("inf")
    while time.perf_counter() - started < seconds or calls < 3:
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
        calls += 1
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32", help="batch sizes")
    parser.add_argument("--threads", type=int, default=2, help="PyTorch threads (the engine's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    kernels = loader.load()
    sampler, torch_only = Sampler(seed=0, cpu_kernels=kernels), Sampler(seed=0)
    print(f"sampler_bench: {VOCAB}-entry rows, {args.threads} threads, C kernels {kernels.variant if kernels else 'none'}"
          "; ms a call, best of repeated calls")
    print("| rows | setting | textbook | ours, PyTorch only | ours | ratio to textbook |\n|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, VOCAB, generator=generator) * 3  # a peaked row, as a trained model's
        for name, p in SETTINGS.items():
            sampling_rows = [SamplingRow(p, [], []) for _ in range(rows)]
            base = best_ms(lambda x=logits, p=p: textbook(x, p, generator))
            plain = best_ms(lambda x=logits, r=sampling_rows: torch_only(x, r))
            ours = best_ms(lambda x=logits, r=sampling_rows: sampler(x, r))
            print(f"| {rows} | {name} | {base:.2f} | {plain:.2f} | {ours:.2f} | {base / ours:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
