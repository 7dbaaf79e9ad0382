"""What shapes every metric series: histogram bucket bounds and the allowed values of bounded labels.

Labels take values from small fixed sets; anything else is folded into "other" so a bad caller cannot
blow up cardinality. Tenants are capped the same way (`BoundedLabel`).
"""

from __future__ import annotations

import threading

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
STAGES = frozenset({"tokenizer", "prefill", "decode"})
RATELIMIT_LIMITS = frozenset({"none", "requests", "tokens", "request_size"})
TRANSPORTS = frozenset({"shm", "grpc", "mooncake", "nixl", "local"})
# What a model's weights are held as (Precision.labels()'s "weights").
WEIGHT_PRECISIONS = frozenset({"float32", "bfloat16", "float16", "w4a16", "w8a16"})
HANDOFF_FAILURE_REASONS = frozenset(
    {"timeout", "checksum", "connection", "unreachable", "lease_expired", "cancelled", "no_space", "protocol",
     "refused"}
)
# The flags of structured output's bounds, as labels (GrammarLimitExceeded.limit without its dashes).
GRAMMAR_LIMITS = frozenset({"max_grammar_chars", "max_grammar_choices", "grammar_compile_timeout_s",
                            "grammar_compile_memory_mb", "grammar_mask_budget_ms"})
HANDOFF_RPCS = frozenset({"Fetch", "Release"})
HANDOFF_REFUSAL_REASONS = frozenset({"missing", "wrong"})
TOKENIZER_RPCS = frozenset({"Tokenize", "TokenizeBatch", "CountTokens", "Detokenize", "GetInfo"})
GRPC_CODES = frozenset({
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
})  # fmt: skip


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
