"""Prometheus metrics for every qwen-serve service, one group per component.

Names follow Prometheus rules: `qwenserve_` prefix, base units (`_seconds`, `_bytes`), `_total`
on counters. Labels take values from small fixed sets; anything else is folded into "other" so
a bad caller cannot blow up cardinality. Tenants are capped the same way (`BoundedLabel`).

Each group is built on a `CollectorRegistry`; `router_metrics()`, `engine_metrics()`, ... return
one group per registry, so importing a module twice or building a service twice in one test
process never registers a metric twice. Services use the default registry; tests pass their own.

Tools built for vLLM (its Grafana dashboard, the production-stack router, autoscalers reading vLLM's
names) find vLLM's metrics next to ours, by vLLM's names and each with a `model_name` label, the
served model name (`RouterMetrics.model_name`, `EngineMetrics.model_name`, set by each service at
start-up). Each is counted in one process only, so a sum over every target never counts twice:

- router (sees every request whole, on its HTTP port's /metrics as on --metrics-port):
  `vllm:prompt_tokens_total` and `vllm:generation_tokens_total` (the usage each request reported),
  `vllm:request_success_total{finished_reason}` (stop, length, abort),
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` (also under its older name
  `vllm:time_per_output_token_seconds`) and `vllm:e2e_request_latency_seconds`.
- prefill and decode (each engine's own state): `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:num_preemptions_total`, and
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` in prompt tokens. A prompt is
  looked up in the prefix cache of the engine that prefills it: the prefill stage, or decode for a
  prompt it prefills itself; KV handed to decode is no lookup there.

Engines count no tokens of their own: a prompt passes through both, the router sees it once.
"""

from __future__ import annotations

import collections
import http.server
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

# Bucket bounds, in base units. Latencies span a cached hit on a tiny model to a long prompt.
# fmt: off
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
HANDOFF_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
TOKENIZER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# fmt: on

OTHER = "other"

# The allowed values of each bounded label. Callers may pass anything; unknown values become "other".
OUTCOMES = frozenset({"ok", "error", "cancelled", "rejected", "invalid", "timeout"})
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "abort", "error", "none"})
TOKEN_KINDS = frozenset({"prompt", "cached", "completion"})
STAGES = frozenset({"tokenizer", "prefill", "decode"})
RATELIMIT_DECISIONS = frozenset({"allowed", "rejected"})
RATELIMIT_LIMITS = frozenset({"none", "requests", "tokens", "request_size"})
TRANSPORTS = frozenset({"shm", "grpc", "mooncake", "nixl", "local"})
HANDOFF_FAILURE_REASONS = frozenset(
    {"timeout", "checksum", "connection", "unreachable", "lease_expired", "cancelled", "no_space", "protocol"}
)
TOKENIZER_RPCS = frozenset({"Tokenize", "TokenizeBatch", "CountTokens", "Detokenize", "GetInfo"})
GRPC_CODES = frozenset({
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
})  # fmt: skip

# The label value until a service names its model (RouterConfig's default name).
DEFAULT_MODEL_NAME = "qwen"
# Our finish reasons as vLLM's `finished_reason` (a tool call ends a sequence with vLLM's "stop").
VLLM_FINISHED_REASONS = {"stop": "stop", "tool_calls": "stop", "content_filter": "stop", "length": "length",
                         "abort": "abort"}


def bounded(value: str, allowed: frozenset[str]) -> str:
    """`value` if it is one of `allowed`, else "other" — keeps a label's cardinality fixed."""
    return value if value in allowed else OTHER


