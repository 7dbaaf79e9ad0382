"""Telemetry shared by every service: Prometheus metrics, OpenTelemetry tracing, request-scoped logs.

- `metrics`: metric groups per component (`router_metrics()`, `engine_metrics()`, `handoff_metrics()`,
  `tokenizer_metrics()`); `vllm_metrics` the same numbers under vLLM's names; `series` the buckets and
  bounded label values they share; `metrics_server` the `/metrics`, `/healthz`, `/readyz` HTTP server.
- `tracing`: `setup_tracing()` from the `OTEL_*` environment, gRPC interceptors that carry
  W3C trace context and the request id across hops; `switchable_tracer` the tracers that follow it.
- `logs`: `setup_logging()`, `bind_request_id()`; every record carries request and trace ids.
- `startup`: what every stage process does first (logging and tracing), and last (flush spans).
"""
