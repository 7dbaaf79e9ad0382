"""The report: a text table, a JSON document, and PNG plots (latency CDFs, TTFT over time, throughput
and goodput vs rate for sweeps). Formatting is pure; only write_* touch the disk."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from qwenserve.loadgen.stats import RequestRecord, Summary, by_group, summarize


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.1f}"


def format_table(label: str, s: Summary) -> str:
    """The summary of one run as an aligned text block."""
    errors = ", ".join(f"{k}={v}" for k, v in s.errors.items()) or "none"
    slo = []
    if s.slo.ttft_ms is not None:
        slo.append(f"TTFT<={s.slo.ttft_ms:g}ms")
    if s.slo.itl_ms is not None:
        slo.append(f"ITL<={s.slo.itl_ms:g}ms")
    lines = [
        f"== {label} ==",
        f"requests {s.requests}  successes {s.successes}  errors {s.requests - s.successes} ({errors})",
        f"duration {s.duration_s:.2f}s  requests/s {s.request_throughput:.3f}  "
        f"input tok/s {s.input_throughput:,.1f}  output tok/s {s.output_throughput:,.1f}",
        f"tokens in {s.input_tokens:,} (cached {s.cached_tokens:,})  out {s.output_tokens:,}",
        f"{'ms':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    for name, d in (("TTFT", s.ttft_ms), ("ITL", s.itl_ms), ("TPOT", s.tpot_ms), ("E2E", s.e2e_ms)):
        lines.append(f"{name:<10}{_ms(d.mean):>10}{_ms(d.p50):>10}{_ms(d.p90):>10}{_ms(d.p99):>10}{_ms(d.max):>10}")
    if slo:
        share = s.good / s.requests if s.requests else 0.0
        lines.append(f"goodput ({' and '.join(slo)}): {s.goodput:.3f} req/s, {s.good}/{s.requests} = {share:.1%}")
    return "\n".join(lines)


def format_sweep(rows: Sequence[tuple[str, Summary]]) -> str:
    """One line per rate of a sweep."""
    head = f"{'run':<14}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}{'goodput':>9}{'err':>5}"
    body = [f"{label:<14}{s.request_throughput:>8.2f}{s.output_throughput:>11.1f}{_ms(s.ttft_ms.p50):>10}"
            f"{_ms(s.ttft_ms.p99):>10}{_ms(s.itl_ms.p99):>9}{s.goodput:>9.2f}{s.requests - s.successes:>5}"
            for label, s in rows]
    return "\n".join([head, *body])


def run_document(label: str, records: Sequence[RequestRecord], summary: Summary, stopped_by: str,
                 settings: dict[str, Any]) -> dict[str, Any]:
    """One run as JSON-able data: settings, summary, per-group summaries and every request."""
    groups = {g: summarize(rs, summary.slo, summary.duration_s).as_dict() for g, rs in by_group(records).items()}
    return {
        "label": label,
        "stopped_by": stopped_by,
        "settings": settings,
        "summary": summary.as_dict(),
        "groups": groups,
        "requests": [{k: v for k, v in asdict(r).items() if k != "itls"} | {"itl_count": len(r.itls)}
                     for r in records],
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Strict JSON (NaN written as null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(document), indent=1, allow_nan=False) + "\n")


def json_safe(value: Any) -> Any:
    """NaN (an empty sample's percentile) becomes null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their cumulative fractions (i / n), for an empirical CDF."""
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def write_plots(out_dir: Path, runs: Sequence[tuple[str, Sequence[RequestRecord]]],
                sweep: Sequence[tuple[float, Summary]] = ()) -> list[Path]:
    """latency_cdf.png (TTFT, ITL, E2E per run), ttft_over_time.png and, for sweeps, throughput_vs_rate.png.
    Returns the files written; none when matplotlib is missing (the table and JSON still are)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, records in runs:
        ok = [r for r in records if r.ok]
        series = ([r.ttft for r in ok if r.ttft is not None], [x for r in ok for x in r.itls],
                  [r.e2e for r in ok if r.e2e is not None])
        for ax, values in zip(axes, series, strict=True):
            if values:
                xs, ys = cdf_points([v * 1000 for v in values])
                ax.plot(xs, ys, label=label)
    for ax, title in zip(axes, ("TTFT", "inter-token latency", "end-to-end latency"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title != "inter-token latency" else "fraction of tokens")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    for label, records in runs:
        pts = sorted((r.start, r.ttft * 1000) for r in records if r.ok and r.ttft is not None)
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, label=label, alpha=0.7)
        bad = [r.start for r in records if not r.ok]
        if bad:
            ax.scatter(bad, [0.0] * len(bad), marker="x", color="red", s=14, label=f"{label}: errors")
    ax.set_xlabel("send time (s since start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "ttft_over_time.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    if len(sweep) > 1:
        fig, ax1 = plt.subplots(figsize=(7, 4))
        rates = [r for r, _ in sweep]
        ax1.plot(rates, [s.output_throughput for _, s in sweep], "o-", label="output tok/s")
        ax1.set_xlabel("offered rate (requests/s)")
        ax1.set_ylabel("output tokens/s")
        ax2 = ax1.twinx()
        ax2.plot(rates, [s.request_throughput for _, s in sweep], "s--", color="tab:green", label="requests/s")
        ax2.plot(rates, [s.goodput for _, s in sweep], "^:", color="tab:red", label="goodput (req/s)")
        ax2.set_ylabel("requests/s")
        fig.legend(loc="upper left", fontsize=8)
        ax1.set_title("throughput vs offered rate")
        ax1.grid(alpha=0.3)
        fig.tight_layout()
        written.append(out_dir / "throughput_vs_rate.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
