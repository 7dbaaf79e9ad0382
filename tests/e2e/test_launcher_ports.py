"""A port taken between being picked and being bound costs the launcher a second plan, not the start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwenserve import launcher
from tests.support.clusters import make_cluster


def test_a_cluster_whose_picked_port_was_taken_starts_on_other_ports(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = launcher.free_port
        # The first port handed out (the tokenizer's) is one another process holds.
        monkeypatch.setattr(launcher, "free_port", lambda host: next(picks, None) or real_free_port(host))
        with make_cluster(tiny_model, tmp_path, prefill=0, decode=1) as cluster:
            assert cluster.children[0].address != f"127.0.0.1:{taken}"
            assert all(c.process is not None and c.process.poll() is None for c in cluster.children)


def test_a_plan_never_gives_two_children_the_same_port(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS may hand out a just-released port again: CI saw prefill get the tokenizer's port."""
    picks = iter([40001, 40001, 40002, 40001, 40003, 40002, 40004, 40005, 40006, 40007, 40008, 40009, 40010])
    monkeypatch.setattr(launcher, "free_port", lambda host: next(picks))
    cluster = launcher.LocalCluster(model=tiny_model, prefill=1, decode=1, router_port=40003)
    cluster.plan()
    ports = [int(c.address.rsplit(":", 1)[1]) for c in cluster.children] + [c.metrics_port for c in cluster.children]
    ports.append(cluster.http_port)
    assert len(ports) == len(set(ports)), ports
    assert cluster.router_port == 40003 and ports.count(40003) == 1


def test_the_children_die_with_a_launcher_that_is_killed(tiny_model: Path, tmp_path: Path) -> None:
    """The kernel's parent-death signal, armed by each stage itself (qwenserve/supervision.py)."""
    script = ("import sys, time; from pathlib import Path; from qwenserve.launcher import LocalCluster\n"
              "c = LocalCluster(model=Path(sys.argv[1]), prefill=0, decode=1)\n"
              "c.start(); print(' '.join(str(ch.process.pid) for ch in c.children), flush=True); time.sleep(600)")
    launcher_process = subprocess.Popen([sys.executable, "-c", script, str(tiny_model)], stdout=subprocess.PIPE,
                                        text=True, env={**os.environ, "QWENSERVE_KV_CACHE_GB": "0.05"})
    pids = [int(p) for p in launcher_process.stdout.readline().split()]
    assert len(pids) == 3
    launcher_process.kill()
    launcher_process.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if _alive(pid)]
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (not yet reaped) is gone for our purpose
        return stat.read().split()[2] != "Z"
