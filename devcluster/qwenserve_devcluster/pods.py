"""The pod runner: what a kubelet (and the Deployment controller) would do for our operator's Deployments.

For every Deployment in the namespace it keeps `spec.replicas` pods of the current template: each pod is
a process in a network namespace of its own (network.PodNetwork), started with the container's command
and args, its environment (values, downward-API fields, ConfigMap and Secret keys) and its volumes. Its
startup, readiness and liveness probes (grpc, httpGet, tcpSocket) run from the host against the pod's
IP; a failed liveness probe or an exit restarts the container in the same pod. The namespace's
NetworkPolicies are enforced on the bridge (network_policy.py), re-applied on every pass and before a new
pod's container starts. A scale-down takes the
newest pods: not ready at once (DNS drops them), the preStop sleep, SIGTERM, the grace period, SIGKILL.
A changed template starts new pods and stops the old ones once the new ones are ready. Pod objects,
pod status and Deployment status are written back to the API, so the operator sees ready pods.

What a container runs on this machine (paths mapped, ConfigMaps, Secrets and volumes resolved) is
container.py's; how one probe runs is probes.py's.

Probes are polled every second at most; a startup probe keeps its budget of periodSeconds x
failureThreshold, so a pod is ready a second after it serves rather than up to a period later.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from qwenserve_devcluster.api import ApiClient, ApiError
from qwenserve_devcluster.container import NODE_NAME, ContainerSetup, HostPaths
from qwenserve_devcluster.dns import ClusterDNS, resolv_conf
from qwenserve_devcluster.network import NetworkError, PodNetwork
from qwenserve_devcluster.network_policy import PodEndpoint, PolicyFirewall
from qwenserve_devcluster.pod import Pod, PodConfigError
from qwenserve_devcluster.probes import run_probe

DEPLOYMENTS, SERVICES, PODS = "apps/v1/deployments", "v1/services", "v1/pods"
NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"
PROBE_TICK = 1.0  # seconds between probes at most
RESTART_BACKOFF_MAX = 10.0


def template_hash(template: dict[str, Any]) -> str:
    """A short digest of a pod template (what the Deployment controller calls pod-template-hash)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class PodRunner:
    """Keeps the pods of every Deployment in `namespace` running; see the module docstring."""

    def __init__(self, api: ApiClient, namespace: str, network: PodNetwork, dns: ClusterDNS,
                 host: HostPaths, log: Callable[[str], None] = print,
                 firewall: PolicyFirewall | None = None) -> None:
        self.api = api
        self.firewall = firewall
        self.namespace = namespace
        self.network = network
        self.dns = dns
        self.host = host
        self.containers = ContainerSetup(api, host, network.gateway)
        self.log = log
        self.pods: dict[str, Pod] = {}
        self._reported: dict[str, dict[str, Any]] = {}  # last status written per Deployment
        self._stopping: set[asyncio.Task[None]] = set()

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
        """One pass: the NetworkPolicies, pods toward each Deployment's replicas and template, then the policies'
        rules for the pods there are now, DNS and status."""
        if self.firewall is not None:
            self.firewall.policies = await self.api.list(NETWORK_POLICIES, self.namespace)
        deployments = {d["metadata"]["name"]: d for d in await self.api.list(DEPLOYMENTS, self.namespace)}
        for name, deployment in deployments.items():
            await self._sync_deployment(name, deployment)
        for pod in list(self.pods.values()):
            if pod.deployment not in deployments and not pod.terminating:
                self._stop(pod, reason="its Deployment is gone")
        await self._enforce_policies()
        services = await self.api.list(SERVICES, self.namespace)
        self.dns.records.set({
            (svc["metadata"]["name"], self.namespace): self.ready_ips(svc.get("spec", {}).get("selector") or {})
            for svc in services})
        for name, deployment in deployments.items():
            await self._report_deployment(name, deployment)

    async def _enforce_policies(self) -> None:
        """The policies' rules for every pod that has an address (terminating ones too, until they are gone)."""
        if self.firewall is None:
            return
        pods = [PodEndpoint(p.name, p.iface.ip, p.labels,
                            {port["name"]: int(port["containerPort"]) for port in p.container.get("ports", [])
                             if port.get("name")})
                for p in list(self.pods.values())]
        await asyncio.to_thread(self.firewall.apply, pods)

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
        await self._enforce_policies()  # before its container starts: no moment with its ports open to all
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
        # Held until done (the loop keeps only a weak reference to a task); a failure is logged and the pod forgotten
        # all the same (_terminate). An old decode pod once stayed "stopping" for minutes in a full `make test` with
        # nothing logged: whatever ends such a task now says so.
        task = asyncio.create_task(self._terminate(pod, pre_stop=True), name=f"stop {pod.name}")
        self._stopping.add(task)
        task.add_done_callback(self._stopped)

    def _stopped(self, task: asyncio.Task[None]) -> None:
        self._stopping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log(f"{task.get_name()}: {type(task.exception()).__name__}: {task.exception()}")

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
        try:
            await _kill(pod.process, max(0.0, deadline - time.monotonic()))
            await asyncio.to_thread(self.network.remove_pod, pod.name)
        finally:
            shutil.rmtree(pod.dir / "volumes", ignore_errors=True)
            self.pods.pop(pod.name, None)
            with contextlib.suppress(Exception):
                await self.api.delete(PODS, self.namespace, pod.name)

    async def _keep_running(self, pod: Pod) -> None:
        """Start the container; restart it when it exits or fails liveness (restartPolicy Always)."""
        while True:
            try:
                argv, env, shm_mount = await self.containers.resolve(pod)
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
                if startup and not await run_probe(pod, startup):
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
                    ok = await run_probe(pod, probe)
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
