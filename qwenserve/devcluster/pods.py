"""The pod runner: what a kubelet (and the Deployment controller) would do for our operator's Deployments.

For every Deployment in the namespace it keeps `spec.replicas` pods of the current template: each pod is
a process in a network namespace of its own (network.PodNetwork), started with the container's command
and args, its environment (values, downward-API fields, ConfigMap and Secret keys) and its volumes. Its
startup, readiness and liveness probes (grpc, httpGet, tcpSocket) run from the host against the pod's
IP; a failed liveness probe or an exit restarts the container in the same pod. A scale-down takes the
newest pods: not ready at once (DNS drops them), the preStop sleep, SIGTERM, the grace period, SIGKILL.
A changed template starts new pods and stops the old ones once the new ones are ready. Pod objects,
pod status and Deployment status are written back to the API, so the operator sees ready pods.

Where a container path does not exist on this machine, it is mapped rather than mounted (no mount
namespace tricks beyond /dev/shm): an argument or variable naming a volume's mount path, or a path
the image would hold (`HostPaths.image`, the model), is rewritten to the host folder that stands in
for it. /dev/shm is really mounted, so POSIX shared memory works: a private tmpfs for an emptyDir,
one folder shared by every pod of this node for a hostPath /dev/shm (the `shm` KV transfer mode).

Probes are polled every second at most; a startup probe keeps its budget of periodSeconds x
failureThreshold, so a pod is ready a second after it serves rather than up to a period later.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qwenserve.devcluster.api import ApiClient, ApiError
from qwenserve.devcluster.dns import ClusterDNS, resolv_conf
from qwenserve.devcluster.network import NetworkError, PodInterface, PodNetwork

DEPLOYMENTS, SERVICES, PODS = "apps/v1/deployments", "v1/services", "v1/pods"
CONFIGMAPS, SECRETS = "v1/configmaps", "v1/secrets"
NODE_NAME = "dev-cluster-node"
ENTRYPOINT = ["qwen-serve"]  # the image's entrypoint: run as this repository's CLI with this Python
SHM = "/dev/shm"
PROBE_TICK = 1.0  # seconds between probes at most
RESTART_BACKOFF_MAX = 10.0


class PodConfigError(RuntimeError):
    """A pod cannot start as specified (a missing ConfigMap key, an unsupported probe or volume)."""


@dataclass
class HostPaths:
    """What stands in, on this machine, for what the image and the cluster's storage would hold."""

    state_dir: Path  # pods' folders and logs
    image: dict[str, str] = field(default_factory=dict)  # a path inside the image -> a host path
    claims: dict[str, str] = field(default_factory=dict)  # a PersistentVolumeClaim's name -> a host folder
    env: dict[str, str] = field(default_factory=dict)  # added to every pod's environment

    @property
    def node_shm(self) -> Path:
        """The folder every pod of this node sees as a hostPath /dev/shm."""
        return self.state_dir / "node-shm"


@dataclass
class Pod:
    """One replica: its identity, network, process and probe state."""

    name: str
    namespace: str
    deployment: str
    template_hash: str
    template: dict[str, Any]
    iface: PodInterface
    dir: Path
    created: float = field(default_factory=time.monotonic)
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    started: bool = False
    restarts: int = 0
    terminating: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.template.get("metadata", {}).get("labels", {}))

    @property
    def container(self) -> dict[str, Any]:
        return self.template["spec"]["containers"][0]

    def port(self, name_or_number: int | str) -> int:
        """A container port by number or by name."""
        if isinstance(name_or_number, int) or str(name_or_number).isdigit():
            return int(name_or_number)
        for port in self.container.get("ports", []):
            if port.get("name") == name_or_number:
                return int(port["containerPort"])
        raise PodConfigError(f"pod {self.name}: no container port named {name_or_number!r}")


