"""Prometheus metrics for every qwen-serve service, one group per component.

Names follow Prometheus rules: `qwenserve_` prefix, base units (`_seconds`, `_bytes`), `_total`
on counters. Bucket bounds and the allowed label values are in `series`; vLLM's names for the same
numbers, which the router and engine groups also export, in `vllm_metrics`; the HTTP server in
`metrics_server`.

Each group is built on a `CollectorRegistry`; `router_metrics()`, `engine_metrics()`, ... return
one group per registry, so importing a module twice or building a service twice in one test
process never registers a metric twice. Services use the default registry; tests pass their own.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from qwenserve.telemetry.series import (
    BATCH_BUCKETS,
    E2E_BUCKETS,
    FINISH_REASONS,
    GRAMMAR_LIMITS,
    GRPC_CODES,
    HANDOFF_BUCKETS,
    HANDOFF_FAILURE_REASONS,
    HANDOFF_REFUSAL_REASONS,
    HANDOFF_RPCS,
    ITL_BUCKETS,
    OUTCOMES,
    QUEUE_BUCKETS,
    RATELIMIT_LIMITS,
    STAGES,
    STEP_BUCKETS,
    STEP_TOKEN_BUCKETS,
    TOKENIZER_BUCKETS,
    TOKENIZER_RPCS,
    TRANSPORTS,
    TTFT_BUCKETS,
    WEIGHT_PRECISIONS,
    BoundedLabel,
    bounded,
)
from qwenserve.telemetry.vllm_metrics import VLLM_FINISHED_REASONS, VllmEngineMetrics, VllmRouterMetrics

# The label value until a service names its model (RouterConfig's default name).
DEFAULT_MODEL_NAME = "qwen"


class RouterMetrics:
    """The router's request, latency, retry, rate-limit and token metrics, ours and vLLM's (`vllm`).

    Set `model_name` to the served model name before the first request: vLLM's metrics carry it.
    """

    def __init__(self, registry: CollectorRegistry, max_tenants: int = 100) -> None:
        r = registry
        self.registry = registry
        self.model_name = DEFAULT_MODEL_NAME
        self.vllm = VllmRouterMetrics(r)
        self.requests = Counter(
            "qwenserve_router_requests_total", "Finished requests by outcome and finish reason.",
            ["outcome", "finish_reason"], registry=r)
        self.ttft = Histogram(
            "qwenserve_router_ttft_seconds", "Time from request arrival to the first streamed token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "qwenserve_router_inter_token_latency_seconds",
            "Time between successive token deliveries of one request.", buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "qwenserve_router_e2e_latency_seconds", "Time from request arrival to its terminal event.",
            buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "qwenserve_router_queue_time_seconds",
            "Time a request waited in the router before being sent to a worker.", buckets=QUEUE_BUCKETS,
            registry=r)
        self.in_flight = Gauge("qwenserve_router_in_flight_requests",
                               "Requests accepted and not yet finished.", registry=r)
        self.retries = Counter("qwenserve_router_retries_total",
                               "Calls to a stage retried on another worker.", ["stage"], registry=r)
        self.failovers = Counter(
            "qwenserve_router_failovers_total", "Workers taken out of rotation (circuit opened) by stage.",
            ["stage"], registry=r)
        self.ratelimit_decisions = Counter(
            "qwenserve_router_ratelimit_decisions_total",
            "Rate-limit decisions; `limit` names the limit that rejected (none when allowed).",
            ["decision", "limit"], registry=r)
        self.tokens = Counter(
            "qwenserve_router_tokens_total",
            "Tokens by tenant and kind (prompt, cached, completion, reasoning).", ["tenant", "kind"],
            registry=r)
        self.tier_tokens = Counter(
            "qwenserve_router_tier_tokens_total",
            "Tokens by tenant tier (the key file's tiers; none: no tier) and kind (prompt, cached, "
            "completion, reasoning).",
            ["tier", "kind"], registry=r)
        self.held_requests = Gauge(
            "qwenserve_router_held_requests",
            "Requests held for a stage that has no worker (scaled to zero) while one starts; the operator "
            "scales the stage up when it sees them.",
            ["model", "worker_stage"], registry=r)
        self.queued_requests = Gauge(
            "qwenserve_router_queued_requests",
            "Requests waiting for a decode stream slot (--max-streams-per-decode-worker), before prefill.",
            ["model"], registry=r)
        self.cold_starts = Counter(
            "qwenserve_router_cold_starts_total",
            "Requests held for a stage scaled to zero, by how the wait ended (served, timed_out).",
            ["worker_stage", "outcome"], registry=r)
        self.available_workers = Gauge(
            "qwenserve_router_available_workers",
            "Workers of a stage the router can send requests to now (known, not circuit-broken, not "
            "draining); 0: the stage cannot serve.",
            ["model", "worker_stage"], registry=r)
        self.fallbacks = Counter(
            "qwenserve_router_fallbacks_total",
            "Requests handed from a model whose decode workers were unavailable to its fallback.",
            ["model", "fallback"], registry=r)
        self.tenant_label = BoundedLabel(max_tenants)
        # Completion tokens streamed, for `qwen-serve status` (Prometheus users take rate() of tokens_total).
        self.completion_rate = SlidingRate()

    def record_finished(self, outcome: str, finish_reason: str) -> None:
        """Count one finished request (finish_reason "" counts as "none")."""
        self.requests.labels(
            bounded(outcome, OUTCOMES), bounded(finish_reason or "none", FINISH_REASONS)
        ).inc()
        # vLLM counts a request its client left as aborted; failures are no success of any kind.
        reason = VLLM_FINISHED_REASONS.get(finish_reason, "abort" if outcome == "cancelled" else None)
        if reason is not None:
            self.vllm.request_success.labels(self.model_name, reason).inc()

    def record_tokens(self, tenant: str, prompt: int = 0, cached: int = 0, completion: int = 0,
                      tier: str = "", reasoning: int = 0) -> None:
        """Add a request's usage to the tenant's and its tier's token counters."""
        t = self.tenant_label(tenant or "default")
        for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion), ("reasoning", reasoning)):
            if n:
                self.tokens.labels(t, kind).inc(n)
                self.tier_tokens.labels(tier or "none", kind).inc(n)
        if prompt:
            self.vllm.prompt_tokens.labels(self.model_name).inc(prompt)
        if completion:
            self.vllm.generation_tokens.labels(self.model_name).inc(completion)

    def record_retry(self, stage: str) -> None:
        """Count a retry of `stage` on another worker."""
        self.retries.labels(bounded(stage, STAGES)).inc()

    def record_failover(self, stage: str) -> None:
        """Count a worker of `stage` taken out of rotation."""
        self.failovers.labels(bounded(stage, STAGES)).inc()

    def record_ratelimit(self, allowed: bool, limit: str = "none") -> None:
        """Count one rate-limit decision; `limit` ("requests", "tokens", "request_size") says which rejected."""
        decision = "allowed" if allowed else "rejected"
        self.ratelimit_decisions.labels(
            decision, "none" if allowed else bounded(limit, RATELIMIT_LIMITS)
        ).inc()

    def stream_timer(self, arrived: float | None = None) -> StreamTimer:
        """A `StreamTimer` for one request, starting at `arrived` (time.monotonic()) or now."""
        return StreamTimer(self, time.monotonic() if arrived is None else arrived)


