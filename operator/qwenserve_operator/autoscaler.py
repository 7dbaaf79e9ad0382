"""Per-stage autoscaling decisions: pure functions from metrics to replica counts.

Signals (Prometheus text from each pod's `:9090/metrics`):
- prefill pods: `qwenserve_engine_waiting_requests` (queued prompts), and (every engine pod)
  `qwenserve_engine_step_seconds`'s sum: the time its engine spent stepping, so between two scrapes how busy it was;
- decode pods: `qwenserve_engine_waiting_requests`, `qwenserve_engine_running_requests`,
  `qwenserve_kv_blocks_usage_ratio`;
- router pods: `qwenserve_router_held_requests{worker_stage}` (requests waiting for a stage that has no
  worker: scaled to zero), `qwenserve_router_ttft_seconds` (judges prefill) and
  `qwenserve_router_inter_token_latency_seconds` (judges decode). These are cumulative histograms,
  so a latency quantile is computed from the difference between two scrapes: the latency of the
  last interval, not of the process's whole life.

The policy, like the Horizontal Pod Autoscaler's, but with the latency SLO as a first-class signal:
- a stage's recommendation is the largest of its load signals (queue per replica, running
  requests per replica, KV usage), and at least one more replica while its latency breaches the
  SLO; while latency is within 80 % of the target the stage never shrinks;
- scaling up is immediate (at most `maxScaleUpStep` at once); scaling down goes only to the highest
  recommendation seen during `scaleDownStabilizationSeconds`, against flapping;
- a latency miss is charged to the stage that is loaded (`charge_latency`): TTFT that misses while prefill has
  nothing queued and decode is the busier stage does not grow prefill, and ITL that misses while decode has nothing
  queued and prefill is the busier stage does not grow decode (on shared cores, or a shared accelerator, one stage's
  load slows the other's latency, and another replica of the idle stage would not help); such a stage holds instead;
- min/max bounds always hold; then the prefill:decode ratio is kept by raising the smaller side.

Scale to zero: with `minReplicas: 0` a stage with nothing running, waiting or held recommends 0 replicas, so
after `scaleDownStabilizationSeconds` of that it has no pods; a request held by a router for it, or any work
on its pods, recommends at least one, at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families

WAITING = "qwenserve_engine_waiting_requests"
RUNNING = "qwenserve_engine_running_requests"
KV_USAGE = "qwenserve_kv_blocks_usage_ratio"
HELD = "qwenserve_router_held_requests"
TTFT = "qwenserve_router_ttft_seconds"
ITL = "qwenserve_router_inter_token_latency_seconds"
STEP = "qwenserve_engine_step_seconds"
HISTOGRAMS = (TTFT, ITL)
# Latency below this share of the target is "comfortably within the SLO": only then may a stage shrink.
HEADROOM = 0.8

Buckets = dict[float, float]  # upper bound -> cumulative count


@dataclass(frozen=True)
class PodMetrics:
    """What one pod's /metrics said (gauges summed over label sets; histograms by bucket)."""

    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Buckets] = field(default_factory=dict)
    held: dict[str, float] = field(default_factory=dict)  # a router's held requests by the stage they wait for
    busy_seconds: float | None = None  # seconds the pod's engine has spent stepping since it started
    pod: str = ""  # the pod's name, where the scraper knows it


def parse_metrics(text: str) -> PodMetrics:
    """Parse Prometheus text exposition; unknown metrics are ignored."""
    gauges: dict[str, float] = {}
    histograms: dict[str, Buckets] = {}
    held: dict[str, float] = {}
    busy: float | None = None
    for family in text_string_to_metric_families(text):
        if family.name == HELD:
            for sample in family.samples:
                stage = sample.labels.get("worker_stage", "")
                held[stage] = held.get(stage, 0.0) + sample.value
        elif family.name in (WAITING, RUNNING, KV_USAGE):
            values = [s.value for s in family.samples if s.name == family.name]
            if values:
                # KV usage is a ratio: the busiest pool is what matters, never a sum.
                gauges[family.name] = max(values) if family.name == KV_USAGE else sum(values)
        elif family.name in HISTOGRAMS:
            buckets: Buckets = {}
            for sample in family.samples:
                if sample.name == f"{family.name}_bucket":
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
            histograms[family.name] = buckets
        elif family.name == STEP:
            busy = sum(s.value for s in family.samples if s.name == f"{STEP}_sum")
    return PodMetrics(gauges=gauges, histograms=histograms, held=held, busy_seconds=busy)


def held_requests(routers: Iterable[PodMetrics], stage: str) -> float:
    """Requests the routers hold for `stage` (it has no worker), summed over router pods."""
    return sum(pod.held.get(stage, 0.0) for pod in routers)


def merge_histograms(pods: Iterable[PodMetrics], name: str) -> Buckets:
    """One histogram summed over pods (e.g. every router replica)."""
    total: Buckets = {}
    for pod in pods:
        for bound, count in pod.histograms.get(name, {}).items():
            total[bound] = total.get(bound, 0.0) + count
    return total


