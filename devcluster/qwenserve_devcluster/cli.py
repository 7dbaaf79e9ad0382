"""`qwen-serve dev-cluster`: the operator's pods as a cluster on this machine (a test harness; needs root).

    qwen-serve dev-cluster up -f examples/qwendeployment-cpu.yaml [--model DIR] [--namespace NS]
    qwen-serve dev-cluster scale STAGE N

`up` starts the API emulator, the operator, the DNS server and the pod runner, applies the
QwenDeployment, prints `ready http=URL grpc=HOST:PORT KUBECONFIG=PATH kubectl ...` (the router pod's address,
reachable from this machine through the bridge, and a kubeconfig for kubectl) once the operator reports it Ready, and runs until Ctrl-C or SIGTERM; then
it removes every namespace, veth, the bridge and every process it made. It first removes what a crashed
run left behind (names starting with `qs-`).

The model: the deployment's model path (the image's `spec.model.path`, or the PersistentVolumeClaim of a
`pvc` source) stands for `--model DIR` on this machine; without it, for the built-in default model
(`qwen-serve model path`), so the CPU example runs with nothing downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from qwenserve.flags import StrictParser

DEFAULT_STATE_DIR = "/tmp/qwen-serve-dev-cluster"
LOCK_FILE = "/run/qwen-serve-dev-cluster.lock"
STAGES = ("tokenizer", "prefill", "decode", "router")


class DevClusterError(RuntimeError):
    """Something the user can fix: not root, another run holds the state folder, a bad file."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Flags of `qwen-serve dev-cluster`."""
    parser = StrictParser(prog="qwen-serve dev-cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", default=os.environ.get("QWENSERVE_DEV_CLUSTER_DIR", DEFAULT_STATE_DIR),
                        help=f"pods' folders, logs and the running cluster's address (default {DEFAULT_STATE_DIR})")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="run the cluster until Ctrl-C")
    up.add_argument("-f", "--filename", required=True, help="a QwenDeployment YAML file")
    up.add_argument("--namespace", "-n", default=None, help="default: the file's, else 'default'")
    up.add_argument("--model", default=None, help="host folder standing for the deployment's model "
                                                  "(default: the built-in default model)")
    up.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for Ready (default 1200)")
    up.add_argument("--operator-interval", type=float, default=5.0, help="operator timer period (default 5 s)")
    up.add_argument("--verbose", "-v", action="store_true", help="the operator's (kopf's) log too")
    scale = sub.add_parser("scale", help="set a stage's replicas in the running cluster's QwenDeployment")
    scale.add_argument("stage", choices=STAGES)
    scale.add_argument("replicas", type=int)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """Entry point of `qwen-serve dev-cluster`."""
    args = parse_args(argv)
    try:
        if args.action == "up":
            return asyncio.run(up(args))
        return asyncio.run(scale(Path(args.state_dir), args.stage, args.replicas))
    except DevClusterError as e:
        print(f"qwen-serve dev-cluster: {e}", file=sys.stderr)
        return 1


def say(line: str, out: TextIO = sys.stdout) -> None:
    """One line of the harness's own output."""
    print(f"dev-cluster: {line}", file=out, flush=True)


def load_deployment(path: str, namespace: str | None) -> dict[str, Any]:
    """The QwenDeployment of a YAML file (the first document of that kind), namespaced."""
    try:
        with open(path) as f:
            documents = [d for d in yaml.safe_load_all(f) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError) as e:
        raise DevClusterError(f"cannot read {path}: {e}") from e
    found = next((d for d in documents if d.get("kind") == "QwenDeployment"), None)
    if found is None or not found.get("metadata", {}).get("name"):
        raise DevClusterError(f"{path} has no QwenDeployment with a metadata.name")
    body = copy.deepcopy(found)
    body["metadata"]["namespace"] = namespace or body["metadata"].get("namespace") or "default"
    return body


def host_paths(body: dict[str, Any], model: str | None, state_dir: Path) -> Any:
    """What stands in for the image's model folder or the model's PVC on this machine."""
    from qwenserve.cache import cache_root
    from qwenserve_devcluster.container import HostPaths
    from qwenserve_operator.crd import with_defaults
    from qwenserve_operator.naming import model_dir

    if model is None:
        from qwenserve.default_model import ensure_default_model

        model = str(ensure_default_model())
    spec = with_defaults(copy.deepcopy(body.get("spec") or {}))
    paths = HostPaths(state_dir=state_dir, image={model_dir(spec): model},
                      # The pods find the built-in vocabularies and built kernels where this machine keeps them.
                      env={"QWENSERVE_CACHE": str(cache_root()), "PYTHONUNBUFFERED": "1"})
    if spec["model"].get("source") == "pvc":
        paths.claims[spec["model"]["pvc"]["claimName"]] = model
    say(f"model {model_dir(spec)} -> {model}")
    return paths


def _lock(state_dir: Path) -> Any:
    """One run at a time on this machine: the bridge, its subnet and the `qs-` names are machine-wide."""
    state_dir.mkdir(parents=True, exist_ok=True)
    handle = open(LOCK_FILE, "w")  # noqa: SIM115 - held for the whole run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        handle.close()
        raise DevClusterError(f"another dev-cluster is running on this machine ({LOCK_FILE} is locked)") from e
    return handle


