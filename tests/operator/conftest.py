"""Fixtures for the operator tests: specs, a kmock Kubernetes API with the operator running against it,
and a real HTTP server serving fake Prometheus metrics."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp.web
import kmock
import kopf
import pytest

from qwenserve_devcluster.api import ApiServer  # the emulator dev-cluster runs, too
from qwenserve_operator.crd import with_defaults
from qwenserve_operator.handlers import make_registry
from qwenserve_operator.reconciler import OperatorConfig

NAMESPACE = "ns1"
QD = "qwenserve.io/v1alpha1/qwendeployments"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PODS = "v1/pods"
EVENTS = "v1/events"
NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"

MINIMAL_SPEC: dict[str, Any] = {"model": {"name": "Qwen/Qwen3-0.6B"}}


@pytest.fixture
def make_spec() -> Callable[..., dict[str, Any]]:
    """A defaulted spec with nested overrides, e.g. make_spec(kvTransfer={"mode": "shm"})."""

    def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                merge(base[key], value)
            else:
                base[key] = copy.deepcopy(value)
        return base

    def build(**overrides: Any) -> dict[str, Any]:
        return with_defaults(merge(copy.deepcopy(MINIMAL_SPEC), overrides))

    return build


def _qwendeployment(name: str, spec: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    """A QwenDeployment as the API server would hold it (with uid, resourceVersion and generation)."""
    return {
        "apiVersion": "qwenserve.io/v1alpha1",
        "kind": "QwenDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "resourceVersion": "1",
                     "generation": 1, "creationTimestamp": "2025-01-01T00:00:00Z"},
        "spec": spec,
    }


@pytest.fixture
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    """Use ApiServer for the `kmock` fixture."""
    return {**kmock_options, "cls": ApiServer}


@pytest.fixture
def k8s(kmock: kmock.KubernetesEmulator) -> kmock.KubernetesEmulator:
    """The kmock emulator with every resource the operator uses declared for discovery."""
    kmock.resources[QD] = kmock.ResourceInfo(kind="QwenDeployment", namespaced=True, singular="qwendeployment",
                                             verbs={"get", "list", "watch", "patch", "create", "delete"},
                                             subresources={"status"})
    for key, kind in ((DEPLOYMENTS, "Deployment"), (SERVICES, "Service"), (CONFIGMAPS, "ConfigMap"),
                      (PODS, "Pod"), (EVENTS, "Event"),
                      (NETWORK_POLICIES, "NetworkPolicy")):
        kmock.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=True,
                                                  verbs={"get", "list", "watch", "patch", "create", "delete"})
    # kopf waits until namespaces are discoverable, even when it watches one namespace.
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False,
                                                          verbs={"get", "list", "watch"})
    return kmock


def _live(k8s: kmock.KubernetesEmulator, resource: str, name: str) -> dict[str, Any] | None:
    """The current state of an object in the emulator, or None if absent or deleted."""
    try:
        obj = k8s.objects[resource, NAMESPACE, name]
    except KeyError:
        return None
    return None if obj.deleted else obj.raw


@pytest.fixture
async def run_operator(k8s: kmock.KubernetesEmulator) -> AsyncIterator[Callable[..., Awaitable[None]]]:
    """Start the real operator (kopf + handlers) against the emulator; stopped at teardown.

    kopf runs in its own thread and event loop, as in production: at exit it cancels every task
    of its loop, which would include the test's own.
    """
    stop = threading.Event()
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    async def start(interval: float = 0.5, scrape_timeout: float = 2.0) -> None:
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True
        settings.watching.reconnect_backoff = 0.1
        settings.background.instant_exit_timeout = 0.1
        # Workers and the poster exit at once at teardown instead of idling out (7 s a test otherwise).
        settings.queueing.idle_timeout = 0.2
        settings.queueing.exit_timeout = 0.1
        settings.posting.idle_timeout = 0.1
        ready = threading.Event()
        registry = make_registry(OperatorConfig(interval=interval, scrape_timeout=scrape_timeout),
                                 connection=kopf.ConnectionInfo(server=str(k8s.url).rstrip("/")))

        def run() -> None:
            try:
                asyncio.run(kopf.operator(registry=registry, settings=settings, standalone=True,
                                          namespaces=[NAMESPACE], stop_flag=stop, ready_flag=ready))
            except BaseException as exc:  # reported by the fixture's teardown
                errors.append(exc)

        thread = threading.Thread(target=run, name="kopf", daemon=True)
        thread.start()
        threads.append(thread)
        assert await asyncio.to_thread(ready.wait, 10), "the operator did not start"

    yield start
    stop.set()
    for thread in threads:
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "the operator did not stop"
    assert not errors, errors


async def _eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy (its value is returned) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (KeyError, ValueError, AssertionError, TypeError) as exc:
            last_error = exc
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f": {last_error!r}" if last_error else ""))


class FakeMetrics:
    """Real HTTP servers on localhost, one port per fake pod, serving the /metrics text the test sets."""

    def __init__(self, runner: aiohttp.web.AppRunner) -> None:
        self.runner = runner
        self.texts: dict[str, str] = {}
        self.pods_by_port: dict[int, str] = {}
        self.hits: list[str] = []

    async def add_pod(self, pod: str, text: str = "") -> int:
        """Start serving `pod`'s metrics; returns its port."""
        site = aiohttp.web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.pods_by_port[port] = pod
        self.texts[pod] = text
        return port

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        pod = self.pods_by_port[request.transport.get_extra_info("sockname")[1]]  # type: ignore[union-attr]
        self.hits.append(pod)
        return aiohttp.web.Response(text=self.texts[pod], content_type="text/plain")


@pytest.fixture
async def fake_metrics() -> AsyncIterator[FakeMetrics]:
    """FakeMetrics; add pods with `await fake_metrics.add_pod(name, text)`."""
    app = aiohttp.web.Application()
    runner = aiohttp.web.AppRunner(app)
    fake = FakeMetrics(runner)
    app.router.add_get("/metrics", fake.handle)
    await runner.setup()
    yield fake
    await runner.cleanup()


@pytest.fixture
def qwendeployment() -> Callable[..., dict[str, Any]]:
    """Build a stored QwenDeployment: qwendeployment(name, spec)."""
    return _qwendeployment


@pytest.fixture
def live(k8s: kmock.KubernetesEmulator) -> Callable[[str, str], dict[str, Any] | None]:
    """live(resource, name): an object's current state in the emulator, or None."""
    return lambda resource, name: _live(k8s, resource, name)


@pytest.fixture
def eventually() -> Callable[..., Awaitable[Any]]:
    """await eventually(check, timeout=10, what=...): poll until truthy."""
    return _eventually
