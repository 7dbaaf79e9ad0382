"""`qwen-serve dev-cluster`: the CPU example as a cluster on this machine, pods in their own network namespaces.

Needs root and `ip netns`; skipped with the reason otherwise. One run of one to two minutes: up, a completion
through the router pod from the host, every pod at its own IP, decode scaled to 2, a killed decode
container restarted in its pod, decode scaled back to 1, and a teardown that leaves no namespace, link, process or shared-memory
segment behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.devcluster import (
    METRICS_PORT,
    REPO,
    DevCluster,
    netns_unavailable,
    pod_ready,
    wait_for_lock,
)
from tests.support.metrics import scrape, total

PREFIX = "qs-"
SUBNET_PREFIX = "10.213.0."

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
if (reason := netns_unavailable()) is not None:
    pytestmark.append(pytest.mark.skip(reason=reason))


def _ours() -> dict[str, list[str]]:
    """What a dev-cluster run makes, found by name: namespaces, links, /etc/netns folders."""
    netns = [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()]
    etc = [p.name for p in Path("/etc/netns").iterdir()] if Path("/etc/netns").is_dir() else []
    return {kind: [n for n in names if n.startswith(PREFIX)]
            for kind, names in (("netns", netns), ("links", links), ("etc", etc))}


def _served_model() -> str:
    """The model name the CPU example serves (the router refuses any other)."""
    example = yaml.safe_load((REPO / "examples" / "qwendeployment-cpu.yaml").read_text())
    return str(example["spec"]["model"]["name"])


def _complete(http: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": _served_model(), "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return json.load(response)


@pytest.fixture
def spec() -> dict[str, Any]:
    """The CPU example with 1 pod per stage and a small KV cache (CPU and memory are scarce in CI)."""
    body = yaml.safe_load((REPO / "examples" / "qwendeployment-cpu.yaml").read_text())
    for stage in ("tokenizer", "prefill", "decode", "router"):
        body["spec"]["stages"][stage]["replicas"] = 1
    for stage in ("prefill", "decode"):
        body["spec"]["stages"][stage]["env"] = [{"name": "QWENSERVE_KV_CACHE_GB", "value": "0.25"}]
    return body


def test_cpu_example_serves_from_pods_with_their_own_ips_scales_decode_and_leaves_nothing_behind(
        spec: dict[str, Any], tmp_path: Path) -> None:
    wait_for_lock(timeout=120)
    # A run killed with SIGKILL (a machine's session ending under it) leaves its namespaces; `up` removes them.
    left_before = any(_ours().values())
    shm_before = set(os.listdir("/dev/shm"))
    cluster = DevCluster(spec, tmp_path / "state", ready_timeout_s=240)
    try:
        ready = cluster.wait_for(r"ready http=(\S+) grpc=(\S+)", timeout=300)
        if left_before:
            assert any("removed a leftover of an earlier run" in line for line in cluster.lines), cluster.lines
        http, grpc_address = ready.group(1), ready.group(2)
        assert http.startswith(f"http://{SUBNET_PREFIX}") and grpc_address.startswith(SUBNET_PREFIX)

        answer = _complete(http, "The capital of France is")
        assert answer["usage"]["completion_tokens"] == 8

        # Every pod has an IP of its own on the bridge and serves its own metrics there.
        pods = {stage: cluster.pods(stage) for stage in ("tokenizer", "prefill", "decode", "router")}
        ips = [p["status"]["podIP"] for stage_pods in pods.values() for p in stage_pods]
        assert len(ips) == 4 and len(set(ips)) == 4 and all(ip.startswith(SUBNET_PREFIX) for ip in ips), ips
        assert grpc_address.split(":")[0] == pods["router"][0]["status"]["podIP"]
        for stage in ("prefill", "decode"):
            steps = total(scrape(METRICS_PORT, pods[stage][0]["status"]["podIP"]), "qwenserve_engine_step_seconds_count")
            assert steps > 0, f"{stage} at its own IP ran no engine step"

        scaled = subprocess.run([sys.executable, "-m", "qwenserve.cli", "dev-cluster", "--state-dir",
                                 str(tmp_path / "state"), "scale", "decode", "2"],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
        assert scaled.returncode == 0, scaled.stderr
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            decode = cluster.pods("decode")
            if len(decode) == 2 and all(pod_ready(p) for p in decode):
                break
            time.sleep(1)
        else:
            raise AssertionError(f"decode did not reach 2 ready pods: {cluster.pods('decode')}")
        decode_ips = {p["status"]["podIP"] for p in decode}
        others = {p["status"]["podIP"] for stage in ("tokenizer", "prefill", "router") for p in pods[stage]}
        assert len(decode_ips) == 2 and decode_ips.isdisjoint(others), (decode_ips, others)
        assert _complete(http, "Another prompt")["usage"]["completion_tokens"] == 8

        # A killed container restarts in the same pod (same name and IP) and becomes ready again.
        first = pods["decode"][0]["metadata"]["name"]
        victim = next(p["metadata"]["name"] for p in decode if p["metadata"]["name"] != first)  # the new one
        pid = int(cluster.wait_for(rf"pod {victim}: started pid (\d+)", timeout=1).group(1))
        os.kill(pid, signal.SIGKILL)
        cluster.wait_for(rf"pod {victim}: restarting: exited", timeout=30)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pod = next((p for p in cluster.pods("decode") if p["metadata"]["name"] == victim), None)
            if pod and pod_ready(pod) and pod["status"]["containerStatuses"][0]["restartCount"] == 1:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"{victim} did not come back: {cluster.pods('decode')}")
        assert pod["status"]["podIP"] in decode_ips

        # Scaling down stops the newest pod, the one killed above (preStop, SIGTERM) and removes it; the rest keep serving.
        subprocess.run([sys.executable, "-m", "qwenserve.cli", "dev-cluster", "--state-dir", str(tmp_path / "state"),
                        "scale", "decode", "1"], cwd=REPO, check=True, capture_output=True, timeout=60)
        cluster.wait_for(rf"pod {victim}: stopping \(scaled to 1\)", timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(cluster.pods("decode")) != 1:
            time.sleep(1)
        assert [p["metadata"]["name"] for p in cluster.pods("decode")] == [first]
        assert _complete(http, "A third prompt")["usage"]["completion_tokens"] == 8
    finally:
        code = cluster.stop()
    started = [int(m) for line in cluster.lines for m in re.findall(r"started pid (\d+)", line)]
    assert len(started) >= 5, cluster.lines
    assert code == 0, "\n".join(cluster.lines[-40:])
    assert "dev-cluster: cleaned up" in cluster.lines
    assert not any(_ours().values()), _ours()
    for pid in started:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
    new_shm = set(os.listdir("/dev/shm")) - shm_before
    assert not [name for name in new_shm if any(f"-{pid}-" in name for pid in started)], new_shm
    assert not (tmp_path / "state" / "node-shm").exists()
