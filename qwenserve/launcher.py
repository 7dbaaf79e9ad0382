"""`qwen-serve up`: the four stages as separate local processes on loopback, started and stopped together.

Each child runs `qwen-serve serve <stage>` on a free port, with its Prometheus endpoint (/metrics,
/healthz, /readyz) on another; the router is told every stage's metrics address for `qwen-serve
status`. The launcher waits until every child's gRPC health check says SERVING, prints one line
containing `ready` with the router's addresses, then one line per service with its gRPC and metrics
addresses, and on
Ctrl-C / SIGTERM (or when any child dies) stops them all. Children get SIGTERM from the kernel if the
launcher itself is killed (PR_SET_PDEATHSIG), so no orphans are left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qwenserve import progress
from qwenserve.kv_transfer.shm import reap_orphaned_segments

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the child binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex((host, port)) == 0


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(nice: int) -> Callable[[], None]:
    """What runs in a child before exec: die with the launcher, and lower its CPU priority by `nice` (every
    thread it will start inherits it)."""

    def setup() -> None:
        _die_with_parent()
        if nice:
            os.nice(nice)

    return setup


@dataclass
class Child:
    """One stage process."""

    name: str
    address: str
    argv: list[str]
    metrics_port: int = 0
    process: subprocess.Popen | None = None


@dataclass
class LocalCluster:
    """The processes of one `qwen-serve up`; usable from tests as a context manager."""

    model: Path
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

    def _stage(self, stage: str, port: int, extra: list[str]) -> Child:
        argv = [sys.executable, "-m", "qwenserve.cli", "serve", stage, "--host", self.host, "--port", str(port)]
        argv += ["--model", str(self.model), *extra]
        name = stage if stage in ("tokenizer", "router") else f"{stage}-{sum(c.name.startswith(stage) for c in self.children)}"
        metrics_port = free_port(self.host)
        argv += ["--metrics-port", str(metrics_port)]
        return Child(name, f"{self.host}:{port}", argv, metrics_port)

    def plan(self) -> list[Child]:
        """Decide ports and command lines (no processes yet)."""
        self.children = []
        self.children.append(self._stage("tokenizer", free_port(self.host), []))
        worker_args = ["--kv-transfer", self.kv_transfer, *self.extra_worker_args]
        for _ in range(self.prefill):
            self.children.append(self._stage("prefill", free_port(self.host), worker_args))
        for _ in range(self.decode):
            self.children.append(self._stage("decode", free_port(self.host), worker_args))
        self.router_port = self.router_port or free_port(self.host)
        self.http_port = self.http_port or free_port(self.host)
        keys_given = "--api-keys-file" in self.extra_router_args or any(
            k in {**os.environ, **self.env} for k in ("QWENSERVE_API_KEYS_FILE", "QWENSERVE_API_KEYS")
        )
        def metrics_of(prefix: str) -> str:
            return ",".join(f"{self.host}:{c.metrics_port}" for c in self.children if c.name.startswith(prefix))

        router_args = [
            *([] if keys_given or "--no-auth" in self.extra_router_args else ["--no-auth"]),
            "--http-port", str(self.http_port),
            "--tokenizer", self.children[0].address,
            "--prefill", ",".join(c.address for c in self.children if c.name.startswith("prefill")),
            "--decode", ",".join(c.address for c in self.children if c.name.startswith("decode")),
            "--tokenizer-metrics", metrics_of("tokenizer"),
            "--prefill-metrics", metrics_of("prefill"),
            "--decode-metrics", metrics_of("decode"),
            *self.extra_router_args,
        ]
        self.children.append(self._stage("router", self.router_port, router_args))
        return self.children

    def start(self, timeout_s: float = 180.0) -> None:
        """Start every child and wait until all are healthy; raises RuntimeError otherwise."""
        if not self.children:
            self.plan()
        env = {**os.environ, **self.env}
        for child in self.children:
            out = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 - lives as long as the child
            # Children's own output never mixes with the launcher's stdout (which carries the ready line).
            # Progress as named lines, never bars: the children share the launcher's terminal or write files.
            child.process = subprocess.Popen(
                child.argv, env={**env, **progress.child_env(child.name, env)}, stdout=out or sys.stderr,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=_child_setup(self.prefill_nice if child.name.startswith("prefill") else 0),
            )
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        names = ", ".join(child.name for child in self.children)
        # A bar only where the children's own lines do not share the terminal with it.
        with progress.step(f"starting {names}", total=len(self.children), unit="serving",
                           allow_bar=self.log_dir is not None) as step:
            for child in self.children:
                wait_serving(child.address, deadline, child.process, f"{child.name} at {child.address}")
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
        # A child killed with SIGKILL cannot clean up its shared memory; its supervisor does.
        reap_orphaned_segments(min_age_s=0)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    """`qwen-serve up`: run the whole stack until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="qwen-serve up", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=os.environ.get("QWENSERVE_MODEL"),
                        help="Hugging Face checkpoint folder (default: the built-in small Qwen3)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill processes")
    parser.add_argument("--decode", type=int, default=1, help="decode processes")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50050, help="router gRPC port")
    parser.add_argument("--http-port", type=int, default=8000, help="router OpenAI HTTP port")
    parser.add_argument("--kv-transfer", choices=["shm", "network"], default="shm")
    parser.add_argument("--log-dir", type=Path, default=None, help="write each child's log to a file here")
    parser.add_argument("--prefill-nice", type=int, default=10,
                        help="lower prefill processes' CPU priority by this much, so that on shared cores their "
                             "long prompt steps yield to decode steps and the router's relay (0: equal priority)")
    args, router_extra = parser.parse_known_args(argv)
    if args.prefill < 0 or args.decode < 1:
        parser.error("need --decode >= 1 and --prefill >= 0")
    if args.model is None:
        from qwenserve.default_model import ensure_default_model

        args.model = ensure_default_model()
    cluster = LocalCluster(
        model=args.model, prefill=args.prefill, decode=args.decode, host=args.host,
        router_port=args.port, http_port=args.http_port, kv_transfer=args.kv_transfer,
        extra_router_args=router_extra, log_dir=args.log_dir, prefill_nice=args.prefill_nice,
    )
    cluster.plan()
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
    except RuntimeError as e:
        print(f"qwen-serve up: {e}", file=sys.stderr)
        return 1
    print(
        f"qwen-serve ready: router grpc={cluster.host}:{cluster.router_port} "
        f"http=http://{cluster.host}:{cluster.http_port}/v1 model={args.model} "
        f"prefill={args.prefill} decode={args.decode}",
        flush=True,
    )
    for line in cluster.addresses():
        print(line, flush=True)
    code = 0
    while not stop["signal"]:
        dead = [c for c in cluster.children if c.process is not None and c.process.poll() is not None]
        if dead:
            print(f"qwen-serve up: {dead[0].name} exited with code {dead[0].process.returncode}; stopping",
                  file=sys.stderr)
            code = 1
            break
        time.sleep(0.2)
    cluster.stop()
    print("qwen-serve stopped", flush=True)
    return code


def wait_serving(
    address: str, deadline: float, process: subprocess.Popen | None = None, what: str | None = None
) -> None:
    """Poll gRPC health at `address` until SERVING; RuntimeError once `deadline` (monotonic) passes or
    `process` exits first."""
    what = what or address
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{what} exited with code {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not become healthy before the deadline")
            time.sleep(0.2)
