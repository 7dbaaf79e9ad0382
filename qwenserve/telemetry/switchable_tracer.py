"""Tracers that follow whatever `setup_tracing` configured last, and cost one attribute check while it is off.

Modules take their tracer at import time; tests and benchmarks turn tracing on and off many times in one
process. Both work because every call resolves the current provider, kept in `state`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class TracingState:
    """This process's provider while tracing is on (None: off), and its in-memory exporter (tests)."""

    provider: TracerProvider | None = None
    memory: InMemorySpanExporter | None = None
    installed_globally = False


state = TracingState()
_NOOP_TRACER = trace.NoOpTracer()


class _NoSpan:
    """What `start_as_current_span` returns with tracing off: enters to the invalid span, does nothing.

    OpenTelemetry's own no-op still builds a generator and attaches a context per span; this is one
    attribute check and two method calls (bench/telemetry_overhead.py measures both).
    """

    __slots__ = ()

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc_info: object) -> None:
        return None

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        return func


_NO_SPAN = _NoSpan()


class SwitchableTracer(trace.Tracer):
    """A tracer that follows whatever `setup_tracing` configured last, even if fetched before it."""

    def __init__(self, name: str, version: str | None = None) -> None:
        self._name = name
        self._version = version
        self._for: TracerProvider | None = None
        self._tracer: trace.Tracer = _NOOP_TRACER

    def _delegate(self) -> trace.Tracer:
        provider = state.provider
        if provider is None:
            return _NOOP_TRACER
        if provider is not self._for:
            self._tracer = provider.get_tracer(self._name, self._version)
            self._for = provider
        return self._tracer

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        """Start a span on the current provider (the invalid, non-recording span when tracing is off)."""
        if state.provider is None:
            return trace.INVALID_SPAN
        return self._delegate().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        """Start a span and make it current for the `with` block (a do-nothing block when off)."""
        if state.provider is None:
            return _NO_SPAN
        return self._delegate().start_as_current_span(*args, **kwargs)


class SwitchableTracerProvider(trace.TracerProvider):
    """Installed once as the global provider so `opentelemetry.trace.get_tracer` users follow setup too."""

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> trace.Tracer:
        """A tracer bound to whatever provider `setup_tracing` configures."""
        return SwitchableTracer(instrumenting_module_name, instrumenting_library_version)