class StreamTimer:
    """Turns one request's token deliveries into TTFT, inter-token and end-to-end observations.

    Call `token()` each time tokens reach the client and `finish()` once at the terminal event.
    A delivery carrying several tokens counts as one gap, as the decode step produced them together.
    """

    def __init__(self, metrics: RouterMetrics, arrived: float) -> None:
        self._metrics = metrics
        self.arrived = arrived
        self.first_token_at: float | None = None
        self._last: float | None = None
        self._finished = False

    def token(self, now: float | None = None) -> None:
        """Record a token delivery at `now` (time.monotonic()) or the current time."""
        now = time.monotonic() if now is None else now
        m, model = self._metrics, self._metrics.model_name
        if self._last is None:
            self.first_token_at = now
            m.ttft.observe(now - self.arrived)
            m.vllm.ttft.labels(model).observe(now - self.arrived)
        else:
            m.inter_token_latency.observe(now - self._last)
            m.vllm.inter_token_latency.labels(model).observe(now - self._last)
            m.vllm.time_per_output_token.labels(model).observe(now - self._last)
        self._last = now

    def finish(self, now: float | None = None) -> None:
        """Record the end-to-end latency; later calls are ignored so error paths may call it freely."""
        if self._finished:
            return
        self._finished = True
        now = time.monotonic() if now is None else now
        self._metrics.e2e_latency.observe(now - self.arrived)
        self._metrics.vllm.e2e_latency.labels(self._metrics.model_name).observe(now - self.arrived)


