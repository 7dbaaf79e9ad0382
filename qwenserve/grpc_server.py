"""Run a grpc.aio server the way every qwen-serve stage does.

One function, `serve`, owns a stage's life: bind host:port (port 0 picks a free port), register
the stage's servicers, answer gRPC health checks (NOT_SERVING until the stage's warm-up has
finished, SERVING after, NOT_SERVING again while draining), offer reflection, print one
`<name> listening on host:port` line on stdout, and stop gracefully on SIGTERM / SIGINT: new calls are
refused, calls in flight get `grace_s` seconds to finish. Its lines go through `telemetry.logs.console`,
so they are JSON records under JSON logs and the bare text otherwise.

A stage that can no longer serve (its engine's compute loop died) resolves the `failure` future it
gave `serve`: health turns NOT_SERVING on every surface at once, the server drains, and `run_stage`
exits with FAULT_EXIT_CODE so that the supervisor (Kubernetes, `qwen-serve up`) restarts it.

Every server carries the tracing interceptors (the request id and W3C trace context from the
caller's metadata). With `metrics_port` set, `serve` also runs the Prometheus endpoint, whose
`/readyz` follows the same state as gRPC health (`ServeState`): 503 while warming up, 200 while
serving, 503 again while draining; `/healthz` stays 200 until the process has stopped serving or failed.

    config = GrpcServerConfig(host="127.0.0.1", port=0)
    asyncio.run(serve(config, "tokenizer", ["qwenserve.v1.Tokenizer"], register, warm_up))
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from qwenserve import supervision
from qwenserve.flags import print_config
from qwenserve.preflight import one_line
from qwenserve.stage_auth import StageAuthInterceptor
from qwenserve.stage_secret import StageSecret
from qwenserve.telemetry.logs import console
from qwenserve.telemetry.metrics_server import MetricsServer
from qwenserve.telemetry.startup import start_telemetry, stop_telemetry
from qwenserve.telemetry.tracing import server_interceptors

log = logging.getLogger("qwenserve.grpc_server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Exit status of a stage that stopped on an internal fault (EX_SOFTWARE): restart it.
FAULT_EXIT_CODE = 70


class StageFailed(Exception):
    """The stage stopped serving because of an internal fault (the reason is the message)."""


@dataclass(frozen=True)
class GrpcServerConfig:
    """Network settings shared by every stage's server."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; the bound one is printed and returned
    max_message_bytes: int = 64 << 20  # largest request or response message
    grace_s: float = 5.0  # how long in-flight calls may run on after SIGTERM
    max_concurrent_rpcs: int | None = None  # beyond this, calls fail fast with RESOURCE_EXHAUSTED
    credentials: grpc.ServerCredentials | None = None  # TLS; None: plaintext (the local default)
    metrics_port: int = 0  # Prometheus /metrics, /healthz, /readyz on `host`; 0: none
    metrics_registry: CollectorRegistry | None = field(default=None, compare=False)  # None: the default one
    # Callers must present this deployment's stage credential (all but health and reflection); None: anyone may call.
    stage_secret: StageSecret | None = field(default=None, repr=False)


class ServeState:
    """Where a stage is in its life, shared by gRPC health and the HTTP probes.

    starting -> serving -> draining -> stopped, or -> failed from any phase. Ready means "serving"; live
    means "neither stopped nor failed" (a stage that is warming up or draining is alive, it just should
    not get new work; a failed one must be restarted).
    """

    STARTING, SERVING, DRAINING, STOPPED, FAILED = "starting", "serving", "draining", "stopped", "failed"

    def __init__(self) -> None:
        self.phase = self.STARTING

    def ready(self) -> bool:
        """True only between the end of warm-up and the start of draining."""
        return self.phase == self.SERVING

    def live(self) -> bool:
        """True until the server has stopped or failed."""
        return self.phase not in (self.STOPPED, self.FAILED)


Register = Callable[[grpc.aio.Server], None]
WarmUp = Callable[[], Awaitable[None]]


