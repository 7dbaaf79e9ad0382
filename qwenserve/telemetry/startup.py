"""What every service does first: logging (plain or JSON lines) and tracing from the environment.

    start_telemetry("decode", args.log_json, args.log_level)
    ...
    stop_telemetry()                          # flushes spans still buffered

Tracing follows the standard `OTEL_*` variables (see `qwenserve.telemetry.tracing`): off unless an
exporter or an OTLP endpoint is configured.
"""

from __future__ import annotations

from qwenserve.telemetry.logs import capture_warnings_and_crashes, json_logs_requested, setup_logging
from qwenserve.telemetry.tracing import setup_tracing, shutdown_tracing


def start_telemetry(service: str, log_json: bool | None = None, log_level: str | None = None) -> None:
    """Install the log handlers and the tracer provider for this process. Under JSON logs warnings and
    uncaught exceptions become log records too, so that every line the process writes is JSON."""
    json = json_logs_requested(log_json)
    setup_logging(json=json, level=log_level)
    capture_warnings_and_crashes(json)
    setup_tracing(service)


def stop_telemetry() -> None:
    """Flush and stop tracing (logging needs no shutdown)."""
    shutdown_tracing()
