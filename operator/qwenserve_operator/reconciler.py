"""One reconciliation pass for a QwenDeployment: the side effects around the pure functions.

A pass: default and validate the spec; when autoscaling, scrape the stages' metrics and decide
replicas; build every child (manifests.py); create what is missing and patch what drifted; then
store a status computed from the children (status.py). Passes for one object never overlap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from qwenserve_operator import autoscaler, manifests, naming, status
from qwenserve_operator.crd import AUTOSCALED_STAGES, STAGES, with_defaults
from qwenserve_operator.kube import KubeClient, KubeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of the operator process (not of a QwenDeployment)."""

    interval: float = 15.0  # seconds between autoscaling/drift passes per QwenDeployment
    scrape_timeout: float = 3.0


@dataclass(frozen=True)
class Scrape:
    """What every pod of the autoscaling signals' stages answered, and when (monotonic seconds)."""

    at: float
    stages: dict[str, list[autoscaler.PodMetrics]]


@dataclass
class _Memory:
    """What the operator remembers about one QwenDeployment between passes (lost on restart)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    replicas: dict[str, int] = field(default_factory=dict)  # the autoscaler's last decision
    windows: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    histograms: dict[str, autoscaler.Buckets] = field(default_factory=dict)  # router, last scrape
    # Per engine stage: when it was last scraped, and each pod's seconds spent stepping then.
    busy: dict[str, tuple[float, dict[str, float]]] = field(default_factory=dict)
    last_problem: str = ""
    refresh_queued: bool = False


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field we set still has our value (the API server may add fields)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(is_subset(d, s) for d, s in zip(desired, live, strict=True)))
    return desired == live


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


class Reconciler:
    """Applies QwenDeployments: children, autoscaling, status."""

    def __init__(self, kube: KubeClient, config: OperatorConfig) -> None:
        self.kube = kube
        self.config = config
        self._memory: dict[str, _Memory] = {}

    def forget(self, namespace: str, name: str) -> None:
        """Drop the memory of a deleted QwenDeployment."""
        self._memory.pop(f"{namespace}/{name}", None)

    async def reconcile_by_name(self, namespace: str, name: str) -> None:
        """Reconcile a QwenDeployment read fresh from the API (used when a child changes).

        A burst of child events collapses into one pass: while a pass is queued, more are redundant
        because the queued one reads the object after the burst.
        """
        memory = self._memory.setdefault(f"{namespace}/{name}", _Memory())
        if memory.refresh_queued:
            return
        memory.refresh_queued = True
        async with memory.lock:
            memory.refresh_queued = False
            body = await self.kube.get("QwenDeployment", namespace, name)
            if body is not None and not body["metadata"].get("deletionTimestamp"):
                await self._reconcile(body, memory, scraped=None)

    async def reconcile(self, body: dict[str, Any], autoscale: bool) -> None:
        """One pass; `autoscale` also scrapes metrics and may change replicas."""
        meta = body["metadata"]
        memory = self._memory.setdefault(f"{meta['namespace']}/{meta['name']}", _Memory())
        # Scraped before the lock: a pod that does not answer holds a scrape up to scrape_timeout, and the
        # create/update handlers (and so kopf's handling of a deletion behind them) must not wait for it.
        scraped = await self._scrape(body) if autoscale else None
        async with memory.lock:
            await self._reconcile(body, memory, scraped)

    async def _scrape(self, body: dict[str, Any]) -> Scrape | None:
        """Every autoscaling signal's source (both engine stages and the router), scraped at once; None when
        no stage autoscales."""
        spec = with_defaults(body.get("spec") or {})
        if manifests.validate_spec(spec) or \
                not any(spec["stages"][s]["autoscaling"]["enabled"] for s in AUTOSCALED_STAGES):
            return None
        meta = body["metadata"]
        stages = (*AUTOSCALED_STAGES, "router")
        # Every stage's outcome is collected before any is raised: a sibling left failing on its own (the API
        # client closed under both as the operator stops) would be re-raised by kopf as the operator's failure.
        found = await asyncio.gather(*(self._scrape_stage(meta["namespace"], meta["name"], s) for s in stages),
                                     return_exceptions=True)
        for outcome in found:
            if isinstance(outcome, BaseException):
                raise outcome
        return Scrape(time.monotonic(), dict(zip(stages, found, strict=True)))

    async def _reconcile(self, body: dict[str, Any], memory: _Memory,
                         scraped: Scrape | None) -> None:
        meta = body["metadata"]
        name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
        spec = with_defaults(body.get("spec") or {})
        old_status = dict(body.get("status") or {})
        errors = manifests.validate_spec(spec)
        scale_notes: dict[str, dict[str, str]] = {}
        deployments: dict[str, dict[str, Any] | None] = {}
        desired = {stage: 0 for stage in STAGES}
        if not errors:
            current = self._current_replicas(spec, old_status, memory)
            if scraped is not None:
                current, scale_notes = self._autoscale(body, spec, current, memory, scraped)
            desired = {stage: manifests.spec_replicas(spec, stage, current) for stage in STAGES}
            errors = await self._ensure_stage_secret(name, namespace, uid)
            applied, deployments = await self._apply(manifests.children(name, namespace, uid, spec, desired))
            errors += applied
        self._report_problems(body, memory, errors)
        new_status = status.compute_status(name, namespace, spec, desired, deployments, old_status, errors,
                                           meta.get("generation"), _now())
        for stage, notes in scale_notes.items():
            new_status["stages"][stage].update(notes)
        if not is_subset(new_status, old_status):
            await self.kube.merge_patch("QwenDeployment", namespace, name, {"status": new_status}, "status")

    def _current_replicas(self, spec: dict[str, Any], old_status: dict[str, Any], memory: _Memory) -> dict[str, int]:
        # The autoscaler's last decision: from memory, else from the stored status (after a restart).
        current = {}
        for stage in AUTOSCALED_STAGES:
            stored = ((old_status.get("stages") or {}).get(stage) or {})
            if stage in memory.replicas:
                current[stage] = memory.replicas[stage]
            elif stored.get("autoscaled") and stored.get("desiredReplicas") is not None:
                current[stage] = int(stored["desiredReplicas"])
        return current

    async def _ensure_stage_secret(self, name: str, namespace: str, uid: str) -> list[str]:
        """Create the deployment's stage Secret, with a fresh random value, unless it exists (409). The operator
        never reads it: creating is all its RBAC allows."""
        try:
            await self.kube.create(manifests.stage_secret(name, namespace, uid, secrets.token_hex(32)))
            log.info("created the stage secret of %s/%s", namespace, name)
        except KubeError as exc:
            if exc.status != 409:
                return [f"Secret {naming.stage_secret_name(name)}: {exc}"]
        return []

    async def _apply(self, children: list[dict[str, Any]]) -> tuple[list[str], dict[str, dict[str, Any] | None]]:
        errors: list[str] = []
        deployments: dict[str, dict[str, Any] | None] = {}
        for child in children:
            meta = child["metadata"]
            try:
                live = await self._apply_one(child)
            except KubeError as exc:
                errors.append(f"{child['kind']} {meta['name']}: {exc}")
                live = None
            if child["kind"] == "Deployment":
                deployments[meta["labels"]["qwenserve.io/stage"]] = live
        return errors, deployments

    async def _apply_one(self, child: dict[str, Any]) -> dict[str, Any]:
        meta = child["metadata"]
        live = await self.kube.get(child["kind"], meta["namespace"], meta["name"])
        if live is None:
            log.info("creating %s %s/%s", child["kind"], meta["namespace"], meta["name"])
            try:
                return await self.kube.create(child)
            except KubeError as exc:
                if exc.status != 409:  # 409: created meanwhile; patch it below like any other
                    raise
                live = await self.kube.get(child["kind"], meta["namespace"], meta["name"]) or {}
        if is_subset(child, live):
            return live
        log.info("patching drifted %s %s/%s", child["kind"], meta["namespace"], meta["name"])
        return await self.kube.merge_patch(child["kind"], meta["namespace"], meta["name"], child)

    def _report_problems(self, body: dict[str, Any], memory: _Memory, errors: list[str]) -> None:
        # One Warning Event per distinct problem, not one per pass.
        problem = "; ".join(errors)
        if problem and problem != memory.last_problem:
            kopf.warn(body, reason="ReconcileFailed", message=problem[:1000])
        elif not problem and memory.last_problem:
            kopf.info(body, reason="Reconciled", message="problems resolved")
        memory.last_problem = problem

    def _autoscale(self, body: dict[str, Any], spec: dict[str, Any], current: dict[str, int], memory: _Memory,
                   scrape: Scrape) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
        # Both engine stages are scraped even when one scales alone: a latency miss is charged by their balance.
        enabled = [s for s in AUTOSCALED_STAGES if spec["stages"][s]["autoscaling"]["enabled"]]
        if not enabled:
            return current, {}
        scraped, now = scrape.stages, scrape.at
        quantile = spec["slo"]["quantile"]
        latency = {}
        for stage, metric in (("prefill", autoscaler.TTFT), ("decode", autoscaler.ITL)):
            now_buckets = autoscaler.merge_histograms(scraped["router"], metric)
            delta = autoscaler.histogram_delta(now_buckets, memory.histograms.get(metric))
            latency[stage] = autoscaler.histogram_quantile(quantile, delta)
            memory.histograms[metric] = now_buckets
        replicas = {s: manifests.spec_replicas(spec, s, current) for s in AUTOSCALED_STAGES}
        reasons: dict[str, str] = {}
        policies = {s: autoscaler.Policy.from_spec(spec, s) for s in AUTOSCALED_STAGES}
        signals = {}
        for stage in AUTOSCALED_STAGES:
            then, before = memory.busy.get(stage, (now, {}))
            busy = autoscaler.busy_share(scraped[stage], before, now - then)
            memory.busy[stage] = (now, {p.pod: p.busy_seconds for p in scraped[stage] if p.busy_seconds is not None})
            # At zero replicas the routers' held requests are the stage's whole load (scale from zero).
            signals[stage] = autoscaler.stage_signals(scraped[stage], latency[stage],
                                                      autoscaler.held_requests(scraped["router"], stage), busy)
        signals["prefill"], signals["decode"] = autoscaler.charge_latency(
            signals["prefill"], signals["decode"], policies["prefill"], policies["decode"])
        for stage in enabled:
            if not scraped[stage] and replicas[stage] > 0:
                continue  # no pod answered: no data is not a reason to scale
            decision = autoscaler.decide(replicas[stage], signals[stage], policies[stage],
                                         memory.windows.get(stage, ()), now)
            memory.windows[stage] = decision.history
            if decision.changed(replicas[stage]):
                reasons[stage] = decision.reason
            replicas[stage] = decision.replicas
        replicas = self._keep_ratio(spec, enabled, replicas, reasons)
        notes = {}
        for stage in enabled:
            before = manifests.spec_replicas(spec, stage, current)
            memory.replicas[stage] = replicas[stage]
            if replicas[stage] != before:
                reason = reasons.get(stage, "keeping the prefill:decode ratio")
                kopf.info(body, reason="ScaledUp" if replicas[stage] > before else "ScaledDown",
                          message=f"{stage}: {before} -> {replicas[stage]} replicas ({reason})")
                notes[stage] = {"lastScaleTime": _now(), "lastScaleReason": reason[:300]}
        return {**current, **{s: replicas[s] for s in enabled}}, notes

    @staticmethod
    def _keep_ratio(spec: dict[str, Any], enabled: list[str], replicas: dict[str, int],
                    reasons: dict[str, str]) -> dict[str, int]:
        ratio = spec["prefillDecodeRatio"]
        bounds = {s: spec["stages"][s]["autoscaling"]["maxReplicas"] if s in enabled else replicas[s]
                  for s in AUTOSCALED_STAGES}
        prefill, decode = autoscaler.keep_ratio(replicas["prefill"], replicas["decode"], ratio["min"], ratio["max"],
                                                bounds["prefill"], bounds["decode"])
        for stage, value in (("prefill", prefill), ("decode", decode)):
            if value != replicas[stage]:
                reasons[stage] = f"keeping prefill:decode within {ratio['min']:g}..{ratio['max']:g}"
        return {"prefill": prefill, "decode": decode}

    async def _scrape_stage(self, namespace: str, name: str, stage: str) -> list[autoscaler.PodMetrics]:
        pods = await self.kube.list("Pod", namespace, naming.selector_labels(name, stage))
        urls = {pod["metadata"]["name"]: url for pod in pods if (url := metrics_url(pod))}
        timeout = aiohttp.ClientTimeout(total=self.config.scrape_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            texts = await asyncio.gather(*(_fetch(session, url) for url in urls.values()))
        return [dataclasses.replace(autoscaler.parse_metrics(text), pod=name)
                for name, text in zip(urls, texts, strict=True) if text is not None]


def metrics_url(pod: dict[str, Any]) -> str | None:
    """The /metrics URL of a running pod: its IP and the container port named `metrics`."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or (pod.get("status") or {}).get("phase", "Running") != "Running":
        return None
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None  # draining: its queue is leaving with it
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "metrics":
                return f"http://{ip}:{port['containerPort']}/metrics"
    return f"http://{ip}:{naming.METRICS_PORT}/metrics"


async def _fetch(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as response:
            if response.status == 200:
                return await response.text()
            log.warning("metrics %s answered %s", url, response.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("metrics %s unreachable: %s", url, exc)
    return None
