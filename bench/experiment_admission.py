"""Experiment 1: the engine's admission policies side by side: FCFS, the burst-protecting "short_first" and the
field reports' sliding "watermark", on one mix (chat, or burst) near saturation.

Same model, same seeded open-loop schedule (the chat mix with its bursts of 10 in 100 ms), one colocated
`qwen-serve up` per policy, run one after the other on this machine. Target: P99 TTFT(short_first)
<= 1/2 P99 TTFT(fcfs) at equal or better throughput.

Scaled for a 2-core CPU: token lengths x0.25 (short 12-25 prompt / 25-50 output, long 375-750 / 75-125)
and the per-step token budget 2048 x0.125 = 256, so a long prompt is prefilled in 2-3 chunks, as a
3000-token prompt is under a 2048-token budget at full size.

Near saturation: this machine serves about 5.6 requests/s of this mix, so the default offers 6/s.
short_first reorders the queue (short prompts first, no starvation) and, while prompts queue up beyond
what a step can take beside its decodes, runs up to --burst-prefill-steps steps without the decodes.

  .venv/bin/python bench/experiment_admission.py --rate 6 --duration 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen_common import cluster, common_args, figures, model_path, run  # noqa: E402

from qwenserve.loadgen.cli import BenchConfig  # noqa: E402
from qwenserve.loadgen.stats import percentile  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, duration=40.0, scale=0.25)
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s (near this machine's saturation)")
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens per step")
    parser.add_argument("--burst-prefill-steps", type=int, default=None,
                        help="short_first's prefill-only steps in a row (default: the engine's)")
    parser.add_argument("--mix", default="chat", help="chat or burst")
    parser.add_argument("--policies", default="fcfs,short_first,watermark")
    args = parser.parse_args()
    model = model_path(args.model)
    results = {}
    for policy in args.policies.split(","):
        env = {"QWENSERVE_ADMISSION_POLICY": policy, "QWENSERVE_MAX_NUM_BATCHED_TOKENS": str(args.budget)}
        if args.burst_prefill_steps is not None:
            env["QWENSERVE_BURST_PREFILL_STEPS"] = str(args.burst_prefill_steps)
        with cluster(model, prefill=0, decode=1, env=env) as c:
            results[policy] = run(BenchConfig(
                target=f"grpc://127.0.0.1:{c.router_port}", mix=args.mix, scale=args.scale, rates=[args.rate],
                duration_s=args.duration, seed=args.seed, label=policy, progress=sys.stderr.isatty(),
                out_dir=args.out / policy if args.out else None))
    print()
    for policy, o in results.items():
        print(figures(policy, o.summary))
        for label, groups in (("short+burst", ("short", "burst")), ("long", ("long",))):
            ttfts = [r.ttft for r in o.result.records if r.ok and r.group in groups and r.ttft is not None]
            if ttfts:
                print(f"{'':<28} {label:>11} requests: TTFT p50={percentile(ttfts, 50) * 1000:8.1f} "
                      f"p99={percentile(ttfts, 99) * 1000:8.1f} max={max(ttfts) * 1000:8.1f} ms (n={len(ttfts)})")
    if "fcfs" not in results:
        return 0
    fcfs = results["fcfs"].summary
    for policy in (p for p in results if p != "fcfs"):
        s = results[policy].summary
        ratio, thr = s.ttft_ms.p99 / fcfs.ttft_ms.p99, s.output_throughput / fcfs.output_throughput
        print(f"\n{policy}/fcfs: P99 TTFT {ratio:.2f}, output throughput {thr:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
