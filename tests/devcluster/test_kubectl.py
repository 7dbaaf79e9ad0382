"""kubectl against the dev cluster's API server (the emulator `qwen-serve dev-cluster up` runs), with the real
kubectl binary and a kubeconfig as `up` writes it; skipped only where kubectl is not installed.

The emulator runs here in a thread, without pods (no root needed): apply creates and then changes a
QwenDeployment, strict field validation refuses an unknown field, `get` prints the CRD's printer columns and
pods' IPs (`-o wide`), label selectors pick pods, `patch --type merge` sets a stage's replicas, `logs` reads a pod's log file (its tail, and followed until the pod goes) and
`delete` removes the QwenDeployment and, through its owner references, its Deployments. On a running
cluster the same commands are checked in test_scaled_cluster.py (and the ready line's kubeconfig).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from qwenserve_devcluster.api import ApiServer, declare_resources
from qwenserve_devcluster.cli import write_kubeconfig
from tests.support.devcluster import REPO

KUBECTL = shutil.which("kubectl")
pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")]


@dataclass
class Api:
    url: str
    server: ApiServer
    kubeconfig: Path

    def kubectl(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        assert KUBECTL is not None
        done = subprocess.run([KUBECTL, "--kubeconfig", str(self.kubeconfig), *args], capture_output=True,
                              text=True, timeout=60)
        if ok:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
        return done

    def post(self, path: str, body: dict[str, Any]) -> None:
        """Create an object as the operator or the pod runner would (through the REST API)."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


    def patch(self, path: str, body: dict[str, Any]) -> None:
        """A merge patch through the REST API (as the operator removes its finalizer)."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="PATCH",
                                         headers={"Content-Type": "application/merge-patch+json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """The dev cluster's API server in a thread of its own, with a kubeconfig for it."""
    folder = tmp_path_factory.mktemp("kubectl")
    started = threading.Event()
    stop: asyncio.Event | None = None
    found: dict[str, Any] = {}

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with ApiServer() as server, kmock.Server(server) as http:
            declare_resources(server)
            server.pod_logs = folder / "pods"
            found.update(url=str(http.url).rstrip("/"), server=server, loop=asyncio.get_running_loop())
            started.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    kubeconfig = write_kubeconfig(folder / "kubeconfig", found["url"], "default")
    yield Api(found["url"], found["server"], kubeconfig)
    assert stop is not None
    found["loop"].call_soon_threadsafe(stop.set)
    thread.join(10)


def _example(tmp_path: Path, decode_replicas: int, **extra_spec: Any) -> Path:
    body = yaml.safe_load((REPO / "examples" / "qwendeployment-cpu.yaml").read_text())
    body["spec"]["stages"]["decode"]["replicas"] = decode_replicas
    body["spec"].update(extra_spec)
    path = tmp_path / f"qd-{decode_replicas}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _columns(output: str) -> list[dict[str, str]]:
    """kubectl's table output as one {header: cell} per row (cells are single words here)."""
    header, *rows = output.strip().splitlines()
    names = header.split()
    return [dict(zip(names, row.split(), strict=True)) for row in rows]


def test_apply_creates_then_changes_a_qwendeployment_and_strict_validation_names_an_unknown_field(
        api: Api, tmp_path: Path) -> None:
    def versions() -> tuple[int, int]:
        meta = json.loads(api.kubectl("get", "qwd", "qwen-cpu", "-o", "json").stdout)["metadata"]
        return int(meta["resourceVersion"]), meta["generation"]

    created = api.kubectl("apply", "-f", str(_example(tmp_path, 1)))
    assert "qwendeployment.qwenserve.io/qwen-cpu created" in created.stdout
    first, generation = versions()
    assert generation == 1
    changed = api.kubectl("apply", "-f", str(_example(tmp_path, 2)))
    assert "qwendeployment.qwenserve.io/qwen-cpu configured" in changed.stdout
    assert api.kubectl("get", "qwd", "qwen-cpu", "-o", "jsonpath={.spec.stages.decode.replicas}").stdout == "2"
    # Each write a new resourceVersion (kopf tells stale events by it); a spec change a new generation, and
    # neither a label nor a status does.
    second, generation = versions()
    assert second > first and generation == 2
    api.kubectl("label", "qwd", "qwen-cpu", "team=search")
    api.patch("/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments/qwen-cpu/status",
              {"status": {"observedGeneration": 2}})
    third, generation = versions()
    assert third > second and generation == 2

    refused = api.kubectl("apply", "-f", str(_example(tmp_path, 3, replcas=3)), ok=False)
    assert refused.returncode != 0 and 'unknown field "spec.replcas"' in refused.stderr, refused.stderr
    assert api.kubectl("get", "qwd", "qwen-cpu", "-o", "jsonpath={.spec.stages.decode.replicas}").stdout == "2"

    patched = api.kubectl("patch", "qwendeployment", "qwen-cpu", "--type", "merge",
                          "-p", '{"spec":{"stages":{"decode":{"replicas":4}}}}')
    assert "patched" in patched.stdout
    assert api.kubectl("get", "qwd", "qwen-cpu", "-o", "jsonpath={.spec.stages.decode.replicas}").stdout == "4"
    assert versions()[1] == 3
    api.kubectl("delete", "qwendeployment", "qwen-cpu")


