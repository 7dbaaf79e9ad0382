"""The API side of the local cluster: the kmock Kubernetes emulator, the operator against it, and a client.

The emulator is kmock's `KubernetesEmulator` (the one tests/operator runs the operator against) plus
what a real API server does on create (a name from generateName, a uid). The operator is the real one
(kopf and our handlers) in a thread with its own event loop, as in production. `ApiClient` is the
small REST client the pod runner and `dev-cluster scale` use: list, create, merge-patch, delete.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import aiohttp
import kmock
import kopf

QD = "qwenserve.io/v1alpha1/qwendeployments"
RESOURCES = {  # plural path -> kind; everything the operator and the pod runner touch
    "apps/v1/deployments": "Deployment",
    "v1/services": "Service",
    "v1/configmaps": "ConfigMap",
    "v1/secrets": "Secret",
    "v1/pods": "Pod",
    "v1/events": "Event",
}


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus a name from generateName (kopf's Events use it) and a uid on create."""

    async def _handle(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("resourceVersion", "1")
            meta.setdefault("generation", 1)
        return await super()._handle(request)


def declare_resources(api: kmock.KubernetesEmulator) -> None:
    """Make every resource we use discoverable (kopf looks them up before watching)."""
    api.resources[QD] = kmock.ResourceInfo(kind="QwenDeployment", namespaced=True, singular="qwendeployment",
                                           verbs={"get", "list", "watch", "patch", "create", "delete"},
                                           subresources={"status"})
    for key, kind in RESOURCES.items():
        api.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=True, subresources={"status"},
                                                verbs={"get", "list", "watch", "patch", "create", "delete"})
    # kopf waits until namespaces are discoverable, even when it watches one namespace.
    api.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False,
                                                        verbs={"get", "list", "watch"})


def resource_path(resource: str, namespace: str, name: str = "", subresource: str = "") -> str:
    """The REST path of a resource ("apps/v1/deployments") in a namespace, of one object if `name`."""
    group_version, plural = resource.rsplit("/", 1)
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}{subresource}" if name else path


class ApiError(RuntimeError):
    """The API answered with an error status."""


class ApiClient:
    """A minimal client of the emulator's REST API."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, body: Any = None, missing_ok: bool = False) -> Any:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.session.request(method, self.url + path, json=body, headers=headers) as response:
            if response.status == 404 and missing_ok:
                return None
            if response.status >= 400:
                raise ApiError(f"{method} {path}: {response.status} {await response.text()}")
            return await response.json()

    async def list(self, resource: str, namespace: str) -> list[dict[str, Any]]:
        """Every object of `resource` in `namespace`."""
        return (await self._call("GET", resource_path(resource, namespace)))["items"]

    async def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None."""
        return await self._call("GET", resource_path(resource, namespace, name), missing_ok=True)

    async def create(self, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object; returns it as stored."""
        return await self._call("POST", resource_path(resource, namespace), body)

    async def patch(self, resource: str, namespace: str, name: str, body: dict[str, Any],
                    subresource: str = "") -> dict[str, Any] | None:
        """Merge-patch an object (or its /status); None if it is gone."""
        return await self._call("PATCH", resource_path(resource, namespace, name, subresource), body,
                                missing_ok=True)

    async def delete(self, resource: str, namespace: str, name: str) -> None:
        """Delete an object; a missing one is fine."""
        await self._call("DELETE", resource_path(resource, namespace, name), missing_ok=True)


class OperatorThread:
    """The real operator (kopf + our handlers) against `api_url`, watching `namespace`, in its own thread.

    kopf cancels every task of its loop when it exits, so it gets a loop of its own.
    """

    def __init__(self, api_url: str, namespace: str, interval: float = 5.0) -> None:
        self.api_url = api_url
        self.namespace = namespace
        self.interval = interval
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def _run(self) -> None:
        from qwenserve_operator.handlers import make_registry
        from qwenserve_operator.reconciler import OperatorConfig

        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True
        settings.watching.reconnect_backoff = 0.5
        settings.background.instant_exit_timeout = 0.5
        # A stopped dev cluster goes away: its workers need not idle out first (kopf's defaults add ~7 s to a stop).
        settings.queueing.idle_timeout = 0.5
        settings.queueing.exit_timeout = 0.5
        settings.posting.idle_timeout = 0.5
        registry = make_registry(OperatorConfig(interval=self.interval, scrape_timeout=2.0),
                                 connection=kopf.ConnectionInfo(server=self.api_url))
        try:
            asyncio.run(kopf.operator(registry=registry, settings=settings, standalone=True,
                                      namespaces=[self.namespace], stop_flag=self._stop,
                                      ready_flag=self._ready))
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    async def start(self, timeout: float = 30.0) -> None:
        """Start the operator and wait until kopf says it is ready."""
        self._thread.start()
        if not await asyncio.to_thread(self._ready.wait, timeout):
            raise RuntimeError(f"the operator did not start within {timeout:.0f} s: {self.errors}")

    async def stop(self, timeout: float = 15.0) -> None:
        """Stop the operator and wait for its thread."""
        self._stop.set()
        await asyncio.to_thread(self._thread.join, timeout)