class BoundedLabel:
    """Admits the first `limit` distinct values of an open-ended label (tenant), then "other".

    Thread-safe; the set only grows, so a value once admitted keeps its own series.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        """The label value to use for `value`."""
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return OTHER


class VllmRouterMetrics:
    """vLLM's request-level metrics by vLLM's names, each labelled with the served model (`model_name`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, model = registry, ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Prompt tokens of finished requests, cached ones included.",
            model,
            registry=r,
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated for finished requests.", model, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that ended with a finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from request arrival to the first streamed token.",
            model,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive token deliveries of one request.",
            model,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "The same observations as vllm:inter_token_latency_seconds, under vLLM's older name.",
            model,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from request arrival to its terminal event.",
            model,
            buckets=E2E_BUCKETS,
            registry=r,
        )


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
            "qwenserve_router_requests_total",
            "Finished requests by outcome and finish reason.",
            ["outcome", "finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "qwenserve_router_ttft_seconds",
            "Time from request arrival to the first streamed token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "qwenserve_router_inter_token_latency_seconds",
            "Time between successive token deliveries of one request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "qwenserve_router_e2e_latency_seconds",
            "Time from request arrival to its terminal event.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "qwenserve_router_queue_time_seconds",
            "Time a request waited in the router before being sent to a worker.",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "qwenserve_router_in_flight_requests",
            "Requests accepted and not yet finished.",
            registry=r,
        )
        self.retries = Counter(
            "qwenserve_router_retries_total",
            "Calls to a stage retried on another worker.",
            ["stage"],
            registry=r,
        )
        self.failovers = Counter(
            "qwenserve_router_failovers_total",
            "Workers taken out of rotation (circuit opened) by stage.",
            ["stage"],
            registry=r,
        )
        self.ratelimit_decisions = Counter(
            "qwenserve_router_ratelimit_decisions_total",
            "Rate-limit decisions; `limit` names the limit that rejected (none when allowed).",
            ["decision", "limit"],
            registry=r,
        )
        self.tokens = Counter(
            "qwenserve_router_tokens_total",
            "Tokens by tenant and kind (prompt, cached, completion, reasoning).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tier_tokens = Counter(
            "qwenserve_router_tier_tokens_total",
            "Tokens by tenant tier (the key file's tiers; none: no tier) and kind (prompt, cached, completion, "
            "reasoning).",
            ["tier", "kind"],
            registry=r,
        )
        self.held_requests = Gauge(
            "qwenserve_router_held_requests",
            "Requests held for a stage that has no worker (scaled to zero) while one starts; the operator scales "
            "the stage up when it sees them.",
            ["model", "worker_stage"],
            registry=r,
        )
        self.cold_starts = Counter(
            "qwenserve_router_cold_starts_total",
            "Requests held for a stage scaled to zero, by how the wait ended (served, timed_out).",
            ["worker_stage", "outcome"],
            registry=r,
        )
        self.available_workers = Gauge(
            "qwenserve_router_available_workers",
            "Workers of a stage the router can send requests to now (known, not circuit-broken, not draining); "
            "0: the stage cannot serve.",
            ["model", "worker_stage"],
            registry=r,
        )
        self.fallbacks = Counter(
            "qwenserve_router_fallbacks_total",
            "Requests handed from a model whose decode workers were unavailable to its fallback.",
            ["model", "fallback"],
            registry=r,
        )
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


class VllmEngineMetrics:
    """vLLM's scheduler and cache metrics by vLLM's names, each labelled with the served model (`model_name`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, model = registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", model, registry=r)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests queued for admission to the batch.", model, registry=r
        )
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 0..1 (1 means every block in use).",
            model,
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            model,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            model,
            registry=r,
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).", model, registry=r
        )


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
            "qwenserve_engine_running_requests", "Requests in the running batch.", registry=r
        )
        self.waiting = Gauge(
            "qwenserve_engine_waiting_requests",
            "Requests queued for admission to the batch.",
            registry=r,
        )
        self.batch_size = Histogram(
            "qwenserve_engine_batch_size",
            "Requests in each engine step.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "qwenserve_engine_step_tokens",
            "Tokens computed in each engine step (prefill chunks + decode).",
            buckets=STEP_TOKEN_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "qwenserve_engine_step_seconds",
            "Wall time of each engine step (schedule, forward, sample).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "qwenserve_kv_blocks_used", "KV cache blocks referenced by requests.", registry=r
        )
        self.kv_blocks_free = Gauge(
            "qwenserve_kv_blocks_free",
            "KV cache blocks free or reclaimable (unreferenced cached blocks).",
            registry=r,
        )
        self.kv_blocks_total = Gauge("qwenserve_kv_blocks_total", "KV cache blocks in the pool.", registry=r)
        self.kv_blocks_usage_ratio = Gauge(
            "qwenserve_kv_blocks_usage_ratio",
            "Used KV blocks over all KV blocks, 0..1.",
            registry=r,
        )
        self.prefix_cache_hit_ratio = Gauge(
            "qwenserve_prefix_cache_hit_ratio",
            "Share of prompt tokens served from the prefix cache, 0..1, as reported by the engine.",
            registry=r,
        )
        self.throughput = Gauge(
            "qwenserve_engine_throughput_tokens_per_second",
            "Tokens computed per second (prompt and generated) over the last few seconds; for status views,"
            " dashboards should prefer rate(qwenserve_engine_step_tokens_sum[1m]).",
            registry=r,
        )
        self.preemptions = Counter(
            "qwenserve_engine_preemptions_total",
            "Requests preempted (blocks freed, recomputed later).",
            registry=r,
        )
        self.prefill_only_steps = Counter(
            "qwenserve_engine_prefill_only_steps_total",
            "Steps that left the decodes out to drain a burst of queued prompts (short_first admission).",
            registry=r,
        )
        self._last_counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe_step(self, batch_size: int, tokens: int, seconds: float) -> None:
        """Record one engine step."""
        self.batch_size.observe(batch_size)
        self.step_tokens.observe(tokens)
        self.step_time.observe(seconds)

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
        self.bytes = Counter(
            "qwenserve_handoff_bytes_total",
            "KV cache bytes handed off, by transport.",
            ["transport"],
            registry=r,
        )
        self.seconds = Histogram(
            "qwenserve_handoff_seconds",
            "Duration of one KV handoff, by transport.",
            ["transport"],
            buckets=HANDOFF_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "qwenserve_handoff_failures_total",
            "Failed KV handoffs by transport and reason.",
            ["transport", "reason"],
            registry=r,
        )
        self.leases_outstanding = Gauge(
            "qwenserve_handoff_leases_outstanding",
            "Exported KV leases not yet released or expired.",
            registry=r,
        )
        self.leases_reclaimed = Counter(
            "qwenserve_handoff_leases_reclaimed_total",
            "Leases reclaimed after expiry (importer never acked).",
            registry=r,
        )

    def record_transfer(self, transport: str, nbytes: int, seconds: float) -> None:
        """Record one successful handoff."""
        t = bounded(transport, TRANSPORTS)
        self.bytes.labels(t).inc(nbytes)
        self.seconds.labels(t).observe(seconds)

    def record_failure(self, transport: str, reason: str) -> None:
        """Record one failed handoff."""
        self.failures.labels(bounded(transport, TRANSPORTS), bounded(reason, HANDOFF_FAILURE_REASONS)).inc()


class TokenizerMetrics:
    """The tokenizer service's request, text, token and latency metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "qwenserve_tokenizer_requests_total",
            "Tokenizer RPCs by method and gRPC status code.",
            ["rpc", "code"],
            registry=r,
        )
        self.texts = Counter("qwenserve_tokenizer_texts_total", "Texts or chats tokenized.", registry=r)
        self.tokens = Counter(
            "qwenserve_tokenizer_tokens_total", "Token ids produced or consumed.", registry=r
        )
        self.latency = Histogram(
            "qwenserve_tokenizer_latency_seconds",
            "Tokenizer RPC handling time by method.",
            ["rpc"],
            buckets=TOKENIZER_BUCKETS,
            registry=r,
        )

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


