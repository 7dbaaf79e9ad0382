"""Experiment 3: disaggregated (prefill=1, decode=1) vs colocated (prefill=0, decode=1) goodput under an SLO.

The same seeded chat-mix schedule through `qwen-serve up` in both modes, at a few open-loop rates.
Scaled for a 2-core CPU: token lengths x0.25 (short 12-25 prompt / 25-50 output, long 375-750 / 75-125),
one torch thread per engine, the built-in small Qwen3 (4 layers, hidden 256).

The SLO (TTFT <= 500 ms and mean inter-token latency <= 50 ms) is chosen from this machine's unloaded
latencies with the same mix (colocated, one request at a time: TTFT p99 ~160 ms for a 750-token prompt,
~10-13 ms per output token): about 3x the idle long-prompt TTFT, the headroom the seeds' 250 ms TTFT
pass line leaves over an idle H100, and 50 ms/token = 20 tokens/s, faster than anyone reads, ~4x idle.
A request meets it only if it succeeded and met both bounds.

  .venv/bin/python bench/experiment_disaggregation.py --rates 1.5,3 --duration 40
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen_common import cluster, common_args, figures, model_path  # noqa: E402

from qwenserve.loadgen.arrivals import parse_rates  # noqa: E402
from qwenserve.loadgen.cli import BenchConfig, bench  # noqa: E402
from qwenserve.loadgen.stats import Slo  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, duration=40.0, scale=0.25)
    parser.add_argument("--rates", default="1.5,3", help="open-loop rates to compare at")
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-itl-ms", type=float, default=50.0)
    args = parser.parse_args()
    model = model_path(args.model)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    results = {}
    for mode, prefill in (("colocated", 0), ("disaggregated", 1)):
        with cluster(model, prefill=prefill, decode=1, env={}) as c:
            results[mode] = asyncio.run(bench(BenchConfig(
                target=f"grpc://127.0.0.1:{c.router_port}", mix="chat", scale=args.scale,
                rates=parse_rates(args.rates), duration_s=args.duration, seed=args.seed, slo=slo, label=mode,
                progress=sys.stderr.isatty(), out_dir=args.out / mode if args.out else None)))
    print(f"\nSLO: TTFT <= {slo.ttft_ms:g} ms and mean ITL <= {slo.itl_ms:g} ms")
    for mode, outcomes in results.items():
        for o in outcomes:
            print(figures(f"{mode} rate={o.load:g}", o.summary))
    for co, dis in zip(results["colocated"], results["disaggregated"], strict=True):
        print(f"rate={co.load:g}: goodput disaggregated {dis.summary.goodput:.2f} vs colocated "
              f"{co.summary.goodput:.2f} req/s ({dis.summary.good}/{dis.summary.requests} vs "
              f"{co.summary.good}/{co.summary.requests} within SLO)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