def histogram_delta(now: Buckets, before: Buckets | None) -> Buckets:
    """Observations between two scrapes; a counter that went down (a restart) counts from zero."""
    if not before:
        return {}
    delta = {bound: count - before.get(bound, 0.0) for bound, count in now.items()}
    if any(value < 0 for value in delta.values()):
        return dict(now)
    return delta


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated inside the bucket as Prometheus does."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # above the highest finite bucket: report its bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-1]


def busy_share(pods: Iterable[PodMetrics], before: dict[str, float], seconds: float) -> float:
    """The share of the last `seconds` that a stage's engines spent stepping (0..1), averaged over its pods.

    `before` is each pod's busy seconds at the previous scrape; a pod not seen then, or restarted since, is left
    out."""
    shares = []
    for pod in pods:
        if pod.busy_seconds is None or pod.pod not in before or seconds <= 0:
            continue
        spent = pod.busy_seconds - before[pod.pod]
        if spent >= 0:
            shares.append(min(1.0, spent / seconds))
    return sum(shares) / len(shares) if shares else 0.0


@dataclass(frozen=True)
class StageSignals:
    """Load of one stage, summed over its scraped pods, plus its latency over the last interval."""

    pods: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0  # the busiest pod's ratio
    latency: float | None = None
    held: float = 0.0  # requests routers hold because the stage has no worker
    busy: float = 0.0  # the share of the last interval its engines spent stepping (mean over pods)
    # Set when the latency misses its target but the miss is charged to the other stage (charge_latency): hold.
    latency_charged_to: str | None = None


def stage_signals(pods: Sequence[PodMetrics], latency: float | None, held: float = 0.0,
                  busy: float = 0.0) -> StageSignals:
    """Sum one stage's pods into its signals."""
    return StageSignals(
        pods=len(pods),
        waiting=sum(p.gauges.get(WAITING, 0.0) for p in pods),
        running=sum(p.gauges.get(RUNNING, 0.0) for p in pods),
        kv_usage=max((p.gauges.get(KV_USAGE, 0.0) for p in pods), default=0.0),
        latency=latency,
        held=held,
        busy=busy,
    )


@dataclass(frozen=True)
class Policy:
    """One stage's autoscaling settings (from spec.stages.<stage>.autoscaling and spec.slo)."""

    min_replicas: int
    max_replicas: int
    latency_target: float
    target_queue_depth: float
    target_running: float | None = None  # decode only
    target_kv_usage: float | None = None  # decode only
    stabilization_seconds: float = 300.0
    max_step: int = 4

    @classmethod
    def from_spec(cls, spec: dict, stage: str) -> Policy:
        """The policy of `stage` from a defaulted QwenDeployment spec."""
        scaling = spec["stages"][stage]["autoscaling"]
        slo = spec["slo"]
        return cls(
            min_replicas=scaling["minReplicas"],
            max_replicas=scaling["maxReplicas"],
            latency_target=slo["ttftSeconds"] if stage == "prefill" else slo["interTokenLatencySeconds"],
            target_queue_depth=scaling["targetQueueDepth"],
            target_running=scaling.get("targetRunningRequests"),
            target_kv_usage=scaling.get("targetKVUsage"),
            stabilization_seconds=scaling["scaleDownStabilizationSeconds"],
            max_step=scaling["maxScaleUpStep"],
        )


def load_share(signals: StageSignals, policy: Policy) -> float:
    """How loaded a stage is against its own targets (1.0 = at target, or stepping all the time): its busiest load
    signal per replica."""
    pods = max(signals.pods, 1)
    shares = [(signals.waiting + signals.held) / (policy.target_queue_depth * pods), signals.busy]
    if policy.target_running:
        shares.append(signals.running / (policy.target_running * pods))
    if policy.target_kv_usage:
        shares.append(signals.kv_usage / policy.target_kv_usage)
    return max(shares)


def charge_latency(prefill: StageSignals, decode: StageSignals, prefill_policy: Policy,
                   decode_policy: Policy) -> tuple[StageSignals, StageSignals]:
    """Charge each latency miss to the stage whose load explains it: the prefill:decode balance.

    TTFT judges prefill and ITL judges decode, but neither latency is the work of its stage alone: stages that share
    cores (or an accelerator) slow each other, and a short prompt's TTFT includes decode's admission. A miss stays
    with its own stage unless that stage has nothing waiting and is less loaded than the other; then the stage
    holds (neither grows nor shrinks) and the other stage's own signals decide whether it grows. So prefill grows
    first when TTFT misses while decode is idle, and decode when ITL misses while prefill is idle.
    """
    shares = {"prefill": load_share(prefill, prefill_policy), "decode": load_share(decode, decode_policy)}
    charged = {}
    for stage, signals, policy, other in (("prefill", prefill, prefill_policy, "decode"),
                                          ("decode", decode, decode_policy, "prefill")):
        missed = signals.latency is not None and signals.latency > policy.latency_target
        queued = signals.waiting > 0 or signals.held > 0
        if missed and not queued and shares[stage] < shares[other]:
            signals = replace(signals, latency_charged_to=other)
        charged[stage] = signals
    return charged["prefill"], charged["decode"]


