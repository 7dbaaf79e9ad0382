"""The runner against targets whose behaviour is known: a synthetic server, dead servers, Ctrl-C, bounds."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from qwenserve.loadgen.cli import BenchConfig, bench
from qwenserve.loadgen.stats import Slo
from qwenserve.loadgen.targets import Chunk, LoadRequest, SyntheticTarget
from tests.support.ports import free_port


def _config(**kw: object) -> BenchConfig:
    base = {"target": "synthetic", "mix": "chat", "scale": 0.05, "progress": False, "seed": 1}
    return BenchConfig(**{**base, **kw})  # type: ignore[arg-type]


async def test_reported_latencies_and_tokens_match_a_synthetic_target(tmp_path: Path) -> None:
    target = SyntheticTarget(ttft_s=0.040, itl_s=0.008, slow_every=4, slow_extra_s=0.150)
    out = tmp_path / "out"
    [run] = await bench(_config(concurrencies=[4], num_requests=24, slo=Slo(ttft_ms=120, itl_ms=20), out_dir=out),
                        target=target)
    recs, s = run.result.records, run.summary
    assert run.result.stopped_by == "count" and s.requests == s.successes == 24
    for r in recs:
        want = 0.040 + (0.150 if (r.index + 1) % 4 == 0 else 0.0)
        assert want <= r.ttft < want + 0.030, (r.index, r.ttft)
        assert r.output_tokens == r.max_tokens == r.usage_completion_tokens
        assert r.usage_prompt_tokens == r.prompt_tokens_sent
        assert 0.008 <= r.tpot < 0.008 + 0.010
    assert s.output_tokens == sum(r.max_tokens for r in recs)
    assert s.input_tokens == sum(r.prompt_tokens_sent for r in recs)
    # Every fourth request is slow (190 ms > 120 ms): goodput is exactly the other three quarters.
    assert s.good == 18
    assert s.goodput == pytest.approx(18 / s.duration_s)
    assert 40.0 <= s.ttft_ms.p50 < 70.0 and 190.0 <= s.ttft_ms.max < 220.0
    doc = json.loads((out / "report.json").read_text())
    assert doc["runs"][0]["summary"]["good"] == 18
    assert len(doc["runs"][0]["requests"]) == 24
    assert {p.name for p in out.glob("*.png")} == {"latency_cdf.png", "ttft_over_time.png"}


async def test_sweep_reports_each_rate_and_draws_throughput_vs_rate(tmp_path: Path) -> None:
    target = SyntheticTarget(ttft_s=0.01, itl_s=0.002)
    runs = await bench(_config(rates=[10.0, 40.0], num_requests=20, out_dir=tmp_path), target=target)
    assert [r.load for r in runs] == [10.0, 40.0]
    assert all(r.summary.successes == 20 for r in runs)
    # Open loop: the send times follow the schedule, so the faster rate finishes its 20 sooner.
    assert runs[1].result.records[-1].start < runs[0].result.records[-1].start
    assert (tmp_path / "throughput_vs_rate.png").stat().st_size > 0


async def test_failed_requests_are_counted_by_type_and_the_run_goes_on() -> None:
    target = SyntheticTarget(ttft_s=0.01, itl_s=0.001, error_every=5)
    [run] = await bench(_config(concurrencies=[2], num_requests=20), target=target)
    assert run.summary.errors == {"grpc:UNAVAILABLE": 4}
    assert run.summary.successes == 16


async def test_duration_bound_stops_sending_and_cancels_after_the_drain() -> None:
    target = SyntheticTarget(ttft_s=0.05, itl_s=0.5)  # each request would take seconds
    t0 = time.monotonic()
    [run] = await bench(_config(rates=[20.0], duration_s=1.0, drain_s=0.5, scale=0.1), target=target)
    # 1.5 s of sending and draining; the rest is room for a machine busy with other tests (4 s was missed by
    # 0.4-1 s under pytest-xdist). The cancellation itself is what the records and the error count show.
    assert time.monotonic() - t0 < 8.0
    assert run.result.stopped_by == "duration"
    assert all(r.start < 1.0 + 0.1 for r in run.result.records)
    assert run.summary.errors.get("incomplete", 0) >= 1


async def test_request_timeout_is_an_error_not_a_hang() -> None:
    # A target that would answer after a minute: the run ends long before (the bound leaves room for a busy CI
    # machine and the report's own work; 2 s was once missed by 60 ms).
    target = SyntheticTarget(ttft_s=60.0)
    t0 = time.monotonic()
    [run] = await bench(_config(concurrencies=[3], num_requests=3, request_timeout_s=0.3), target=target)
    assert time.monotonic() - t0 < 15.0
    assert run.summary.errors == {"timeout": 3}


class _StopsSoonTarget(SyntheticTarget):
    """Sets the stop event (as Ctrl-C would) 0.3 s after the first request is under way."""

    def __init__(self, stop: asyncio.Event) -> None:
        super().__init__(itl_s=0.2)
        self.stop = stop

    def stream(self, req: LoadRequest) -> AsyncIterator[Chunk]:
        if not self.stop.is_set():
            asyncio.get_running_loop().call_later(0.3, self.stop.set)
        return super().stream(req)


async def test_stop_event_interrupts_a_long_run_promptly() -> None:
    stop = asyncio.Event()
    t0 = time.monotonic()
    [run] = await bench(_config(concurrencies=[2], duration_s=600.0), target=_StopsSoonTarget(stop), stop=stop)
    assert time.monotonic() - t0 < 15.0  # of a 600 s run
    assert run.result.stopped_by == "interrupted"
    assert run.summary.errors.get("incomplete") == 2


@pytest.mark.parametrize("scheme", ["grpc", "http"])
async def test_a_dead_target_gives_errors_in_the_report(scheme: str) -> None:
    port = free_port()  # nothing listens here
    t0 = time.monotonic()
    [run] = await bench(_config(target=f"{scheme}://127.0.0.1:{port}", concurrencies=[2], num_requests=4,
                                max_model_len=512, request_timeout_s=10.0))
    assert time.monotonic() - t0 < 8.0
    assert run.summary.successes == 0 and run.summary.requests == 4
    assert run.summary.errors == ({"grpc:UNAVAILABLE": 4} if scheme == "grpc" else {"connect": 4})


def test_ctrl_c_stops_the_cli_cleanly_with_a_partial_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve.cli", "bench", "--target", "synthetic:ttft_ms=20,itl_ms=100",
         "--mix", "chat", "--scale", "0.1", "--concurrency", "3", "--duration", "600", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait until requests are in flight (the progress line says so), then press Ctrl-C.
        deadline = time.monotonic() + 20
        seen = ""
        while "sent" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.read(1) if proc.stderr else ""
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "(interrupted)" in stdout
    doc = json.loads((out / "report.json").read_text())
    assert doc["runs"][0]["stopped_by"] == "interrupted"
    assert doc["runs"][0]["summary"]["errors"].get("incomplete") == 3