class EngineStats(Protocol):
    """What `EngineMetrics.update_from_stats` reads; any object with these attributes will do."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    preemptions: int
    cpu_kernels: bool



class EngineMetrics:
    """Scheduler and KV-cache metrics of a prefill or decode engine, ours and vLLM's (`vllm`).

    `qwenserve_engine_running_requests`, `qwenserve_engine_waiting_requests` and
    `qwenserve_kv_blocks_usage_ratio` are read by the autoscaler: their names are a contract.
    Set `model_name` to the served model name before the first snapshot: vLLM's metrics carry it.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.model_name = DEFAULT_MODEL_NAME
        self.vllm = VllmEngineMetrics(r)
        self.running = Gauge(
            "qwenserve_engine_running_requests", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("qwenserve_engine_waiting_requests",
                             "Requests queued for admission to the batch.", registry=r)
        self.batch_size = Histogram("qwenserve_engine_batch_size", "Requests in each engine step.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.step_tokens = Histogram(
            "qwenserve_engine_step_tokens", "Tokens computed in each engine step (prefill chunks + decode).",
            buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.step_time = Histogram(
            "qwenserve_engine_step_seconds", "Wall time of each engine step (schedule, forward, sample).",
            buckets=STEP_BUCKETS, registry=r)
        self.kv_blocks_used = Gauge(
            "qwenserve_kv_blocks_used", "KV cache blocks referenced by requests.", registry=r)
        self.kv_blocks_free = Gauge(
            "qwenserve_kv_blocks_free", "KV cache blocks free or reclaimable (unreferenced cached blocks).",
            registry=r)
        self.kv_blocks_total = Gauge("qwenserve_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.kv_blocks_usage_ratio = Gauge("qwenserve_kv_blocks_usage_ratio",
                                           "Used KV blocks over all KV blocks, 0..1.", registry=r)
        self.prefix_cache_hit_ratio = Gauge(
            "qwenserve_prefix_cache_hit_ratio",
            "Share of prompt tokens served from the prefix cache, 0..1, as reported by the engine.",
            registry=r)
        self.throughput = Gauge(
            "qwenserve_engine_throughput_tokens_per_second",
            "Tokens computed per second (prompt and generated) over the last few seconds; for status views, "
            "dashboards should prefer rate(qwenserve_engine_step_tokens_sum[1m]).",
            registry=r,
        )
        self.preemptions = Counter("qwenserve_engine_preemptions_total",
                                   "Requests preempted (blocks freed, recomputed later).", registry=r)
        self.prefill_only_steps = Counter(
            "qwenserve_engine_prefill_only_steps_total",
            "Steps that left the decodes out to drain a burst of queued prompts (short_first admission).",
            registry=r)
        self.cpu_kernels_available = Gauge(
            "qwenserve_cpu_kernels_available",
            "1 where this process's engine runs the C kernels (for what runs on the CPU), 0 where PyTorch's slower "
            "ops stand in (switched off, or none load here).",
            registry=r)
        self.precision = Info(
            "qwenserve_engine_precision",
            "The dtypes this worker's engine computes in, by part (activations, weights, kv), and why "
            "(engine/precision.py: --dtype auto chooses from a start-up probe).",
            registry=r)
        self.grammar_refusals = Counter(
            "qwenserve_grammar_refusals_total",
            "Requests refused for a structured-output constraint past one of this worker's bounds, by the flag "
            "that sets it (max_grammar_chars, max_grammar_choices, grammar_compile_timeout_s, "
            "grammar_compile_memory_mb, grammar_mask_budget_ms).",
            ["limit"], registry=r)
        self._last_counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe_step(self, batch_size: int, tokens: int, seconds: float) -> None:
        """Record one engine step."""
        self.batch_size.observe(batch_size)
        self.step_tokens.observe(tokens)
        self.step_time.observe(seconds)

    def record_precision(self, labels: dict[str, str], reason: str) -> None:
        """Publish the engine's precision (Precision.labels()) and the reason it was chosen, once at start."""
        self.precision.info({**labels, "reason": reason})

    def record_grammar_refusal(self, flag: str) -> None:
        """Count one request refused for a grammar bound; `flag` is the option naming it ("--max-grammar-choices")."""
        self.grammar_refusals.labels(bounded(flag.lstrip("-").replace("-", "_"), GRAMMAR_LIMITS)).inc()

    def update_from_stats(self, stats: EngineStats) -> None:
        """Set the gauges from an engine stats snapshot (duck-typed; missing attributes are skipped).

        `stats.preemptions`, `stats.prefill_only_steps` and the prefix-cache token counts are the engine's
        cumulative counts: each counter advances by the difference since the previous snapshot (by the whole
        value if the count went backwards, i.e. the engine restarted).
        """
        v, model = self.vllm, self.model_name
        for attr, gauges in (
            ("running", (self.running, v.running.labels(model))),
            ("waiting", (self.waiting, v.waiting.labels(model))),
            ("kv_blocks_used", (self.kv_blocks_used,)),
            ("kv_blocks_free", (self.kv_blocks_free,)),
            ("kv_blocks_total", (self.kv_blocks_total,)),
            ("prefix_cache_hit_rate", (self.prefix_cache_hit_ratio,)),
            ("cpu_kernels", (self.cpu_kernels_available,)),  # the engine's choice (engine/kernels.py)
        ):
            value = getattr(stats, attr, None)
            if value is not None:
                for gauge in gauges:
                    gauge.set(value)
        used = getattr(stats, "kv_blocks_used", None)
        total = getattr(stats, "kv_blocks_total", None)
        if total is None and used is not None and getattr(stats, "kv_blocks_free", None) is not None:
            total = used + stats.kv_blocks_free
        if used is not None and total is not None:
            usage = min(1.0, used / total) if total > 0 else 0.0
            self.kv_blocks_usage_ratio.set(usage)
            v.kv_cache_usage.labels(model).set(usage)
        for attr, counters in (
            ("preemptions", (self.preemptions, v.num_preemptions.labels(model))),
            ("prefill_only_steps", (self.prefill_only_steps,)),
            ("prefix_cache_query_tokens", (v.prefix_cache_queries.labels(model),)),
            ("prefix_cache_hit_tokens", (v.prefix_cache_hits.labels(model),)),
        ):
            count = getattr(stats, attr, None)
            if count is None:
                continue
            with self._lock:
                last = self._last_counts.get(attr)
                delta = count if last is None or count < last else count - last
                self._last_counts[attr] = count
            if delta > 0:
                for counter in counters:
                    counter.inc(delta)


class HandoffMetrics:
    """KV handoff between prefill and decode: bytes, duration, failures and leases, by transport."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.bytes = Counter("qwenserve_handoff_bytes_total", "KV cache bytes handed off, by transport.",
                             ["transport"], registry=r)
        self.seconds = Histogram("qwenserve_handoff_seconds", "Duration of one KV handoff, by transport.",
                                 ["transport"], buckets=HANDOFF_BUCKETS, registry=r)
        self.failures = Counter(
            "qwenserve_handoff_failures_total", "Failed KV handoffs by transport and reason.",
            ["transport", "reason"], registry=r)
        self.leases_outstanding = Gauge("qwenserve_handoff_leases_outstanding",
                                        "Exported KV leases not yet released or expired.", registry=r)
        self.leases_reclaimed = Counter("qwenserve_handoff_leases_reclaimed_total",
                                        "Leases reclaimed after expiry (importer never acked).", registry=r)
        self.refusals = Counter(
            "qwenserve_handoff_refusals_total",
            "KVTransfer calls refused for not presenting the handoff's token, by rpc (Fetch, Release) and reason "
            "(missing, wrong).", ["rpc", "reason"], registry=r)
        self.precisions = Counter(
            "qwenserve_handoff_precision_total",
            "KV handoffs imported, by the precision of the weights that computed the KV (exporter_weights) and of "
            "those that continue it (importer_weights): float32, bfloat16, float16, w4a16, w8a16.",
            ["exporter_weights", "importer_weights"], registry=r)

    def record_transfer(self, transport: str, nbytes: int, seconds: float) -> None:
        """Record one successful handoff."""
        t = bounded(transport, TRANSPORTS)
        self.bytes.labels(t).inc(nbytes)
        self.seconds.labels(t).observe(seconds)

    def record_precisions(self, exporter: str, importer: str) -> None:
        """Record the weights' precision on each side of one imported handoff."""
        self.precisions.labels(bounded(exporter, WEIGHT_PRECISIONS), bounded(importer, WEIGHT_PRECISIONS)).inc()

    def record_failure(self, transport: str, reason: str) -> None:
        """Record one failed handoff."""
        self.failures.labels(bounded(transport, TRANSPORTS), bounded(reason, HANDOFF_FAILURE_REASONS)).inc()

    def record_refusal(self, rpc: str, reason: str) -> None:
        """Record one Fetch or Release refused for a missing or wrong handoff token."""
        self.refusals.labels(bounded(rpc, HANDOFF_RPCS), bounded(reason, HANDOFF_REFUSAL_REASONS)).inc()


class StageAuthMetrics:
    """Calls a stage refused for want of its deployment's stage credential (qwenserve/stage_auth.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.refusals = Counter(
            "qwenserve_stage_auth_refusals_total",
            "Calls refused without the deployment's stage credential, by service and reason (missing, wrong).",
            ["service", "reason"], registry=registry)


class TokenizerMetrics:
    """The tokenizer service's request, text, token and latency metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("qwenserve_tokenizer_requests_total",
                                "Tokenizer RPCs by method and gRPC status code.", ["rpc", "code"], registry=r)
        self.texts = Counter("qwenserve_tokenizer_texts_total", "Texts or chats tokenized.", registry=r)
        self.tokens = Counter(
            "qwenserve_tokenizer_tokens_total", "Token ids produced or consumed.", registry=r)
        self.latency = Histogram(
            "qwenserve_tokenizer_latency_seconds", "Tokenizer RPC handling time by method.", ["rpc"],
            buckets=TOKENIZER_BUCKETS, registry=r)

    def record_rpc(self, rpc: str, code: str, seconds: float, texts: int = 0, tokens: int = 0) -> None:
        """Record one handled RPC; `code` is a gRPC status name such as "OK"."""
        name = bounded(rpc, TOKENIZER_RPCS)
        self.requests.labels(name, bounded(code, GRPC_CODES)).inc()
        self.latency.labels(name).observe(seconds)
        if texts:
            self.texts.inc(texts)
        if tokens:
            self.tokens.inc(tokens)


class SlidingRate:
    """Events per second over the last `window_s` seconds (tokens/s for status views). Thread-safe."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, n: int, now: float | None = None) -> None:
        """Count `n` events at `now` (time.monotonic()) or the current time."""
        with self._lock:
            self._events.append((time.monotonic() if now is None else now, n))

    def per_second(self, now: float | None = None) -> float:
        """The rate over the window ending at `now`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            total = sum(n for _, n in self._events)
        return total / self.window_s


_G = TypeVar("_G")
_groups: weakref.WeakKeyDictionary[CollectorRegistry, dict[type, object]] = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


def _group(cls: Callable[[CollectorRegistry], _G], registry: CollectorRegistry | None) -> _G:
    registry = REGISTRY if registry is None else registry
    with _groups_lock:
        per_registry = _groups.setdefault(registry, {})
        if cls not in per_registry:
            per_registry[cls] = cls(registry)
        return per_registry[cls]  # type: ignore[return-value]


def router_metrics(registry: CollectorRegistry | None = None) -> RouterMetrics:
    """The router metric group of `registry` (default: the process-wide one), created once."""
    return _group(RouterMetrics, registry)


def engine_metrics(registry: CollectorRegistry | None = None) -> EngineMetrics:
    """The engine metric group of `registry`, created once."""
    return _group(EngineMetrics, registry)


def handoff_metrics(registry: CollectorRegistry | None = None) -> HandoffMetrics:
    """The KV handoff metric group of `registry`, created once."""
    return _group(HandoffMetrics, registry)


def tokenizer_metrics(registry: CollectorRegistry | None = None) -> TokenizerMetrics:
    """The tokenizer metric group of `registry`, created once."""
    return _group(TokenizerMetrics, registry)


def stage_auth_metrics(registry: CollectorRegistry | None = None) -> StageAuthMetrics:
    """The stage-credential metric group of `registry`, created once."""
    return _group(StageAuthMetrics, registry)


# The label that names a customer: series carrying it stay off pages anyone may read (the router's API port).
TENANT_LABEL = "tenant"


class WithoutLabel:
    """A view of a registry that leaves out every metric with a sample labelled `label`.

    The router's public HTTP `/metrics` serves its registry through `WithoutLabel(registry, TENANT_LABEL)`: a
    caller of the API port must not learn other tenants' names and usage; the --metrics-port keeps everything.
    """

    def __init__(self, registry: Collector, label: str) -> None:
        self.registry = registry
        self.label = label

    def collect(self) -> Iterator[Metric]:
        """The registry's metrics, less those with a sample carrying the label."""
        for metric in self.registry.collect():
            if not any(self.label in sample.labels for sample in metric.samples):
                yield metric


def metrics_page(registry: Collector, accept: str = "") -> tuple[bytes, str]:
    """`registry` (or a view of one) in the exposition format the `Accept` header asks for, and its content type."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type

