"""The observability tests run against the session's traced cluster (tests/conftest.py: `traced_cluster`, whose
services export metrics and send their spans to the `span_receiver` process)."""
