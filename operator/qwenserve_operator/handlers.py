"""The kopf handlers: short functions that hand the object to the Reconciler.

- create / update / resume: apply the children now;
- a timer per QwenDeployment: autoscale, restore drift, refresh status;
- events of the children: a Deployment changing (readiness) or any child deleted by hand triggers a
  pass for its owner at once, instead of waiting for the timer.

`make_registry` builds a fresh registry (no import-time globals), so tests run the real handlers
against a mock API server with their own settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import kopf

from qwenserve_operator.crd import GROUP, PLURAL, VERSION
from qwenserve_operator.kube import KubeClient, KubeClosed
from qwenserve_operator.naming import MANAGER
from qwenserve_operator.reconciler import OperatorConfig, Reconciler

OWNED = {"app.kubernetes.io/managed-by": MANAGER}


@dataclass
class Runtime:
    """What the handlers share: settings, credentials (from login) and the reconciler (from startup)."""

    config: OperatorConfig
    connection: kopf.ConnectionInfo | None = None
    reconciler: Reconciler | None = field(default=None, repr=False)

    def require(self) -> Reconciler:
        """The reconciler, made on first use (kopf logs in after the startup handlers)."""
        if self.reconciler is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in to Kubernetes yet", delay=1)
            self.reconciler = Reconciler(KubeClient(self.connection), self.config)
        return self.reconciler


def login(settings: kopf.OperatorSettings, logger: kopf.Logger,
          fixed: kopf.ConnectionInfo | None) -> kopf.ConnectionInfo | None:
    """The `kubernetes` library's credentials (service account first, then kubeconfig); `fixed` (tests) wins."""
    if fixed is not None:
        return fixed
    return kopf.login_via_client(settings=settings, logger=logger)


async def until_stopped(work: Awaitable[None], stopped: kopf.DaemonStopped) -> None:
    """Run `work`, abandoning it when `stopped` is set.

    kopf removes a deleted object's finalizer only once its timers have exited, and checks again for one still
    running only every `cancellation_polling` seconds: a pass that scrapes every pod would hold the deletion up.
    """
    failed: list[Exception] = []

    async def run() -> None:
        # The pass's error is kept, not raised in its task: as the operator stops, kopf re-raises the failure of any
        # task left in its loop as its own, and a pass abandoned below (its API client closed under it, say) would be.
        try:
            await work
        except Exception as exc:
            failed.append(exc)

    task = asyncio.ensure_future(run())
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stop.cancel()
    if task.done():
        if failed:
            raise failed[0]
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def make_registry(config: OperatorConfig, connection: kopf.ConnectionInfo | None = None) -> kopf.OperatorRegistry:
    """A registry with every handler of the operator."""
    registry = kopf.OperatorRegistry()
    runtime = Runtime(config=config)
    crd = (GROUP, VERSION, PLURAL)

    @kopf.on.login(registry=registry)
    def on_login(settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> kopf.ConnectionInfo | None:
        runtime.connection = login(settings, logger, connection)
        return runtime.connection

    @kopf.on.startup(registry=registry)
    def on_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = f"{GROUP}/operator"
        settings.posting.level = logging.INFO  # scale decisions are INFO events
        # A deleted object waits for its timer to exit; kopf's default re-check of a running one is 60 s later.
        settings.background.cancellation_polling = 1.0

    @kopf.on.cleanup(registry=registry)
    async def on_cleanup(**_: Any) -> None:
        if runtime.reconciler is not None:
            await runtime.reconciler.kube.close()

    @kopf.on.resume(*crd, id="apply-on-resume", registry=registry)
    @kopf.on.create(*crd, id="apply-on-create", registry=registry)
    @kopf.on.update(*crd, id="apply-on-update", registry=registry)
    async def apply(body: kopf.Body, **_: Any) -> None:
        await runtime.require().reconcile(dict(body), autoscale=False)

    @kopf.timer(*crd, interval=config.interval, registry=registry)
    async def autoscale(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
        # A pass cut short by the operator's stop (its API client closed under it) is dropped, as until_stopped
        # drops one when kopf stops the timer first: kopf would report it as the timer's failure.
        with contextlib.suppress(KubeClosed):
            await until_stopped(runtime.require().reconcile(dict(body), autoscale=True), stopped)

    @kopf.on.delete(*crd, optional=True, registry=registry)
    def forget(name: str, namespace: str, **_: Any) -> None:
        if runtime.reconciler is not None:
            runtime.reconciler.forget(namespace, name)

    async def child_changed(event: kopf.RawEvent, labels: kopf.Labels, namespace: str | None,
                            deletions_only: bool) -> None:
        owner = labels.get("qwenserve.io/deployment")
        if owner is None or namespace is None or (deletions_only and event.get("type") != "DELETED"):
            return
        # An event handled as the operator stops finds its client closed: dropped, as the timer's pass is.
        with contextlib.suppress(KubeClosed):
            await runtime.require().reconcile_by_name(namespace, owner)

    @kopf.on.event("apps", "v1", "deployments", labels=OWNED, registry=registry)
    async def deployment_changed(event: kopf.RawEvent, labels: kopf.Labels, namespace: str | None,
                                 **_: Any) -> None:
        await child_changed(event, labels, namespace, deletions_only=False)

    @kopf.on.event("v1", "services", labels=OWNED, registry=registry)
    @kopf.on.event("v1", "configmaps", labels=OWNED, registry=registry)
    async def other_child_changed(event: kopf.RawEvent, labels: kopf.Labels, namespace: str | None,
                                  **_: Any) -> None:
        await child_changed(event, labels, namespace, deletions_only=True)

    return registry
