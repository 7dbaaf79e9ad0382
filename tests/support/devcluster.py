"""`qwen-serve dev-cluster` as the tests drive it: pods as processes in network namespaces, one cluster on the
machine at a time (its lock)."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from qwenserve_devcluster.cli import LOCK_FILE

REPO = Path(__file__).resolve().parents[2]
# The port every pod serves /metrics on (the operator's manifests).
METRICS_PORT = 9090
STAGE_ARGS = {  # small engines: six pods share two cores
    # fp32 throughout: the tests compare the pods' tokens with one in-process fp32 engine's (under --dtype auto each
    # process would choose its bf16 products from its own start-up timing).
    "prefill": ["--kv-cache-gb", "0.05", "--threads", "1", "--kv-pool-mib", "16", "--dtype", "float32"],
    # The stage's drain on SIGTERM (--grace-s, 10 s by default) within the pod's terminationGracePeriodSeconds.
    "decode": ["--kv-cache-gb", "0.05", "--threads", "1", "--grace-s", "60", "--dtype", "float32"],
    "router": ["--resolve-interval-s", "1"],  # a pod that joins or leaves is seen within a second
}


def netns_unavailable() -> str | None:
    """Why this machine cannot run a dev cluster (root and `ip netns` are needed), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and a bridge)"
    # A name of this process's own: every xdist worker probes while collecting, at the same moment, and a shared
    # name made one of them fail ("File exists") and skip the dev-cluster tests it then ran.
    name = f"qsprobe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def wait_for_lock(timeout: float) -> None:
    """Another dev-cluster (another test's) may still be stopping; one runs on this machine at a time."""
    deadline = time.monotonic() + timeout
    while True:
        with open(LOCK_FILE, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # closing the file lets go again
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"another dev-cluster holds {LOCK_FILE}") from None
        time.sleep(1)


