"""Experiment 2: prefix caching on vs off, `shared-prefix` mix (a system prompt that is 90% of each prompt).

Two views of the same workload (1000-token prompts, 900 of them a shared system prompt, 50-100 output
tokens; full size, nothing scaled), closed loop at concurrency 1 so TTFT is prefill time, not queueing:
- engine: the in-process engine with EngineConfig.enable_prefix_caching True vs False (the workers have
  no flag to turn the cache off; see the report);
- cluster: a colocated `qwen-serve up` over gRPC, every request with the same (empty) cache salt vs a fresh
  cache_salt per request (`--cold`), which keeps each request out of the others' cached blocks.
The first request of a "cached" run is necessarily cold; the figures below exclude it (warm = requests 2..n).
Target: TTFT with the cache <= 20% of cold.

  .venv/bin/python bench/experiment_prefix_cache.py --num-requests 20
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen_common import cluster, common_args, figures, model_path, run  # noqa: E402

from qwenserve.loadgen.cli import BenchConfig, RunOutcome, bench  # noqa: E402
from qwenserve.loadgen.stats import distribution  # noqa: E402
from qwenserve.loadgen.targets import EngineTarget  # noqa: E402


def warm_ttft_ms(o: RunOutcome) -> tuple[float, float, float]:
    """p50 / p90 TTFT of requests 2..n (ms) and their mean cached-token share."""
    recs = [r for r in o.result.records if r.ok and r.index > 0 and r.ttft is not None]
    d = distribution([r.ttft for r in recs])
    cached = sum(r.usage_cached_tokens or 0 for r in recs) / max(1, sum(r.input_tokens for r in recs))
    return d.p50, d.p90, cached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, duration=120.0, scale=1.0)
    parser.add_argument("--num-requests", type=int, default=20)
    args = parser.parse_args()
    model = model_path(args.model)
    results: dict[str, RunOutcome] = {}

    def config(label: str, target: str, **kw: object) -> BenchConfig:
        return BenchConfig(target=target, mix="shared-prefix", scale=args.scale, concurrencies=[1],
                           num_requests=args.num_requests, duration_s=args.duration, seed=args.seed, label=label,
                           progress=sys.stderr.isatty(), out_dir=args.out / label if args.out else None, **kw)

    for on in (False, True):
        label = f"engine cache={'on' if on else 'off'}"
        target = EngineTarget(model, enable_prefix_caching=on, num_threads=1, kv_cache_memory_gb=0.25)
        [results[label]] = asyncio.run(bench(config(label, f"engine:{model}"), target=target))
    with cluster(model, prefill=0, decode=1, env={}) as c:
        for cold in (True, False):
            label = f"cluster {'cold (salted)' if cold else 'shared'}"
            results[label] = run(config(label, f"grpc://127.0.0.1:{c.router_port}",
                                        target_options={"cache_salt_per_request": cold}))
    print()
    for label, o in results.items():
        p50, p90, cached = warm_ttft_ms(o)
        print(figures(label, o.summary))
        print(f"{'':<28} requests 2..n: TTFT p50={p50:7.1f} p90={p90:7.1f} ms, cached share of prompt={cached:.0%}")
    for off, on in (("engine cache=off", "engine cache=on"), ("cluster cold (salted)", "cluster shared")):
        ratio = warm_ttft_ms(results[on])[0] / warm_ttft_ms(results[off])[0]
        print(f"{on} / {off}: p50 TTFT ratio {ratio:.2f} (target <= 0.20): {'MET' if ratio <= 0.2 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
