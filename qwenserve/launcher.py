"""LocalCluster: the four stages as separate local processes on loopback, started, watched and stopped together.

Each child runs `qwen-serve serve <stage>` on a free port, with its Prometheus endpoint (/metrics,
/healthz, /readyz) on another; the router is told every stage's metrics address for `qwen-serve
status`. A child's command line is built from its stage's configuration class (`argv_for`): the ports,
addresses and model the cluster chose, plus the stage options it was given (`qwen-serve up`, qwenserve/up.py,
passes on every flag the user gave that the stage defines; secrets go through the child's environment).

The cluster waits until every child's gRPC health check says SERVING (a child that dies meanwhile fails the start,
named with its last line of output); on `stop()` it stops them all. `restart()`
starts a child that exited again on its ports (`qwen-serve up` decides when: qwenserve/restarts.py). Children get SIGTERM from the kernel if the
launcher itself is killed (PR_SET_PDEATHSIG, armed by each child: qwenserve/supervision.py), so no orphans
are left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qwenserve import progress, supervision
from qwenserve.flags import StrictParser, argv_for
from qwenserve.telemetry.logs import console

# Plans a start may try when a picked port was taken before its child bound it.
PORT_ATTEMPTS = 3
# Lines of a child's output kept for a message about it.
LAST_LINES = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the child binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_taken(message: str) -> bool:
    """Whether a child's last line says its port was taken (the stages' own one-line start-up errors)."""
    return "cannot bind" in message or "is in use" in message


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex((host, port)) == 0


@dataclass
class Child:
    """One stage process; its output goes through the launcher, which keeps its last line."""

    name: str
    address: str
    argv: list[str]
    metrics_port: int = 0
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # this child's own variables (secrets: not in argv)
    last_line: str = ""
    relay: threading.Thread | None = None
    restarts: int = 0  # times it was started again after it exited (qwen-serve up, qwenserve/restarts.py)
    # Its last lines of output, for the message naming a stage that keeps failing at start.
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_LINES))

    def died(self) -> str | None:
        """None while running (or not started); else how it ended, with its last line of output."""
        if self.process is None or self.process.poll() is None:
            return None
        if self.relay is not None:
            self.relay.join(2.0)  # the line it printed as it died may still be in the pipe
        code = self.process.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"{self.name} {how}" + (f": {self.last_line}" if self.last_line else " (no output)")


def _relay(child: Child, source: IO[bytes], sink: IO[bytes]) -> None:
    """Copy a child's output to `sink` line by line, remembering its last non-empty line."""
    writable = True
    for raw in iter(source.readline, b""):
        if writable:
            try:
                sink.write(raw)
                sink.flush()
            except (OSError, ValueError):  # a closed terminal or pipe: keep draining, or the child would block
                writable = False
        line = raw.decode("utf-8", "replace").strip()
        if line:
            child.last_line = line
            child.last_lines.append(line)
    source.close()


def stage_configs() -> dict[str, type]:
    """Each stage's configuration class (their flags are the stages' flags)."""
    from qwenserve.stages.decode import DecodeServiceConfig
    from qwenserve.stages.prefill import PrefillServiceConfig
    from qwenserve.stages.router import RouterServiceConfig
    from qwenserve.stages.tokenizer import TokenizerServiceConfig

    return {"tokenizer": TokenizerServiceConfig, "prefill": PrefillServiceConfig, "decode": DecodeServiceConfig,
            "router": RouterServiceConfig}


def stage_parsers(prog: str | None = None) -> dict[str, StrictParser]:
    """Each stage's real, strict parser."""
    from qwenserve.stages.decode import build_parser as decode
    from qwenserve.stages.prefill import build_parser as prefill
    from qwenserve.stages.router import build_parser as router
    from qwenserve.stages.tokenizer import build_parser as tokenizer

    return {"tokenizer": tokenizer(prog), "prefill": prefill(prog), "decode": decode(prog), "router": router(prog)}