@dataclass(frozen=True)
class Recommendation:
    """Replicas a stage wants right now and why, before stabilisation and bounds."""

    replicas: int
    reason: str


def recommend(current: int, signals: StageSignals, policy: Policy) -> Recommendation:
    """What the stage's load asks for (raw: no bounds, no window)."""
    current = max(current, 1)
    candidates: list[Recommendation] = [
        Recommendation(math.ceil(signals.waiting / policy.target_queue_depth),
                       f"{signals.waiting:g} waiting requests, target {policy.target_queue_depth:g}/replica"),
    ]
    if policy.target_running:
        candidates.append(Recommendation(
            math.ceil(signals.running / policy.target_running),
            f"{signals.running:g} running requests, target {policy.target_running:g}/replica"))
    if policy.target_kv_usage:
        candidates.append(Recommendation(
            math.ceil(current * signals.kv_usage / policy.target_kv_usage),
            f"KV usage {signals.kv_usage:.0%}, target {policy.target_kv_usage:.0%}"))
    if signals.latency is not None:
        ratio = signals.latency / policy.latency_target
        text = f"latency {signals.latency:.3g}s vs target {policy.latency_target:g}s"
        if ratio > 1.0 and signals.latency_charged_to:
            candidates.append(Recommendation(
                current, f"{text}, charged to {signals.latency_charged_to}: this stage is idle (hold)"))
        elif ratio > 1.0:
            # Grow in proportion to the breach, and by at least one replica.
            candidates.append(Recommendation(max(current + 1, math.ceil(current * min(ratio, 2.0))),
                                             f"{text} (breach)"))
        elif ratio > HEADROOM:
            candidates.append(Recommendation(current, f"{text} (near the target: hold)"))
    if signals.held:
        candidates.append(Recommendation(1, f"{signals.held:g} requests held by the router: no pod to serve them"))
    elif signals.running or signals.waiting:
        candidates.append(Recommendation(1, "busy"))  # never to zero while a pod has work
    return max(candidates, key=lambda r: r.replicas)


@dataclass(frozen=True)
class Decision:
    """The autoscaler's verdict for one stage."""

    replicas: int
    reason: str
    history: tuple[tuple[float, int], ...]  # (time, recommendation) inside the stabilisation window

    def changed(self, current: int) -> bool:
        """Whether this decision scales the stage."""
        return self.replicas != current


def decide(current: int, signals: StageSignals, policy: Policy, history: Sequence[tuple[float, int]],
           now: float) -> Decision:
    """Replicas for one stage: recommendation, bounded, stabilised against flapping.

    `history` is the previous decision's history; the new one is returned in the Decision.
    """
    raw = recommend(current, signals, policy)
    wanted = max(policy.min_replicas, min(policy.max_replicas, raw.replicas))
    # No history yet (a new deployment, a restarted operator): the window starts as if the current count had
    # been recommended now, so a stage shrinks (or goes to zero) only after a whole quiet window.
    history = history or ((now, current),)
    window = tuple((t, r) for t, r in history if now - t < policy.stabilization_seconds) + ((now, wanted),)
    if current > policy.max_replicas:
        replicas, reason = policy.max_replicas, f"scale down: maxReplicas is {policy.max_replicas}"
    elif current < policy.min_replicas:
        replicas, reason = policy.min_replicas, f"scale up: minReplicas is {policy.min_replicas}"
    elif wanted > current:
        replicas, reason = min(wanted, current + policy.max_step), f"scale up: {raw.reason}"
    elif wanted < current:
        # Only as low as the highest recommendation of the window.
        replicas = min(current, max(r for _, r in window))
        reason = f"scale down: {raw.reason}" if replicas < current else f"hold (stabilising): {raw.reason}"
    else:
        replicas, reason = current, f"steady: {raw.reason}"
    return Decision(replicas=replicas, reason=reason, history=window)


def keep_ratio(prefill: int, decode: int, min_ratio: float, max_ratio: float,
               prefill_max: int, decode_max: int) -> tuple[int, int]:
    """Raise the smaller side until prefill/decode lies in [min_ratio, max_ratio], within the max bounds.

    Only raising: cutting a stage to satisfy a ratio could cut streams or queue prompts.
    """
    if decode > 0 and prefill / decode < min_ratio:
        prefill = min(prefill_max, max(prefill, math.ceil(decode * min_ratio)))
    if decode > 0 and prefill / decode > max_ratio:
        decode = min(decode_max, max(decode, math.ceil(prefill / max_ratio)))
    return prefill, decode
