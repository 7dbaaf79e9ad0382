"""Several router processes sharing one Redis share one budget, exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.ratelimit_checks import max_window_sum

WORKER = Path(__file__).with_name("shared_budget_worker.py")


def test_two_processes_with_16_clients_each_never_exceed_one_shared_window(redis_url: str) -> None:
    window_s, limit = 0.5, 1000
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), redis_url, str(window_s), str(limit), "16", "1.5", str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(proc.communicate(timeout=30)[0].strip().splitlines()[-1]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(proc.returncode == 0 for proc in procs)
    merged = [(ts, cost) for result in results for ts, cost in result["admitted"]]
    worst, at = max_window_sum(merged, window_s)
    assert worst <= limit, f"{worst} tokens admitted across both processes in the window ending at {at}"
    # Both processes got a share, both were refused some, and the shared window did fill up:
    # separate budgets per process would have admitted up to twice the limit.
    shares = [(len(result["admitted"]), result["rejected"]) for result in results]
    assert all(admitted >= 3 and rejected > 0 for admitted, rejected in shares), shares
    assert worst > limit - 120