class StageServer:
    """A started grpc.aio server with health and reflection; `serve` drives one through its life."""

    def __init__(
        self, config: GrpcServerConfig, name: str, service_names: Sequence[str], register: Register
    ) -> None:
        self.config = config
        self.name = name
        self.service_names = list(service_names)
        options = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Callers (the router) send keepalive pings every 10 s, also between calls, to notice a hung
            # stage; without these the server would answer them with GOAWAY "too many pings".
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),  # the minimum between received pings
            # A long prompt's prefill is a unary call with no data frames for minutes: pings then arrive
            # "without data", and a ping deemed early must never cost the call its connection.
            ("grpc.http2.max_ping_strikes", 0),
        ]
        # The credential is checked first: a refused call costs no span, no parsing, no handler.
        guard = [StageAuthInterceptor(config.stage_secret)] if config.stage_secret is not None else []
        self.server = grpc.aio.server(
            options=options, maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            interceptors=[*guard, *server_interceptors()],
        )
        self.state = ServeState()
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        register(self.server)
        reflection.enable_server_reflection(
            [
                *self.service_names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        self.port = 0

    async def start(self) -> int:
        """Bind and start; every service reports NOT_SERVING until `set_serving`. Returns the bound port."""
        address = f"{self.config.host}:{self.config.port}"
        try:
            if self.config.credentials is not None:
                self.port = self.server.add_secure_port(address, self.config.credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # gRPC's "failed to bind"; the cause is only in its C core's own log line
            self.port = 0
        if self.port == 0:
            raise OSError(f"{self.name}: cannot bind {address} (in use, or not a local address?)")
        await self._set_all(NOT_SERVING)
        await self.server.start()
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        console("%s listening on %s:%d", self.name, host, self.port, stage=self.name, port=self.port)
        return self.port

    async def set_serving(self) -> None:
        """Report SERVING for the stage's services and the server as a whole ("")."""
        await self._set_all(SERVING)
        self.state.phase = ServeState.SERVING

    async def fail(self) -> None:
        """Report NOT_SERVING and not live: the stage cannot serve any more and must be restarted."""
        self.state.phase = ServeState.FAILED
        await self._set_all(NOT_SERVING)

    async def stop(self) -> None:
        """Report NOT_SERVING, refuse new calls, let calls in flight finish within the grace period."""
        failed = self.state.phase == ServeState.FAILED
        if not failed:
            self.state.phase = ServeState.DRAINING
        await self._set_all(NOT_SERVING)
        await self.server.stop(self.config.grace_s)
        if not failed:
            self.state.phase = ServeState.STOPPED

    async def _set_all(self, status: int) -> None:
        for service in ["", *self.service_names]:
            await self.health.set(service, status)


async def serve(
    config: GrpcServerConfig,
    name: str,
    service_names: Sequence[str],
    register: Register,
    warm_up: WarmUp | None = None,
    stop_signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
    on_ready: Callable[[StageServer], None] | None = None,
    failure: asyncio.Future[str] | None = None,
    on_drain: Callable[[], None] | None = None,
) -> None:
    """Run a stage's server until SIGTERM / SIGINT (or cancellation), then drain and stop.

    `register(server)` adds the stage's servicers; `service_names` are their full names (for
    health and reflection). `warm_up()` runs after the port is bound and before health says
    SERVING; if it raises, the server stops and the error propagates. With `config.metrics_port`
    the metrics endpoint starts before warm-up, so probes see "not ready" rather than nothing.
    When `failure` resolves (with a reason), health says NOT_SERVING everywhere, the server
    drains and StageFailed is raised. `on_drain()` runs when a stop signal arrives, before the grace
    period starts.
    """
    stage = StageServer(config, name, service_names, register)
    await stage.start()
    metrics: MetricsServer | None = None
    if config.metrics_port:
        try:
            metrics = MetricsServer(config.metrics_port, config.host, config.metrics_registry,
                                    live=stage.state.live, ready=stage.state.ready)
            console("%s metrics on %s/metrics", name, metrics.url, stage=name)
        except OSError as e:
            # Serving without metrics beats not serving; HTTP probes against this port will say so.
            log.error("%s: cannot serve metrics on %s:%d (%s); continuing without /metrics",
                      name, config.host, config.metrics_port, e)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in stop_signals:
        loop.add_signal_handler(sig, stopping.set)
    try:
        if warm_up is not None and not await _unless_stopped(warm_up(), stopping):
            console("%s stopped during warm-up", name, stderr=True)
            return
        _settle_garbage_collector()
        supervision.lower_priority()  # start-up ran at the launcher's priority (supervision.py says why)
        await stage.set_serving()
        log.info("%s is serving", name)
        if on_ready is not None:
            on_ready(stage)
        reason = await _stopped_or_failed(stopping, failure)
        if reason is not None:
            await stage.fail()
            console("%s failed: %s; draining (grace %gs), then exiting", name, reason, config.grace_s,
                    level=logging.ERROR, stderr=True)
            raise StageFailed(reason)
        console("%s draining (grace %gs)", name, config.grace_s, stderr=True)
        if on_drain is not None:
            on_drain()
    finally:
        for sig in stop_signals:
            loop.remove_signal_handler(sig)
        try:
            await stage.stop()
        finally:
            if metrics is not None:
                metrics.close()


async def _stopped_or_failed(stopping: asyncio.Event, failure: asyncio.Future[str] | None) -> str | None:
    """Wait for a stop signal or a failure; the failure's reason, or None when asked to stop."""
    stopped = asyncio.ensure_future(stopping.wait())
    waiting: set[asyncio.Future[Any]] = {stopped} if failure is None else {stopped, failure}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    return failure.result() if failure is not None and failure.done() else None


async def _unless_stopped(work: Awaitable[None], stopping: asyncio.Event) -> bool:
    """Run `work` unless a stop signal comes first (a warm-up waiting for a peer must not block SIGTERM).
    True when the work finished; its exception propagates."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    task.result()
    return True


def run_stage(
    name: str,
    config: Any,
    run: Callable[[Any], Awaitable[None]],
    startup_errors: tuple[type[Exception], ...] = (),
) -> int:
    """A stage process from its parsed config to its exit code: logging and tracing, the one config line,
    the event loop. `startup_errors` become a one-line message and exit code 1 instead of a traceback; a stage
    that failed while serving (StageFailed) exits with FAULT_EXIT_CODE."""
    start_telemetry(f"qwenserve-{name}", getattr(config, "log_json", None), getattr(config, "log_level", None))
    print_config(name, config)
    try:
        asyncio.run(run(config))
    except startup_errors as err:
        log.debug("%s: cannot start", name, exc_info=True)
        console("%s: cannot start: %s", name, one_line(err), level=logging.ERROR, stderr=True)
        return 1
    except StageFailed as err:
        console("%s: exiting after an internal fault: %s", name, err, level=logging.CRITICAL,
                stderr=True)
        return FAULT_EXIT_CODE
    finally:
        stop_telemetry()
    return 0


def _settle_garbage_collector() -> None:
    """Move everything alive after warm-up (modules, weights' wrappers, vocabularies) out of the
    collector's view, and collect less often: full collections of those objects showed up as
    milliseconds of stall in streaming stages' profiles, on every process, for nothing."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
