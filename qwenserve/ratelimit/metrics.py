"""Prometheus metrics of the rate limiter (default registry, `qwenserve_` names)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

DECISIONS = Counter(
    "qwenserve_ratelimit_decisions_total",
    "Rate-limit decisions by outcome: admitted, rejected, too_large, failed_open, failed_closed.",
    ["decision", "backend"],
)
REJECTIONS = Counter(
    "qwenserve_ratelimit_rejections_total",
    "Rejected requests per tenant and the limit that rejected them (requests, tokens, request_size).",
    ["tenant", "limit"],
)
BACKEND_ERRORS = Counter(
    "qwenserve_ratelimit_backend_errors_total",
    "Errors talking to the rate-limit backend (Redis), by operation (admit, settle).",
    ["backend", "operation"],
)
REFUNDED_TOKENS = Counter(
    "qwenserve_ratelimit_refunded_tokens_total",
    "Tokens given back to tenants' windows when a request used less than its output budget.",
    ["backend"],
)
DECISION_SECONDS = Histogram(
    "qwenserve_ratelimit_decision_seconds",
    "Time to take one admit decision, including the Redis round trip.",
    ["backend"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
