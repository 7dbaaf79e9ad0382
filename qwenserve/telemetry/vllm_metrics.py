"""vLLM's metrics by vLLM's names, next to ours, for tools built for vLLM.

vLLM's Grafana dashboard, the production-stack router and autoscalers reading vLLM's names find them
here, each with a `model_name` label, the served model name (`RouterMetrics.model_name`,
`EngineMetrics.model_name`, set by each service at start-up). Each is counted in one process only, so
a sum over every target never counts twice:

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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qwenserve.telemetry.series import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

# Our finish reasons as vLLM's `finished_reason` (a tool call ends a sequence with vLLM's "stop").
VLLM_FINISHED_REASONS = {"stop": "stop", "tool_calls": "stop", "content_filter": "stop", "length": "length",
                         "abort": "abort"}


class VllmRouterMetrics:
    """vLLM's request-level metrics by vLLM's names, each labelled with the served model (`model_name`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, model = registry, ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests, cached ones included.", model,
            registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated for finished requests.", model, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Requests that ended with a finish reason (stop, length, abort).",
            ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time from request arrival to the first streamed token.",
            model, buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Time between successive token deliveries of one request.",
            model, buckets=ITL_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "The same observations as vllm:inter_token_latency_seconds, under vLLM's older name.", model,
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Time from request arrival to its terminal event.", model,
            buckets=E2E_BUCKETS, registry=r)


class VllmEngineMetrics:
    """vLLM's scheduler and cache metrics by vLLM's names, each labelled with the served model (`model_name`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, model = registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", model, registry=r)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests queued for admission to the batch.", model, registry=r)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage, 0..1 (1 means every block in use).", model, registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", model, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                         model, registry=r)
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).", model, registry=r)
