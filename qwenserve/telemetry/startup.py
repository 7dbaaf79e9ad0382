"""What every service does first: logging (plain or JSON lines) and tracing from the environment.

    add_telemetry_flags(parser)               # --log-json, --log-level
    start_telemetry("decode", args.log_json, args.log_level)
    ...
    stop_telemetry()                          # flushes spans still buffered

Tracing follows the standard `OTEL_*` variables (see `qwenserve.telemetry.tracing`): off unless an
exporter or an OTLP endpoint is configured.
"""

from __future__ import annotations

import argparse
import logging

from qwenserve.telemetry.logs import capture_warnings_and_crashes, json_logs_requested, setup_logging
from qwenserve.telemetry.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


def add_telemetry_flags(parser: argparse.ArgumentParser) -> None:
    """`--log-json` (default: QWENSERVE_LOG_FORMAT=json) and `--log-level` (default: QWENSERVE_LOG_LEVEL)."""
    parser.add_argument("--log-json", action="store_true", default=None,
                        help="log one JSON object per line [env QWENSERVE_LOG_FORMAT=json]")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING, ... [env QWENSERVE_LOG_LEVEL]")


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