def test_get_prints_the_crds_printer_columns_and_pods_ips_and_logs_reads_a_pods_log(api: Api) -> None:
    api.post("/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments", {
        "apiVersion": "qwenserve.io/v1alpha1", "kind": "QwenDeployment", "metadata": {"name": "shown"},
        "spec": {"model": {"name": "m"}},
        "status": {"conditions": [{"type": "Degraded", "status": "False"}, {"type": "Ready", "status": "True"}],
                   "stages": {s: {"summary": f"{n}/{n}"} for s, n in
                              (("tokenizer", 1), ("prefill", 2), ("decode", 3), ("router", 1))}}})
    (row,) = _columns(api.kubectl("get", "qwendeployments").stdout)
    assert row == {"NAME": "shown", "READY": "True", "TOKENIZER": "1/1", "PREFILL": "2/2", "DECODE": "3/3",
                   "ROUTER": "1/1", "AGE": row["AGE"]} and row["AGE"].endswith("s"), row

    api.post("/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "shown-decode-abc12", "namespace": "default", "labels": {"qwenserve.io/stage": "decode"}},
        "spec": {"nodeName": "dev-node", "containers": [{"name": "decode", "image": "qwen-serve"}]},
        "status": {"phase": "Running", "podIP": "10.213.0.9",
                   "containerStatuses": [{"name": "decode", "ready": True, "restartCount": 1}]}})
    (pod,) = _columns(api.kubectl("get", "pods", "-o", "wide").stdout.replace("NOMINATED NODE", "NOMINATED")
                      .replace("READINESS GATES", "GATES"))
    assert (pod["NAME"], pod["READY"], pod["STATUS"], pod["RESTARTS"], pod["IP"], pod["NODE"]) == (
        "shown-decode-abc12", "1/1", "Running", "1", "10.213.0.9", "dev-node"), pod
    assert api.kubectl("get", "pods", "-l", "qwenserve.io/stage=decode", "-o", "name").stdout.split() == [
        "pod/shown-decode-abc12"]
    assert api.kubectl("get", "pods", "-l", "qwenserve.io/stage in (prefill,router)", "-o", "name").stdout.strip() == ""

    assert api.server.pod_logs is not None
    log = api.server.pod_logs / "shown-decode-abc12" / "log"
    log.parent.mkdir(parents=True)
    log.write_text("first line\nsecond line\n")
    assert api.kubectl("logs", "shown-decode-abc12").stdout == "first line\nsecond line\n"
    assert api.kubectl("logs", "shown-decode-abc12", "--tail", "1").stdout == "second line\n"

    assert KUBECTL is not None
    follow = subprocess.Popen([KUBECTL, "--kubeconfig", str(api.kubeconfig), "logs", "-f", "shown-decode-abc12"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        assert [follow.stdout.readline(), follow.stdout.readline()] == ["first line\n", "second line\n"]
        with log.open("a") as f:  # written after kubectl had the file's end: only following shows it
            f.write("third line\n")
        assert follow.stdout.readline() == "third line\n"
        api.kubectl("delete", "pod", "shown-decode-abc12")
        assert follow.wait(timeout=15) == 0  # the stream ends with its pod
    finally:
        follow.kill()
    api.kubectl("delete", "qwd", "shown")


def test_delete_removes_a_qwendeployment_and_what_it_owns(api: Api, tmp_path: Path) -> None:
    api.kubectl("apply", "-f", str(_example(tmp_path, 1)))
    uid = api.kubectl("get", "qwd", "qwen-cpu", "-o", "jsonpath={.metadata.uid}").stdout
    owner = [{"apiVersion": "qwenserve.io/v1alpha1", "kind": "QwenDeployment", "name": "qwen-cpu", "uid": uid}]
    api.post("/apis/apps/v1/namespaces/default/deployments", {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "qwen-cpu-decode", "ownerReferences": owner}, "spec": {"replicas": 1}})
    api.post("/apis/apps/v1/namespaces/default/deployments", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "unowned"}, "spec": {"replicas": 1}})
    assert "qwen-cpu-decode" in api.kubectl("get", "deployments").stdout

    assert 'qwendeployment.qwenserve.io "qwen-cpu" deleted' in api.kubectl("delete", "qwd", "qwen-cpu").stdout
    assert "qwen-cpu" not in api.kubectl("get", "qwd", "-o", "name").stdout
    # A watch by name that starts after the deletion still sees it (kubectl delete lists, then watches for it).
    watch = f"{api.url}/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments?watch=true" \
            "&fieldSelector=metadata.name%3Dqwen-cpu"
    with urllib.request.urlopen(watch, timeout=10) as response:
        event = json.loads(response.readline())
    assert (event["type"], event["object"]["metadata"]["uid"]) == ("DELETED", uid)
    assert api.kubectl("get", "deployments", "-o", "name").stdout.split() == ["deployment.apps/unowned"]
    api.kubectl("delete", "deployment", "unowned")


def test_delete_waits_for_a_finalizer_and_returns_once_it_is_removed(api: Api, tmp_path: Path) -> None:
    # The operator's QwenDeployments carry its finalizer: kubectl delete lists the object, still there, and
    # watches for its removal (a stream client-go must be able to read).
    api.post("/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments", {
        "apiVersion": "qwenserve.io/v1alpha1", "kind": "QwenDeployment",
        "metadata": {"name": "held", "finalizers": ["qwenserve.io/operator"]}, "spec": {"model": {"name": "m"}}})
    assert KUBECTL is not None
    deleting = subprocess.Popen([KUBECTL, "--kubeconfig", str(api.kubeconfig), "delete", "qwd", "held"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        assert deleting.poll() is None, "kubectl delete returned while the finalizer held the object"
        api.patch("/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments/held",
                  {"metadata": {"finalizers": None}})
        out, err = deleting.communicate(timeout=15)
        assert deleting.returncode == 0 and 'qwendeployment.qwenserve.io "held" deleted' in out, err
    finally:
        deleting.kill()