def template_hash(template: dict[str, Any]) -> str:
    """A short digest of a pod template (what the Deployment controller calls pod-template-hash)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, $$(VAR) stays literal."""
    return re.sub(r"\$(\$)?\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: m.group(0)[1:] if m.group(1) else env.get(m.group(2), m.group(0)), value)


def translate(value: str, paths: dict[str, str]) -> str:
    """Rewrite a container path (or `--flag=path`) that starts with a mapped folder to its host folder."""
    prefix, _, rest = value.partition("=") if value.startswith("-") and "=" in value else ("", "", value)
    for container_path in sorted(paths, key=len, reverse=True):
        if rest == container_path or rest.startswith(container_path.rstrip("/") + "/"):
            rest = paths[container_path] + rest[len(container_path):]
            break
    return f"{prefix}={rest}" if prefix else rest


class PodRunner:
    """Keeps the pods of every Deployment in `namespace` running; see the module docstring."""

    def __init__(self, api: ApiClient, namespace: str, network: PodNetwork, dns: ClusterDNS,
                 host: HostPaths, log: Callable[[str], None] = print) -> None:
        self.api = api
        self.namespace = namespace
        self.network = network
        self.dns = dns
        self.host = host
        self.log = log
        self.pods: dict[str, Pod] = {}
        self._reported: dict[str, dict[str, Any]] = {}  # last status written per Deployment

    # -- the control loop ----------------------------------------------------------------------------

    async def run(self, period: float = 0.5) -> None:
        """Reconcile forever (cancel to stop; then call `stop_all`)."""
        self.host.node_shm.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                await self.sync()
            except (ApiError, aiohttp.ClientError, NetworkError, OSError) as e:
                self.log(f"pod runner: {e} (retrying)")
            await asyncio.sleep(period)

    async def sync(self) -> None:
        """One pass: pods toward each Deployment's replicas and template, then DNS and status."""
        deployments = {d["metadata"]["name"]: d for d in await self.api.list(DEPLOYMENTS, self.namespace)}
        for name, deployment in deployments.items():
            await self._sync_deployment(name, deployment)
        for pod in list(self.pods.values()):
            if pod.deployment not in deployments and not pod.terminating:
                self._stop(pod, reason="its Deployment is gone")
        services = await self.api.list(SERVICES, self.namespace)
        self.dns.records.set({
            (svc["metadata"]["name"], self.namespace): self.ready_ips(svc.get("spec", {}).get("selector") or {})
            for svc in services})
        for name, deployment in deployments.items():
            await self._report_deployment(name, deployment)

    def ready_ips(self, selector: dict[str, str]) -> list[str]:
        """IPs of the ready pods a Service's selector picks, oldest first."""
        pods = sorted(self.pods.values(), key=lambda p: p.created)
        return [p.iface.ip for p in pods if p.ready and not p.terminating and _matches(selector, p.labels)]

    def pods_of(self, deployment: str) -> list[Pod]:
        """The live (not terminating) pods of a Deployment, oldest first."""
        return sorted((p for p in self.pods.values() if p.deployment == deployment and not p.terminating),
                      key=lambda p: p.created)

    async def _sync_deployment(self, name: str, deployment: dict[str, Any]) -> None:
        template = deployment["spec"]["template"]
        digest = template_hash(template)
        want = int(deployment["spec"].get("replicas", 1))
        pods = self.pods_of(name)
        current = [p for p in pods if p.template_hash == digest]
        outdated = [p for p in pods if p.template_hash != digest]
        for _ in range(want - len(current)):
            await self._start(name, digest, template)
        for pod in current[want:][::-1]:  # the newest go first
            self._stop(pod, reason=f"scaled to {want}")
        if outdated and sum(p.ready for p in current) >= want:
            for pod in outdated:
                self._stop(pod, reason="replaced by a new template")

    async def _report_deployment(self, name: str, deployment: dict[str, Any]) -> None:
        pods = self.pods_of(name)
        digest = template_hash(deployment["spec"]["template"])
        ready = sum(p.ready for p in pods)
        status = {"observedGeneration": deployment["metadata"].get("generation", 1), "replicas": len(pods),
                  "updatedReplicas": sum(p.template_hash == digest for p in pods), "readyReplicas": ready,
                  "availableReplicas": ready, "unavailableReplicas": len(pods) - ready}
        if self._reported.get(name) != status or deployment.get("status", {}).get("readyReplicas", 0) != ready:
            await self.api.patch(DEPLOYMENTS, self.namespace, name, {"status": status}, "/status")
            self._reported[name] = status

    # -- one pod -------------------------------------------------------------------------------------

    async def _start(self, deployment: str, digest: str, template: dict[str, Any]) -> Pod:
        name = f"{deployment}-{digest[:8]}-{os.urandom(3).hex()[:5]}"
        iface = await asyncio.to_thread(self.network.add_pod, name,
                                        resolv_conf(self.network.gateway, self.namespace))
        pod = Pod(name=name, namespace=self.namespace, deployment=deployment, template_hash=digest,
                  template=template, iface=iface, dir=self.host.state_dir / "pods" / name)
        pod.dir.mkdir(parents=True, exist_ok=True)
        self.pods[name] = pod
        labels = {**pod.labels, "pod-template-hash": digest}
        await self.api.create(PODS, self.namespace, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels,
                         "annotations": template.get("metadata", {}).get("annotations", {})},
            "spec": {**template["spec"], "nodeName": NODE_NAME},
            "status": self._pod_status(pod)})
        self.log(f"pod {name}: ip {iface.ip}")
        pod.task = asyncio.create_task(self._keep_running(pod), name=f"pod {name}")
        return pod

    def _stop(self, pod: Pod, reason: str) -> None:
        """Take the pod out of service now; its task runs preStop, SIGTERM and the grace period."""
        self.log(f"pod {pod.name}: stopping ({reason})")
        pod.terminating, pod.ready = True, False
        if pod.task is not None:
            pod.task.cancel()
        asyncio.create_task(self._terminate(pod, pre_stop=True), name=f"stop {pod.name}")

    async def stop_all(self) -> None:
        """Stop every pod at once (no preStop wait) and remove their namespaces."""
        for pod in self.pods.values():
            pod.terminating, pod.ready = True, False
            if pod.task is not None:
                pod.task.cancel()
        await asyncio.gather(*(self._terminate(p, pre_stop=False) for p in list(self.pods.values())),
                             return_exceptions=True)

    async def _terminate(self, pod: Pod, pre_stop: bool) -> None:
        grace = float(pod.template["spec"].get("terminationGracePeriodSeconds", 30))
        deadline = time.monotonic() + grace
        if pre_stop:
            with contextlib.suppress(Exception):
                await self._write_status(pod)
            sleep = pod.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            await asyncio.sleep(min(float(sleep), grace))
        await _kill(pod.process, max(0.0, deadline - time.monotonic()))
        await asyncio.to_thread(self.network.remove_pod, pod.name)
        shutil.rmtree(pod.dir / "volumes", ignore_errors=True)
        self.pods.pop(pod.name, None)
        with contextlib.suppress(Exception):
            await self.api.delete(PODS, self.namespace, pod.name)

    async def _keep_running(self, pod: Pod) -> None:
        """Start the container; restart it when it exits or fails liveness (restartPolicy Always)."""
        while True:
            try:
                argv, env, shm_mount = await self._container_config(pod)
                pod.process = await _spawn(pod, argv, env, shm_mount)
                self.log(f"pod {pod.name}: started pid {pod.process.pid}"
                         f"{f' (restart {pod.restarts})' if pod.restarts else ''}, log {pod.dir / 'log'}")
                why = await self._probe_until_failure(pod)
            except PodConfigError as e:
                why = str(e)
            pod.ready = pod.started = False
            await _kill(pod.process, float(pod.template["spec"].get("terminationGracePeriodSeconds", 30)))
            pod.restarts += 1
            self.log(f"pod {pod.name}: restarting: {why}")
            with contextlib.suppress(Exception):
                await self._write_status(pod)
            await asyncio.sleep(min(RESTART_BACKOFF_MAX, 2.0 ** min(pod.restarts - 1, 4)))

    async def _probe_until_failure(self, pod: Pod) -> str:
        """Run the probes while the process lives; returns why the container must be restarted."""
        container = pod.container
        startup, readiness, liveness = (container.get(k) for k in ("startupProbe", "readinessProbe",
                                                                   "livenessProbe"))
        started_at = time.monotonic()
        failures = {"readiness": 0, "liveness": 0}
        last = {"readiness": 0.0, "liveness": 0.0}
        while True:
            assert pod.process is not None
            if pod.process.returncode is not None:
                return f"exited with {pod.process.returncode}"
            now = time.monotonic()
            if not pod.started:
                budget = float(startup.get("periodSeconds", 10)) * int(startup.get("failureThreshold", 3)) \
                    if startup else 0.0
                if startup and not await self._probe(pod, startup):
                    if now - started_at > budget + float(startup.get("initialDelaySeconds", 0)):
                        return f"startup probe failed for {budget:.0f} s"
                else:
                    pod.started = True
                    last = {"readiness": 0.0, "liveness": now}
            else:
                for kind, probe in (("readiness", readiness), ("liveness", liveness)):
                    if probe is None:
                        if kind == "readiness" and not pod.ready:
                            pod.ready = True
                            await self._write_status(pod)
                        continue
                    if now - last[kind] < float(probe.get("periodSeconds", 10)):
                        continue
                    last[kind] = now
                    ok = await self._probe(pod, probe)
                    failures[kind] = 0 if ok else failures[kind] + 1
                    threshold = int(probe.get("failureThreshold", 3))
                    if kind == "liveness" and failures[kind] >= threshold:
                        return f"liveness probe failed {threshold} times"
                    if kind == "readiness":
                        ready = ok or (pod.ready and failures[kind] < threshold)
                        if ready != pod.ready:
                            pod.ready = ready
                            self.log(f"pod {pod.name}: {'ready' if ready else 'not ready'}")
                            await self._write_status(pod)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(pod.process.wait(), PROBE_TICK)

    async def _probe(self, pod: Pod, probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        address = pod.iface.ip
        try:
            if "grpc" in probe:
                port = pod.port(probe["grpc"]["port"])
                async with grpc.aio.insecure_channel(f"{address}:{port}") as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"http://{address}:{pod.port(get['port'])}{get.get('path', '/')}"
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                        session.get(url) as response:
                    return 200 <= response.status < 400
            if "tcpSocket" in probe:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(address, pod.port(probe["tcpSocket"]["port"])), timeout)
                writer.close()
                return True
        except (TimeoutError, grpc.aio.AioRpcError, aiohttp.ClientError, OSError):
            return False
        raise PodConfigError(f"pod {pod.name}: unsupported probe {sorted(probe)} (grpc, httpGet, tcpSocket are)")

    async def _write_status(self, pod: Pod) -> None:
        if pod.name in self.pods:
            await self.api.patch(PODS, self.namespace, pod.name, {"status": self._pod_status(pod)}, "/status")

    def _pod_status(self, pod: Pod) -> dict[str, Any]:
        running = pod.process is not None and pod.process.returncode is None
        return {
            "phase": "Running" if running else "Pending",
            "podIP": pod.iface.ip, "podIPs": [{"ip": pod.iface.ip}], "hostIP": self.network.gateway,
            "conditions": [{"type": "Ready", "status": str(pod.ready)},
                           {"type": "ContainersReady", "status": str(pod.ready)}],
            "containerStatuses": [{"name": pod.container["name"], "ready": pod.ready, "started": pod.started,
                                   "restartCount": pod.restarts}],
        }

    # -- the container's configuration ---------------------------------------------------------------

    async def _container_config(self, pod: Pod) -> tuple[list[str], dict[str, str], list[str]]:
        """argv, environment and the /dev/shm mount command of the pod's container."""
        container, spec = pod.container, pod.template["spec"]
        paths = dict(self.host.image)
        shm_mount = ["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", SHM]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"])
            if volume is None:
                raise PodConfigError(f"pod {pod.name}: volumeMount {mount['name']!r} names no volume")
            if mount["mountPath"] == SHM:
                if "hostPath" in volume:  # the node's /dev/shm: one folder every pod of this node shares
                    shm_mount = ["mount", "--bind", str(self.host.node_shm), SHM]
                continue
            source = await self._volume_dir(pod, volume)
            paths[mount["mountPath"]] = str(source / mount["subPath"]) if mount.get("subPath") else str(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **self.host.env}
        for source in container.get("envFrom", []):
            data = await self._config_data(pod, source, optional=source.get(next(iter(source)), {}).get("optional"))
            env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in container.get("env", []):
            value = expand(var["value"], env) if "value" in var else await self._env_from(pod, var)
            if value is not None:
                env[var["name"]] = translate(value, paths)
        command = container.get("command") or ENTRYPOINT
        args = [translate(expand(a, env), paths) for a in container.get("args", [])]
        if command == ENTRYPOINT:  # the image's entrypoint is this host's qwen-serve: a host path, never a volume's
            return [sys.executable, "-m", "qwenserve.cli", *args], env, shm_mount
        return [translate(expand(a, env), paths) for a in command] + args, env, shm_mount

    async def _env_from(self, pod: Pod, var: dict[str, Any]) -> str | None:
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            fields = {"metadata.name": pod.name, "metadata.namespace": pod.namespace,
                      "status.podIP": pod.iface.ip, "status.hostIP": self.network.gateway,
                      "spec.nodeName": NODE_NAME, "spec.serviceAccountName": "default"}
            path = source["fieldRef"]["fieldPath"]
            if path not in fields:
                raise PodConfigError(f"pod {pod.name}: env {var['name']}: unsupported fieldRef {path}")
            return fields[path]
        for kind in ("configMapKeyRef", "secretKeyRef"):
            if kind in source:
                ref = source[kind]
                data = await self._config_data(pod, {kind.replace("KeyRef", "Ref"): ref}, ref.get("optional"))
                if ref["key"] not in data and not ref.get("optional"):
                    raise PodConfigError(f"pod {pod.name}: env {var['name']}: no key {ref['key']!r} in {ref['name']}")
                return data.get(ref["key"])
        raise PodConfigError(f"pod {pod.name}: env {var['name']}: unsupported valueFrom {sorted(source)}")

    async def _config_data(self, pod: Pod, source: dict[str, Any], optional: bool | None) -> dict[str, str]:
        """The data of a {configMapRef: {name}} or {secretRef: {name}} (Secrets decoded)."""
        is_secret = "secretRef" in source
        name = (source.get("secretRef") or source.get("configMapRef") or {})["name"]
        obj = await self.api.get(SECRETS if is_secret else CONFIGMAPS, pod.namespace, name)
        if obj is None:
            if optional:
                return {}
            raise PodConfigError(f"pod {pod.name}: {'Secret' if is_secret else 'ConfigMap'} {name!r} not found")
        data = dict(obj.get("data") or {})
        if is_secret:
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update(obj.get("stringData") or {})
        return data

    async def _volume_dir(self, pod: Pod, volume: dict[str, Any]) -> Path:
        """The host folder that stands in for a volume."""
        target = pod.dir / "volumes" / volume["name"]
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            return target
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.host.claims:
                raise PodConfigError(f"pod {pod.name}: no host folder given for PersistentVolumeClaim {claim!r}")
            return Path(self.host.claims[claim])
        for kind, ref in (("configMap", "configMapRef"), ("secret", "secretRef")):
            if kind in volume:
                spec = volume[kind]
                name = spec.get("name") or spec.get("secretName")
                data = await self._config_data(pod, {ref: {"name": name}}, spec.get("optional"))
                items = spec.get("items") or [{"key": k, "path": k} for k in data]
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir(parents=True)
                for item in items:
                    if item["key"] in data:
                        (target / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                        (target / item["path"]).write_text(data[item["key"]])
                return target
        raise PodConfigError(f"pod {pod.name}: unsupported volume {volume['name']!r} ({sorted(volume)})")


async def _spawn(pod: Pod, argv: list[str], env: dict[str, str], shm_mount: list[str]
                 ) -> asyncio.subprocess.Process:
    """Start argv in the pod's namespace (its own mount namespace too: `ip netns exec` makes one)."""
    script = f'{shlex.join(shm_mount)} && exec "$@"'
    log = open(pod.dir / "log", "ab")  # noqa: SIM115 - the child holds it; ours closes below
    try:
        return await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", pod.iface.netns, "sh", "-c", script, "sh", *argv,
            env=env, cwd=pod.dir, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
    finally:
        log.close()


async def _kill(process: asyncio.subprocess.Process | None, grace: float) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds."""
    if process is None or process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
