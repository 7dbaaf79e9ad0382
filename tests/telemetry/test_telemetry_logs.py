"""Logs: request id and trace ids on every record, plain or JSON lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import threading
import warnings

import pytest

from qwenserve.telemetry import tracing
from qwenserve.telemetry.logs import (
    bind_request_id,
    capture_warnings_and_crashes,
    console,
    request_id_var,
    setup_logging,
)
from qwenserve.telemetry.tracing import Attr


@pytest.fixture
def plain(restore_root_logger) -> io.StringIO:
    out = io.StringIO()
    setup_logging(json=False, level="INFO", stream=out)
    return out


@pytest.fixture
def jsonl(restore_root_logger) -> io.StringIO:
    out = io.StringIO()
    setup_logging(json=True, level="debug", stream=out)
    return out


def _records(out: io.StringIO, prefix: str = "qwenserve") -> list[dict]:
    """The JSON records of our loggers (asyncio and grpc log at DEBUG too)."""
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    return [r for r in records if r["logger"].startswith(prefix)]


def test_plain_lines_carry_the_request_id(plain):
    log = logging.getLogger("qwenserve.router")
    log.info("outside")
    with bind_request_id("req-a"):
        log.info("inside %d", 42)
    log.debug("below the level")
    first, second = plain.getvalue().splitlines()
    assert first.endswith("INFO qwenserve.router [rid=- trace=-] outside")
    assert second.endswith("INFO qwenserve.router [rid=req-a trace=-] inside 42")


def test_json_lines_have_ids_extras_and_exceptions(jsonl):
    log = logging.getLogger("qwenserve.decode")
    with bind_request_id("req-b"):
        log.debug("step", extra={"batch": 8, "blocks": {"used": 3}})
        try:
            raise ValueError("bad block table")
        except ValueError:
            log.exception("step failed")
    log.warning("idle")
    step, failed, idle = _records(jsonl)
    assert step["message"] == "step" and step["level"] == "DEBUG" and step["logger"] == "qwenserve.decode"
    assert step["request_id"] == "req-b" and step["batch"] == 8 and step["blocks"] == {"used": 3}
    assert step["ts"].endswith("+00:00")
    assert failed["request_id"] == "req-b" and "ValueError: bad block table" in failed["exception"]
    assert idle["request_id"] == "" and idle["trace_id"] == "" and idle["span_id"] == ""


def test_json_lines_carry_the_current_trace_and_span(jsonl, spans):
    with tracing.get_tracer("t").start_as_current_span("prefill") as span, bind_request_id("req-c"):
        logging.getLogger("qwenserve.prefill").info("prefilled")
    (record,) = _records(jsonl, prefix="qwenserve.prefill")
    ctx = span.get_span_context()
    assert record["trace_id"] == format(ctx.trace_id, "032x")
    assert record["span_id"] == format(ctx.span_id, "016x")
    # Binding after the span started still tags the span.
    (finished,) = spans.get_finished_spans()
    assert finished.attributes[Attr.REQUEST_ID] == "req-c"


async def test_concurrent_requests_keep_their_own_ids(jsonl):
    log = logging.getLogger("qwenserve.router")

    async def handle(rid: str) -> None:
        with bind_request_id(rid):
            for i in range(3):
                log.info("tick %d", i)
                await asyncio.sleep(0)
            assert request_id_var.get() == rid

    await asyncio.gather(handle("r1"), handle("r2"))
    records = _records(jsonl)
    assert len(records) == 6 and {r["request_id"] for r in records} == {"r1", "r2"}
    assert [r["message"] for r in records if r["request_id"] == "r1"] == ["tick 0", "tick 1", "tick 2"]
    assert request_id_var.get() is None


def test_setup_twice_replaces_its_handler(restore_root_logger):
    first, second = io.StringIO(), io.StringIO()
    setup_logging(stream=first)
    setup_logging(json=True, stream=second)
    logging.getLogger("qwenserve.x").warning("once")
    assert first.getvalue() == ""
    assert [r["message"] for r in _records(second)] == ["once"]


def test_format_and_level_fall_back_to_the_environment(restore_root_logger, monkeypatch):
    monkeypatch.setenv("QWENSERVE_LOG_FORMAT", "json")
    monkeypatch.setenv("QWENSERVE_LOG_LEVEL", "warning")
    out = io.StringIO()
    setup_logging(stream=out)
    logging.getLogger("qwenserve.env").info("hidden")
    logging.getLogger("qwenserve.env").warning("shown")
    assert [r["message"] for r in _records(out)] == ["shown"]


def test_unknown_level_is_rejected(restore_root_logger):
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging(level="LOUD")


async def test_request_id_reaches_logs_of_the_next_hop(jsonl, tracing_off, services):
    from qwenserve.v1 import tokenizer_pb2

    with bind_request_id("req-hop"):
        await services.front.GetInfo(tokenizer_pb2.GetInfoRequest())
    backend_lines = _records(jsonl, prefix="backend")
    assert [r["request_id"] for r in backend_lines] == ["req-hop"]


def test_console_lines_are_the_bare_text_with_plain_logs(restore_root_logger):
    out, err = io.StringIO(), io.StringIO()
    setup_logging(json=False, level="ERROR", stream=err, console_stdout=out)
    console("decode listening on %s:%d", "127.0.0.1", 50053, port=50053)
    console("decode draining (grace %gs)", 10.0, stderr=True)
    assert out.getvalue() == "decode listening on 127.0.0.1:50053\n"  # whatever the log level
    assert err.getvalue() == "decode draining (grace 10s)\n"


def test_console_lines_are_json_records_with_json_logs(restore_root_logger):
    out, err = io.StringIO(), io.StringIO()
    setup_logging(json=True, level="WARNING", stream=err, console_stdout=out)
    console("decode listening on %s:%d", "127.0.0.1", 50053, port=50053)
    console("decode: cannot start: %s", "port 50053 is in use", level=logging.ERROR, stderr=True)
    (listening,) = [json.loads(line) for line in out.getvalue().splitlines()]
    (refusal,) = [json.loads(line) for line in err.getvalue().splitlines()]
    assert listening["message"] == "decode listening on 127.0.0.1:50053" and listening["port"] == 50053
    assert listening["level"] == "INFO" and "console_stream" not in listening
    assert refusal["message"] == "decode: cannot start: port 50053 is in use" and refusal["level"] == "ERROR"


def test_json_logs_take_in_warnings_and_uncaught_exceptions(jsonl):
    hooks = (sys.excepthook, threading.excepthook)
    capture_warnings_and_crashes(True)
    try:
        warnings.warn("a deprecated knob", UserWarning, stacklevel=1)
        try:
            raise RuntimeError("the loop died")
        except RuntimeError as e:
            sys.excepthook(type(e), e, e.__traceback__)
        worker = threading.Thread(target=lambda: 1 / 0, name="engine-loop")
        worker.start()
        worker.join()
    finally:
        capture_warnings_and_crashes(False)
    assert (sys.excepthook, threading.excepthook) == hooks
    records = [json.loads(line) for line in jsonl.getvalue().splitlines()]
    warned = [r for r in records if r["logger"] == "py.warnings"]
    crashes = [r for r in records if r["logger"] == "qwenserve.crash"]
    assert len(warned) == 1 and "a deprecated knob" in warned[0]["message"]
    assert [c["message"] for c in crashes] == [
        "uncaught RuntimeError: the loop died", "uncaught ZeroDivisionError in thread engine-loop: division by zero",
    ]
    assert all(c["level"] == "CRITICAL" and "Traceback" in c["exception"] for c in crashes)
