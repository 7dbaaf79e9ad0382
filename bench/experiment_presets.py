"""Experiment: `--preset latency` vs `--preset throughput` on one mix, each expected to win its own metric.

Same model, same seeded schedule, one `qwen-serve up --preset X` (1 prefill, 1 decode) per preset, run one after
the other. Two loads: the chat mix offered near this machine's saturation (where latency is what a chat user
feels: TTFT and inter-token latency, P50 and P99), and a closed loop of many concurrent requests (where the
machine's whole output rate is what a batch job gets: output tokens/s). Target: latency wins P99 TTFT and P99 ITL
on the open load; throughput wins output tokens/s on the closed one.

  .venv/bin/python bench/experiment_presets.py --rate 5 --concurrency 24 --duration 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen_common import cluster, common_args, figures, model_path, run  # noqa: E402

from qwenserve.loadgen.cli import BenchConfig  # noqa: E402
from qwenserve.presets import PRESETS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, duration=40.0, scale=0.25)
    parser.add_argument("--rate", type=float, default=5.0, help="requests/s of the open load (near saturation)")
    parser.add_argument("--concurrency", type=int, default=24, help="requests in flight in the closed load")
    parser.add_argument("--mix", default="chat")
    args = parser.parse_args()
    model = model_path(args.model)
    results = {}
    for preset in ("latency", "throughput"):
        env = {"QWENSERVE_PRESET": preset}
        with cluster(model, prefill=1, decode=1, env=env, prefill_nice=PRESETS[preset]["prefill_nice"]) as c:
            for load, settings in (("open", {"rates": [args.rate]}), ("closed", {"concurrencies": [args.concurrency]})):
                results[preset, load] = run(BenchConfig(
                    target=f"grpc://127.0.0.1:{c.router_port}", mix=args.mix, scale=args.scale,
                    duration_s=args.duration, seed=args.seed, label=f"{preset} {load}", progress=sys.stderr.isatty(),
                    out_dir=args.out / f"{preset}-{load}" if args.out else None, **settings)).summary
    print()
    for (preset, load), summary in results.items():
        print(figures(f"{preset} ({load})", summary))
    lat, thr = results["latency", "open"], results["throughput", "open"]
    ttft, itl = lat.ttft_ms.p99 / thr.ttft_ms.p99, lat.itl_ms.p99 / thr.itl_ms.p99
    rate = results["throughput", "closed"].output_throughput / results["latency", "closed"].output_throughput
    print(f"\nopen load, latency/throughput: P99 TTFT {ttft:.2f}, P99 ITL {itl:.2f} (latency wins below 1)")
    print(f"closed load, throughput/latency: output tokens/s {rate:.2f} (throughput wins above 1)")
    won = ttft < 1 and itl < 1 and rate > 1
    print("each preset wins its own metric" if won else "NOT every preset wins its own metric")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
