"""Experiment: `--preset latency` vs `--preset throughput` on one mix, each expected to win its own metric.

Same model, same seeded schedule, one `qwen-serve up --preset X` per preset (1 prefill + 1 decode by default),
in rounds whose order alternates; each metric's range over the rounds is compared (a preset wins only where
the ranges do not overlap). The deciding load is a closed loop of more concurrent requests than the latency
preset's 32 streams per decode worker (what a busy deployment sees): latency should win the time between tokens
(P50 and P99: smaller decode batches, and no stream stalls for a decode slot), throughput the machine's output
rate (tokens/s: the largest batches). An open load at a moderate rate is reported beside it (what a chat user
feels when nothing queues: there the presets should tie).

  .venv/bin/python bench/experiment_presets.py --rate 3 --concurrency 48 --duration 30 --rounds 2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loadgen_common import cluster, common_args, figures, model_path, run  # noqa: E402

from qwenserve.loadgen.cli import BenchConfig  # noqa: E402
from qwenserve.loadgen.stats import Summary  # noqa: E402
from qwenserve.presets import PRESETS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser, duration=40.0, scale=0.25)
    parser.add_argument("--rate", type=float, default=3.0, help="requests/s of the open load (moderate)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill processes (0: colocated)")
    parser.add_argument("--concurrency", type=int, default=48,
                        help="requests in flight in the closed load (more than the latency preset's 32 streams)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds, the order of the presets alternating (a second cluster on a busy machine "
                             "runs slower than the first: one round alone measures the order, not the preset)")
    parser.add_argument("--mix", default="chat")
    args = parser.parse_args()
    model = model_path(args.model)
    results: dict[tuple[str, str], list[Summary]] = {}
    for round_ in range(args.rounds):
        order = ("latency", "throughput") if round_ % 2 == 0 else ("throughput", "latency")
        for preset in order:
            env = {"QWENSERVE_PRESET": preset}
            with cluster(model, prefill=args.prefill, decode=1, env=env,
                         prefill_nice=PRESETS[preset]["prefill_nice"]) as c:
                for load, settings in (("open", {"rates": [args.rate]}),
                                       ("closed", {"concurrencies": [args.concurrency]})):
                    results.setdefault((preset, load), []).append(run(BenchConfig(
                        target=f"grpc://127.0.0.1:{c.router_port}", mix=args.mix, scale=args.scale,
                        duration_s=args.duration, seed=args.seed, label=f"{preset} {load} #{round_ + 1}",
                        progress=sys.stderr.isatty(),
                        out_dir=args.out / f"{preset}-{load}-{round_ + 1}" if args.out else None,
                        **settings)).summary)
    print()
    for (preset, load), summaries in sorted(results.items()):
        for i, summary in enumerate(summaries):
            print(figures(f"{preset} ({load}) #{i + 1}", summary))

    def spread(preset: str, load: str, value: Callable[[Summary], float]) -> tuple[float, float]:
        values = [value(s) for s in results[preset, load]]
        return min(values), max(values)

    checks = [("closed", "P50 ITL ms", lambda s: s.itl_ms.p50, "lower", "latency"),
              ("closed", "P99 ITL ms", lambda s: s.itl_ms.p99, "lower", "latency"),
              ("closed", "output tok/s", lambda s: s.output_throughput, "higher", "throughput"),
              ("closed", "P99 TTFT ms", lambda s: s.ttft_ms.p99, "lower", None),
              ("open", "P99 TTFT ms", lambda s: s.ttft_ms.p99, "lower", None),
              ("open", "P99 ITL ms", lambda s: s.itl_ms.p99, "lower", None)]
    print()
    won = True
    for load, name, value, better, expected in checks:
        lat, thr = spread("latency", load, value), spread("throughput", load, value)
        winner = "latency" if (lat[1] < thr[0] if better == "lower" else lat[0] > thr[1]) else \
            "throughput" if (thr[1] < lat[0] if better == "lower" else thr[0] > lat[1]) else "neither (ranges overlap)"
        won = won and (expected is None or winner == expected)
        print(f"{load:>6} {name:<13} latency {lat[0]:8.1f}..{lat[1]:8.1f}  throughput {thr[0]:8.1f}..{thr[1]:8.1f}"
              f"  {better} wins: {winner}" + (f" (expected: {expected})" if expected else ""))
    print("each preset wins its own metric" if won else "NOT every preset wins its own metric")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
