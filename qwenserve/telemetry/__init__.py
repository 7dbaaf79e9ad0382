"""Telemetry shared by every service: Prometheus metrics, OpenTelemetry tracing, request-scoped logs.

- `metrics`: metric groups per component (`router_metrics()`, `engine_metrics()`,
  `handoff_metrics()`, `tokenizer_metrics()`) and the `/metrics` HTTP server.
- `tracing`: `setup_tracing()` from the `OTEL_*` environment, gRPC interceptors that carry
  W3C trace context and the request id across hops.
- `logs`: `setup_logging()`, `bind_request_id()`; every record carries request and trace ids.
"""

from qwenserve.telemetry.logs import bind_request_id, current_request_id, request_id_var, setup_logging
from qwenserve.telemetry.metrics import (
    engine_metrics,
    handoff_metrics,
    router_metrics,
    serve_metrics,
    start_metrics_server,
    tokenizer_metrics,
    update_engine_gauges,
)
from qwenserve.telemetry.tracing import (
    client_interceptors,
    get_tracer,
    server_interceptors,
    setup_tracing,
    shutdown_tracing,
)

__all__ = [
    "bind_request_id",
    "client_interceptors",
    "current_request_id",
    "engine_metrics",
    "get_tracer",
    "handoff_metrics",
    "request_id_var",
    "router_metrics",
    "serve_metrics",
    "server_interceptors",
    "setup_logging",
    "setup_tracing",
    "shutdown_tracing",
    "start_metrics_server",
    "tokenizer_metrics",
    "update_engine_gauges",
]