async def up(args: argparse.Namespace) -> int:
    """Run the cluster until SIGINT/SIGTERM; 0 after a clean stop, 1 if it never became ready."""
    import kmock

    from qwenserve_devcluster.api import QD, ApiClient, ApiServer, OperatorThread, declare_resources
    from qwenserve_devcluster.dns import ClusterDNS
    from qwenserve_devcluster.network import PodNetwork, remove_leftovers
    from qwenserve_devcluster.network_policy import PolicyFirewall, remove_table
    from qwenserve_devcluster.pods import PodRunner

    if os.geteuid() != 0:
        raise DevClusterError("needs root (network namespaces, a bridge, a tmpfs per pod)")
    state_dir = Path(args.state_dir)
    lock = _lock(state_dir)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    body = load_deployment(args.filename, args.namespace)
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    for thing in remove_leftovers():
        say(f"removed a leftover of an earlier run: {thing}")
    remove_table()  # an earlier run's NetworkPolicy rules, for pods that are gone
    shutil.rmtree(state_dir / "pods", ignore_errors=True)
    paths = host_paths(body, args.model, state_dir)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    network = PodNetwork()
    dns: ClusterDNS | None = None
    operator: OperatorThread | None = None
    runner: PodRunner | None = None
    runner_task: asyncio.Task[None] | None = None
    try:
        async with ApiServer() as server, kmock.Server(server) as http:
            declare_resources(server)
            server.pod_logs = state_dir / "pods"
            server.request_log = 8  # nothing here reads past requests
            api = ApiClient(str(http.url))
            try:
                network.open()
                dns = ClusterDNS(network.gateway)
                dns.start()
                operator = OperatorThread(str(http.url).rstrip("/"), namespace, args.operator_interval)
                await operator.start()
                await api.create(QD, namespace, body)
                firewall = PolicyFirewall(namespace, log=say)
                runner = PodRunner(api, namespace, network, dns, paths, log=say, firewall=firewall)
                runner_task = asyncio.create_task(runner.run())
                say(f"api {str(http.url).rstrip('/')} namespace {namespace}, pods on {network.bridge} "
                    f"{network.subnet}, DNS {network.gateway}:53, logs {state_dir / 'pods'}")
                ready = await _wait_ready(api, runner, name, namespace, args.ready_timeout, stop, runner_task)
                if ready is None:
                    return 0 if stop.is_set() else 1
                http_url, grpc_address = ready
                kubeconfig = write_kubeconfig(state_dir / "kubeconfig", str(http.url).rstrip("/"), namespace)
                state = {"api": str(http.url).rstrip("/"), "namespace": namespace, "name": name,
                         "http": http_url, "grpc": grpc_address, "pid": os.getpid(), "kubeconfig": str(kubeconfig)}
                (state_dir / "state.json").write_text(json.dumps(state))
                say(f"ready http={http_url} grpc={grpc_address} KUBECONFIG={kubeconfig} kubectl get qwendeployments "
                    f"(Ctrl-C stops and cleans up)")
                await stop.wait()
                say("stopping")
                return 0
            finally:
                (state_dir / "state.json").unlink(missing_ok=True)
                (state_dir / "kubeconfig").unlink(missing_ok=True)
                if operator is not None:
                    await operator.stop()
                if runner_task is not None:
                    runner_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await runner_task
                if runner is not None:
                    await runner.stop_all()
                await api.close()
    finally:
        if dns is not None:
            dns.stop()
        network.close()
        remove_leftovers()
        remove_table()
        shutil.rmtree(paths.node_shm, ignore_errors=True)
        say("cleaned up")
        lock.close()


def write_kubeconfig(path: Path, api_url: str, namespace: str) -> Path:
    """A kubeconfig for kubectl against the emulator: plain HTTP on 127.0.0.1, no credentials, `namespace` as
    the context's default."""
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "dev-cluster",
              "clusters": [{"name": "dev-cluster", "cluster": {"server": api_url}}],
              "users": [{"name": "dev-cluster", "user": {}}],
              "contexts": [{"name": "dev-cluster",
                            "context": {"cluster": "dev-cluster", "user": "dev-cluster", "namespace": namespace}}]}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


async def _wait_ready(api: Any, runner: Any, name: str, namespace: str, timeout: float, stop: asyncio.Event,
                      runner_task: asyncio.Task[None]) -> tuple[str, str] | None:
    """(router HTTP URL, router gRPC address) once the operator reports the deployment Ready."""
    from qwenserve_devcluster.api import QD

    deadline = time.monotonic() + timeout
    while not stop.is_set():
        if runner_task.done():
            runner_task.result()  # raises what stopped the pod runner
        live = await api.get(QD, namespace, name) or {}
        conditions = {c["type"]: c for c in live.get("status", {}).get("conditions", [])}
        if conditions.get("Ready", {}).get("status") == "True":
            routers = [p for p in runner.pods_of(f"{name}-router") if p.ready]
            if routers:
                pod = routers[0]
                return f"http://{pod.iface.ip}:{pod.port('http')}", f"{pod.iface.ip}:{pod.port('grpc')}"
        if time.monotonic() > deadline:
            say(f"not ready after {timeout:.0f} s; see the pods' logs", sys.stderr)
            return None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return None


async def scale(state_dir: Path, stage: str, replicas: int) -> int:
    """Patch the running cluster's QwenDeployment: spec.stages.STAGE.replicas = N."""
    from qwenserve_devcluster.api import QD, ApiClient

    try:
        state = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise DevClusterError(f"no running dev-cluster with state folder {state_dir} ({e})") from e
    api = ApiClient(state["api"])
    try:
        await api.patch(QD, state["namespace"], state["name"], {"spec": {"stages": {stage: {"replicas": replicas}}}})
    finally:
        await api.close()
    say(f"{state['name']}: {stage} replicas -> {replicas}")
    return 0