class DevCluster:
    """`qwen-serve dev-cluster up` as a subprocess; its output lines collected as they come."""

    def __init__(self, spec: dict[str, Any], state_dir: Path, model: Path | None = None,
                 ready_timeout_s: float = 200) -> None:
        """Starts `up` with `spec` (serving `model` in place of the spec's own where given)."""
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        spec_file = state_dir / "qwendeployment.yaml"
        spec_file.write_text(yaml.safe_dump(spec))
        self.spec = spec
        self.lines: list[str] = []
        wait_for_lock(120)
        model_args = ["--model", str(model)] if model is not None else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qwenserve.cli", "dev-cluster", "--state-dir", str(state_dir), "up",
             "-f", str(spec_file), *model_args, "--ready-timeout", str(ready_timeout_s)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.grpc = ""
        self.kubeconfig = state_dir / "kubeconfig"

    def wait_ready(self) -> None:
        """Until `up` prints its ready line; the router's gRPC address is then `self.grpc`, and the kubeconfig it
        wrote `self.kubeconfig`."""
        ready = self.wait_for(r"ready http=(\S+) grpc=(\S+) KUBECONFIG=(\S+) kubectl ", timeout=240)
        self.grpc, self.kubeconfig = ready.group(2), Path(ready.group(3))

    def kubectl(self, *args: str, timeout: float = 60) -> str:
        """Run the installed kubectl against the cluster with the kubeconfig `up` wrote; its stdout."""
        done = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args], capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """The first output line from index `start` on matching `pattern`; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if match := next(filter(None, (re.search(pattern, x) for x in self.lines[start:])), None):
                return match
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-60:]))
            time.sleep(0.2)

    def api(self, path: str) -> Any:
        state = json.loads((self.state_dir / "state.json").read_text())
        with urllib.request.urlopen(state["api"] + path, timeout=10) as response:
            return json.load(response)

    def api_write(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST, PATCH (a merge patch) or DELETE through the cluster's API; the answer's JSON."""
        state = json.loads((self.state_dir / "state.json").read_text())
        content = "application/merge-patch+json" if method == "PATCH" else "application/json"
        request = urllib.request.Request(state["api"] + path, method=method, headers={"Content-Type": content},
                                         data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def pods(self, stage: str) -> list[dict[str, Any]]:
        items = self.api("/api/v1/namespaces/default/pods")["items"]
        return [p for p in items if p["metadata"]["labels"].get("qwenserve.io/stage") == stage]

    def ready_pods(self, stage: str, count: int, timeout: float) -> dict[str, str]:
        """{pod name: pod IP} once `stage` has exactly `count` pods, all ready."""
        deadline = time.monotonic() + timeout
        while True:
            pods = self.pods(stage)
            if len(pods) == count and all(pod_ready(p) for p in pods):
                return {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
            if time.monotonic() > deadline:
                raise AssertionError(f"{stage} did not reach {count} ready pods: {pods}")
            time.sleep(1)

    def replicas(self, stage: str) -> int:
        """The replicas the QwenDeployment asks of `stage` now (pods still draining are not counted in it)."""
        deployment = self.api("/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments/qwen-cpu")
        return int(deployment["spec"]["stages"][stage]["replicas"])

    def scale(self, stage: str, replicas: int) -> None:
        done = subprocess.run([sys.executable, "-m", "qwenserve.cli", "dev-cluster", "--state-dir",
                               str(self.state_dir), "scale", stage, str(replicas)],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    def apply_replicas(self, stage: str, replicas: int) -> str:
        """`kubectl apply -f` of the cluster's QwenDeployment file with `stage` at `replicas`; kubectl's output."""
        spec = copy.deepcopy(self.spec)
        spec["spec"]["stages"][stage]["replicas"] = replicas
        changed = self.state_dir / f"qwendeployment-{stage}-{replicas}.yaml"
        changed.write_text(yaml.safe_dump(spec))
        return self.kubectl("apply", "-f", str(changed))

    def patch_replicas(self, stage: str, replicas: int) -> None:
        """`kubectl patch qwendeployment NAME --type merge` of a stage's replicas; where kubectl is not installed,
        the same merge patch through the API."""
        state = json.loads((self.state_dir / "state.json").read_text())
        if shutil.which("kubectl"):
            patch = json.dumps({"spec": {"stages": {stage: {"replicas": replicas}}}})
            assert "patched" in self.kubectl("patch", "qwendeployment", state["name"], "--type", "merge", "-p", patch)
            return
        body = json.dumps({"spec": {"stages": {stage: {"replicas": replicas}}}}).encode()
        request = urllib.request.Request(
            f"{state['api']}/apis/qwenserve.io/v1alpha1/namespaces/{state['namespace']}/qwendeployments/"
            f"{state['name']}", data=body, method="PATCH", headers={"Content-Type": "application/merge-patch+json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200

    def pod_logs(self) -> dict[str, str]:
        return {log.parent.name: log.read_text(errors="replace")
                for log in (self.state_dir / "pods").glob("*/log")}

    def stop(self) -> int:
        """SIGTERM to `up` (it tears the cluster down); its exit code, once all its output is in `lines`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._reader.join(10)
        return code


def pod_ready(pod: dict[str, Any]) -> bool:
    """Whether a pod's Ready condition is True."""
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def example_deployment(mode: str, replicas: dict[str, int]) -> dict[str, Any]:
    """The CPU example with `replicas`, KV transfer `mode` and small engines."""
    body = yaml.safe_load((REPO / "examples" / "qwendeployment-cpu.yaml").read_text())
    body["spec"]["kvTransfer"]["mode"] = mode
    for stage, count in replicas.items():
        body["spec"]["stages"][stage]["replicas"] = count
    for stage, args in STAGE_ARGS.items():
        body["spec"]["stages"][stage]["args"] = args
    return body


OUTSIDER_NETNS = "qs-outsider"  # the dev cluster's prefix: a run's cleanup (or the next one's) removes it


@contextlib.contextmanager
def outsider(bridge: str = "qs-br0", address: str = "10.213.0.250/24") -> Iterator[str]:
    """A network namespace on the cluster's bridge that is no pod (no labels any policy selects); its name."""
    host_veth, inner = "qs-vout", "qs-pout"
    steps = [["netns", "add", OUTSIDER_NETNS], ["link", "add", host_veth, "type", "veth", "peer", "name", inner],
             ["link", "set", inner, "netns", OUTSIDER_NETNS], ["link", "set", host_veth, "master", bridge],
             ["link", "set", host_veth, "up"], ["-n", OUTSIDER_NETNS, "addr", "add", address, "dev", inner],
             ["-n", OUTSIDER_NETNS, "link", "set", inner, "up"]]
    try:
        for step in steps:
            subprocess.run(["ip", *step], check=True, capture_output=True)
        yield OUTSIDER_NETNS
    finally:
        subprocess.run(["ip", "netns", "del", OUTSIDER_NETNS], capture_output=True)
        subprocess.run(["ip", "link", "del", host_veth], capture_output=True)


def connects(netns: str, ip: str, port: int, timeout: float = 1.5) -> bool:
    """Whether a TCP connection from inside `netns` to ip:port opens within `timeout` seconds (a policy drops the
    opening packet: the attempt times out)."""
    probe = ("import socket, sys\n"
             "try:\n"
             f"    socket.create_connection(({ip!r}, {port}), timeout={timeout}).close()\n"
             "except OSError:\n"
             "    sys.exit(1)\n")
    done = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", probe], capture_output=True,
                          timeout=timeout + 30)
    return done.returncode == 0