def route_args(argv: Sequence[str], stages: Sequence[str]) -> dict[str, list[str]]:
    """Split `argv` (flags and their values) among `stages`: each flag goes to every one of them that defines it.
    A flag none of them defines is a ValueError naming it."""
    parsers = {stage: parser for stage, parser in stage_parsers().items() if stage in stages}
    routed: dict[str, list[str]] = {stage: [] for stage in stages}
    i = 0
    while i < len(argv):
        token = argv[i]
        flag = token.split("=", 1)[0]
        owners = [stage for stage, parser in parsers.items() if flag in parser._option_string_actions]
        if not flag.startswith("--") or not owners:
            raise ValueError(f"{token}: none of {', '.join(stages)} defines this flag")
        action = parsers[owners[0]]._option_string_actions[flag]
        group = list(argv[i:i + 2]) if action.nargs != 0 and "=" not in token else [token]
        for stage in owners:
            routed[stage] += group
        i += len(group)
    return routed


# How long an idle OpenMP thread of an engine spins before it sleeps, where several engines share this host's cores:
# at libgomp's default (300,000 spins, about a millisecond) the threads of one process waiting at the end of each
# parallel region held the cores the other engine's threads needed. On a 2-core Xeon, `qwen-serve up` (a prefill
# and a decode engine packing their weights side by side) was ready in 15.4-17.8 s by default and 10.9-12.0 s at
# 10,000 (1,000, 100,000 and OMP_WAIT_POLICY=passive alike); a single stream's decode ITL the same either way.
SHARED_CORES_SPINCOUNT = "10000"


