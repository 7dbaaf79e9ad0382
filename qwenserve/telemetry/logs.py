"""Logging for every service: a request id and the trace/span ids on each record.

Plain text by default, one JSON object per line with `setup_logging(json=True)`. The request id
lives in a contextvar, so it follows a request across `await`s and into tasks created while it
is bound, without being passed through every function.

Log records go to stderr. The lines a stage writes for whoever started it (the address it listens on,
on stdout; its configuration, "draining", "cannot start: ...", on stderr) go through `console()`: the
bare text with plain logs, exactly as `print` wrote it, a JSON record with JSON logs. Under JSON logs a
stage also sends warnings and uncaught exceptions through logging (`capture_warnings_and_crashes`), so
that every line it writes is a JSON object.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json as jsonlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from opentelemetry import trace

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "qwenserve_request_id", default=None
)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is worth keeping.
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "request_id",
    "trace_id",
    "span_id",
    "taskName",
    "rid_text",
    "trace_text",
    "console_stream",
}
CONSOLE_LOGGER = "qwenserve.console"

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s [rid=%(rid_text)s trace=%(trace_text)s] %(message)s"


@contextlib.contextmanager
def bind_request_id(request_id: str) -> Iterator[None]:
    """Bind `request_id` for the duration of the block (logs and new spans pick it up).

    Also tags the span that is current on entry, so a span started before the id was known
    (the router's root span, a server span) still carries it.
    """
    token = request_id_var.set(request_id)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("qwenserve.request_id", request_id)
    try:
        yield
    finally:
        reset_request_id(token)


def reset_request_id(token: contextvars.Token[str | None]) -> None:
    """Undo a `request_id_var.set`. A streaming handler may be closed from another context (the client
    left); that context's copy of the variable dies with it, so there is nothing to restore there."""
    try:
        request_id_var.reset(token)
    except ValueError:
        return


class RequestContextFilter(logging.Filter):
    """Adds `request_id`, `trace_id` and `span_id` to every record ("" when there is none).

    Attached to the handler rather than a logger, so records from any library's logger that
    reach the handler get the fields too.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Annotate the record; never drops it."""
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get() or ""
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = format(ctx.trace_id, "032x")
            record.span_id = format(ctx.span_id, "016x")
        else:
            record.trace_id = ""
            record.span_id = ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, trace_id, span_id.

    Fields passed with `extra=` are included as they are (or as their `repr` when JSON cannot
    hold them); an exception becomes an `exception` string with the traceback.
    """

    def format(self, record: logging.LogRecord) -> str:
        """Render `record` as a single JSON line."""
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", ""),
            "trace_id": getattr(record, "trace_id", ""),
            "span_id": getattr(record, "span_id", ""),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return jsonlib.dumps(out, default=repr, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """`PLAIN_FORMAT`, with "-" standing in for an absent request or trace id."""

    def __init__(self, fmt: str = PLAIN_FORMAT) -> None:
        super().__init__(fmt)

    def format(self, record: logging.LogRecord) -> str:
        """Render `record` as one human-readable line."""
        record.rid_text = getattr(record, "request_id", "") or "-"
        record.trace_text = getattr(record, "trace_id", "") or "-"
        return super().format(record)


# The handlers this module installed last, so a second setup_logging replaces rather than doubles them.
_installed_handler: logging.Handler | None = None
_console_handlers: list[logging.Handler] = []


def json_logs_requested(json: bool | None = None) -> bool:
    """`json` when given, else whether `QWENSERVE_LOG_FORMAT=json` asks for JSON lines."""
    if json is not None:
        return json
    return os.environ.get("QWENSERVE_LOG_FORMAT", "plain").strip().lower() == "json"


def setup_logging(
    json: bool | None = None, level: str | None = None, stream: TextIO | None = None,
    console_stdout: TextIO | None = None,
) -> logging.Handler:
    """Configure the root logger once per process: plain text or JSON lines, with request context.

    `json` defaults to `QWENSERVE_LOG_FORMAT=json` (the operator sets "plain" or "json");
    `level` is a name ("DEBUG", "info", ...), defaulting to `QWENSERVE_LOG_LEVEL` or INFO.
    `stream` defaults to stderr, `console_stdout` (where `console()` writes its stdout lines) to
    stdout. Calling it again replaces the handlers installed by the previous call; handlers installed
    by others stay. Returns the root logger's handler.
    """
    global _installed_handler
    json = json_logs_requested(json)
    if level is None:
        level = os.environ.get("QWENSERVE_LOG_LEVEL", "INFO")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter() if json else PlainFormatter())
    root = logging.getLogger()
    if _installed_handler is not None:
        root.removeHandler(_installed_handler)
    root.addHandler(handler)
    root.setLevel(numeric)
    _installed_handler = handler

    console_logger = logging.getLogger(CONSOLE_LOGGER)
    for old in _console_handlers:
        console_logger.removeHandler(old)
    _console_handlers.clear()
    for name, out in (("stdout", console_stdout or sys.stdout), ("stderr", stream or sys.stderr)):
        console_handler = logging.StreamHandler(out)
        console_handler.addFilter(RequestContextFilter())
        console_handler.addFilter(_ConsoleStream(name))
        console_handler.setFormatter(JsonFormatter() if json else logging.Formatter("%(message)s"))
        console_logger.addHandler(console_handler)
        _console_handlers.append(console_handler)
    console_logger.setLevel(logging.DEBUG)  # shown whatever the log level: people and programs wait for them
    console_logger.propagate = False
    return handler


def console(
    message: str, *args: object, level: int = logging.INFO, stderr: bool = False, **fields: object
) -> None:
    """One line for whoever started the process: on stdout what programs wait for ("decode listening on
    127.0.0.1:50053"), on stderr (`stderr=True`) what a person reads ("decode draining (grace 10s)").
    The bare text with plain logs, as `print` writes it; a JSON record (`fields` as extra keys) with JSON
    logs. Shown whatever the log level; before `setup_logging`, printed (JSON if the environment asks)."""
    if not _console_handlers:
        text = message % args if args else message
        if json_logs_requested():
            record = logging.getLogger(CONSOLE_LOGGER).makeRecord(
                CONSOLE_LOGGER, level, __file__, 0, message, args, None, extra=fields)
            text = JsonFormatter().format(record)
        print(text, file=sys.stderr if stderr else sys.stdout, flush=True)
        return
    extra = {**fields, "console_stream": "stderr" if stderr else "stdout"}
    logging.getLogger(CONSOLE_LOGGER).log(level, message, *args, extra=extra)


class _ConsoleStream(logging.Filter):
    """Passes the console records meant for one stream ("stdout" or "stderr")."""

    def __init__(self, stream: str) -> None:
        super().__init__()
        self.stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        """True when `record` is for this handler's stream."""
        return getattr(record, "console_stream", "stdout") == self.stream


# The exception hooks in place before capture_warnings_and_crashes installed ours.
_previous_hooks: tuple[Any, Any] | None = None


def capture_warnings_and_crashes(enabled: bool = True) -> None:
    """Route what Python writes to stderr behind logging's back through it: `warnings.warn` (the
    `py.warnings` logger) and uncaught exceptions in any thread (`qwenserve.crash`, with the traceback).
    `enabled=False` puts back the hooks that were there before."""
    global _previous_hooks
    logging.captureWarnings(enabled)
    if enabled and _previous_hooks is None:
        _previous_hooks = (sys.excepthook, threading.excepthook)
        sys.excepthook, threading.excepthook = _log_uncaught, _log_uncaught_in_thread
    elif not enabled and _previous_hooks is not None:
        sys.excepthook, threading.excepthook = _previous_hooks
        _previous_hooks = None


def _log_uncaught(kind: type[BaseException], error: BaseException, tb: Any) -> None:
    logging.getLogger("qwenserve.crash").critical(
        "uncaught %s: %s", kind.__name__, error, exc_info=(kind, error, tb)
    )


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("qwenserve.crash").critical(
        "uncaught %s in thread %s: %s", args.exc_type.__name__, name, args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),  # type: ignore[arg-type]
    )