def update_engine_gauges(stats: EngineStats, registry: CollectorRegistry | None = None) -> None:
    """Shorthand for `engine_metrics(registry).update_from_stats(stats)`."""
    engine_metrics(registry).update_from_stats(stats)


class MetricsServer:
    """An HTTP server on its own daemon thread: `/metrics`, `/healthz` (live), `/readyz` (ready).

    `live` and `ready` are callables the service supplies (e.g. from its health object); they may
    be set after start, since the server usually starts before the model is loaded. Without
    `live`, /healthz answers 200 while the process serves HTTP; without `ready`, /readyz answers
    503 so an unwired readiness probe is never mistaken for a ready pod.
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "0.0.0.0",
        registry: CollectorRegistry | None = None,
        live: Callable[[], bool] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.live = live
        self.ready = ready
        self._httpd = http.server.ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"metrics-http-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """Base URL of the server, for logs and tests."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def metrics_page(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """`registry` in the exposition format the `Accept` header asks for, and its content type."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def _probe(check: Callable[[], bool] | None, default: bool) -> bool:
    if check is None:
        return default
    try:
        return bool(check())
    except Exception:  # a probe that raises is a failing probe, and the reason belongs in the log
        log.exception("health probe raised")
        return False


def _make_handler(server: MetricsServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/metrics":
                self._reply(200, *metrics_page(server.registry, self.headers.get("Accept", "")))
            elif path == "/healthz":
                ok = _probe(server.live, default=True)
                self._reply(200 if ok else 503, b"ok\n" if ok else b"not live\n")
            elif path == "/readyz":
                ok = _probe(server.ready, default=False)
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            # Prometheus scrapes every few seconds; one access line per scrape is noise.
            return

    return Handler


def serve_metrics(
    port: int = 0,
    host: str = "0.0.0.0",
    registry: CollectorRegistry | None = None,
    live: Callable[[], bool] | None = None,
    ready: Callable[[], bool] | None = None,
) -> MetricsServer:
    """Start a `MetricsServer` and return it (use `.port`, `.close()`, set `.ready` later)."""
    return MetricsServer(port, host, registry, live=live, ready=ready)


def start_metrics_server(
    port: int,
    host: str = "0.0.0.0",
    registry: CollectorRegistry | None = None,
    *,
    live: Callable[[], bool] | None = None,
    ready: Callable[[], bool] | None = None,
) -> int:
    """Serve /metrics (plus /healthz, /readyz) on `host:port` in a daemon thread; return the bound port.

    Port 0 picks a free port. The server lives as long as the process; use `serve_metrics` for a
    handle that can be closed or given its `live`/`ready` callables after start.
    """
    server = serve_metrics(port, host, registry, live=live, ready=ready)
    _servers.append(server)
    return server.port


# Keeps servers started by start_metrics_server reachable, so they are never collected mid-serve.
_servers: list[MetricsServer] = []