def shared_cores_openmp(env: dict[str, str]) -> dict[str, str]:
    """The OpenMP setting an engine child gets on cores it shares with the other engines, unless `env` (the user's)
    already sets how OpenMP threads wait."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return {}
    return {"GOMP_SPINCOUNT": SHARED_CORES_SPINCOUNT}


@dataclass
class LocalCluster:
    """The processes of one `qwen-serve up`; usable from tests as a context manager.

    `stage_values` are stage options by field name (`{"served_model_name": "x", "engine"...}` as parsed), given to
    every stage that has them; `extra_worker_args` go to whichever of prefill and decode define each flag, and
    `extra_router_args` to the router.
    """

    model: Path
    # The decode processes' own checkpoint: the same model in another precision (it continues the prefill's KV).
    decode_model: Path | None = None
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    router_port: int = 0
    http_port: int = 0
    kv_transfer: str = "shm"
    extra_router_args: list[str] = field(default_factory=list)
    extra_worker_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    # Prefill's long prompt steps are throughput work; on one host they yield the cores to the latency-critical
    # decode steps and the router's token relay (0 turns this off).
    prefill_nice: int = 10
    children: list[Child] = field(default_factory=list)
    stage_values: dict[str, Any] = field(default_factory=dict)
    _picked: set[int] = field(default_factory=set, init=False, repr=False)  # the ports this plan chose so far

    def _port(self) -> int:
        """A free port no other child of this plan got: the OS may hand out a port again until it is bound."""
        while (port := free_port(self.host)) in self._picked:
            pass
        self._picked.add(port)
        return port

    def _stage(self, stage: str, port: int, values: dict[str, Any], extra: Sequence[str] = (),
               model: Path | None = None) -> Child:
        name = stage if stage in ("tokenizer", "router") else f"{stage}-{sum(c.name.startswith(stage) for c in self.children)}"
        metrics_port = self._port()
        own = {"host": self.host, "port": port, "model": str(model or self.model), "metrics_port": metrics_port}
        argv, env = argv_for(stage_configs()[stage], {**self.stage_values, **values, **own})
        argv = [sys.executable, "-m", "qwenserve.cli", "serve", stage, *argv, *extra]
        return Child(name, f"{self.host}:{port}", argv, metrics_port, env=env)

    def plan(self) -> list[Child]:
        """Decide ports and command lines (no processes yet)."""
        self.children = []
        self._picked = {p for p in (self.router_port, self.http_port) if p}
        self.children.append(self._stage("tokenizer", self._port(), {}))
        workers = route_args(self.extra_worker_args, ("prefill", "decode"))
        for _ in range(self.prefill):
            self.children.append(self._stage("prefill", self._port(), {"kv_transfer": self.kv_transfer},
                                             workers["prefill"]))
        # Decode on other weights of the model continues KV those did not compute: it says so (KVLayout).
        other_weights = {"kv_from_other_weights": True} if self.decode_model else {}
        for _ in range(self.decode):
            self.children.append(self._stage("decode", self._port(), other_weights, workers["decode"],
                                             self.decode_model))
        self.router_port = self.router_port or self._port()
        self.http_port = self.http_port or self._port()
        keys_given = bool({"--api-keys-file", "--api-keys", "--api-key"} & {a.split("=")[0] for a in self.extra_router_args}) or any(
            k in {**os.environ, **self.env, **self.stage_env()}
            for k in ("QWENSERVE_API_KEYS_FILE", "QWENSERVE_API_KEYS", "QWENSERVE_API_KEY")
        ) or bool(self.stage_values.get("api_keys_file") or self.stage_values.get("no_auth"))

        def workers_of(prefix: str, what: Callable[[Child], str]) -> list[str]:
            return [what(c) for c in self.children if c.name.startswith(prefix)]

        router = {
            "http_port": self.http_port,
            "tokenizer": self.children[0].address,
            "prefill": workers_of("prefill", lambda c: c.address),
            "decode": workers_of("decode", lambda c: c.address),
            "tokenizer_metrics": f"{self.host}:{self.children[0].metrics_port}",
            "prefill_metrics": workers_of("prefill", lambda c: f"{self.host}:{c.metrics_port}"),
            "decode_metrics": workers_of("decode", lambda c: f"{self.host}:{c.metrics_port}"),
        }
        if not keys_given and "--no-auth" not in self.extra_router_args:
            router["no_auth"] = True  # locally, no keys means no auth (a pod without keys refuses to start)
        self.children.append(self._stage("router", self.router_port, router, self.extra_router_args))
        return self.children

    def stage_env(self) -> dict[str, str]:
        """The variables that carry secret stage options (the router's --api-key)."""
        return argv_for(stage_configs()["router"], self.stage_values)[1]

    def start(self, timeout_s: float = 180.0) -> None:
        """Start every child and wait until all are healthy; raises RuntimeError otherwise.

        Ports picked here are free when picked, not always when bound: another process may take one in between. A
        child that cannot bind its port makes a new plan with other ports, twice at most; the router's ports given
        (`--port`, `--grpc-port`) stay, so a router that cannot bind one of them is an error at once.
        """
        given = (self.router_port, self.http_port)
        planned = bool(self.children)
        for attempt in range(PORT_ATTEMPTS):
            if not planned:
                self.router_port, self.http_port = given
                self.plan()
            try:
                self._launch(timeout_s)
                return
            except RuntimeError as e:
                # Any child's last line counts: the others may have died of the one that could not bind.
                culprit = next((c for c in self.children if _port_taken(c.died() or "")), None)
                taken = culprit.died() if culprit else None
                router_given = culprit is not None and culprit.name == "router" and given != (0, 0)
                if planned or attempt == PORT_ATTEMPTS - 1 or taken is None or router_given:
                    raise
                console("qwen-serve: %s; starting again on other ports (%s)", taken, e, stderr=True)

    def child_environment(self, child: Child) -> dict[str, str]:
        """The environment `child` runs with: this process's, the cluster's `env`, the child's own variables (the
        secrets given to it), and its progress and supervision settings (a prefill child's CPU priority)."""
        env = {**os.environ, **self.env}
        nice = self.prefill_nice if child.name.startswith("prefill") else 0
        engine = child.name.startswith(("prefill", "decode"))
        return {**env, **child.env, **progress.child_env(child.name, env),
                **supervision.child_env(nice, child.restarts), **(shared_cores_openmp(env) if engine else {})}

    def _launch(self, timeout_s: float) -> None:
        for child in self.children:
            self._spawn(child)
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, child: Child) -> None:
        """Start `child`'s process, its output relayed to its log file (or this process's stderr)."""
        out: IO[bytes] | None = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 - lives as long as the child
        child.last_line = ""
        child.last_lines.clear()
        # Children's own output never mixes with the launcher's stdout (which carries the ready line).
        # Progress as named lines, never bars (progress.child_env): the children share the launcher's terminal
        # or write files.
        child.process = subprocess.Popen(
            child.argv, env=self.child_environment(child),
            stdout=subprocess.PIPE if out is not None else sys.stderr, stderr=subprocess.STDOUT,
        )
        if out is not None and child.process.stdout is not None:
            child.relay = threading.Thread(target=_relay, args=(child, child.process.stdout, out),
                                           name=f"relay-{child.name}", daemon=True)
            child.relay.start()

    def restart(self, child: Child) -> None:
        """Start the exited `child` again with the same command line, so on the same ports (the router's channels
        to it reconnect). Call it from the thread that started the cluster: a child gets SIGTERM when the thread
        that started it ends (PR_SET_PDEATHSIG)."""
        if child.process is not None and child.process.poll() is None:
            raise RuntimeError(f"{child.name} is still running")
        # A child killed with SIGKILL could not unlink its shared memory (its successor reaps too, later).
        from qwenserve.kv_transfer.shm import reap_orphaned_segments

        reap_orphaned_segments()
        child.restarts += 1
        self._spawn(child)

    def dead_child(self) -> str | None:
        """How the first child that has stopped ended (with its last line), or None while all run."""
        return next((how for how in (c.died() for c in self.children) if how is not None), None)

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every child's gRPC health says SERVING; RuntimeError as soon as any child dies (naming it and
        its last line) or once `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        names = ", ".join(child.name for child in self.children)
        # A bar only where the children's own lines do not share the terminal with it.
        with progress.step(f"starting {names}", total=len(self.children), unit="serving",
                           allow_bar=self.log_dir is not None) as step:
            for child in self.children:
                with grpc.insecure_channel(child.address) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    while not _serving(stub):
                        if (how := self.dead_child()) is not None:
                            raise RuntimeError(how)
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{child.name} at {child.address} did not become healthy within "
                                               f"{timeout_s:g} s")
                        time.sleep(0.2)
                step.advance()
        # The router's HTTP front opens during its warm-up, before health says SERVING.
        if self.http_port and not _port_open(self.host, self.http_port):
            raise RuntimeError(f"the router's HTTP port {self.http_port} is not open")

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def addresses(self) -> list[str]:
        """One line per service: its name, gRPC address and metrics URL."""
        width = max(len(c.name) for c in self.children)
        return [
            f"  {c.name:<{width}}  grpc={c.address}  metrics=http://{self.host}:{c.metrics_port}/metrics"
            for c in self.children
        ]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child (router first, so it drains), then SIGKILL what is left after grace_s."""
        for child in reversed(self.children):
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            if child.relay is not None:
                child.relay.join(2.0)
        # A child killed with SIGKILL cannot clean up its shared memory; its supervisor does.
        from qwenserve.kv_transfer.shm import reap_orphaned_segments

        reap_orphaned_segments(min_age_s=0)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serving(stub: health_pb2_grpc.HealthStub, timeout_s: float = 1.0) -> bool:
    """One health check: True when the server says SERVING."""
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def serving(address: str, timeout_s: float = 0.5) -> bool:
    """One health check of the server at `address`: True when it says SERVING."""
    with grpc.insecure_channel(address) as channel:
        return _serving(health_pb2_grpc.HealthStub(channel), timeout_s)


def wait_serving(
    address: str, deadline: float, process: subprocess.Popen | None = None, what: str | None = None
) -> None:
    """Poll gRPC health at `address` until SERVING; RuntimeError once `deadline` (monotonic) passes or
    `process` exits first."""
    what = what or address
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not _serving(stub):
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{what} exited with code {process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not become healthy before the deadline")
            time.sleep(0.2)
