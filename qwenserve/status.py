"""`qwen-serve status`: health and load of a running deployment, asked of its router.

    qwen-serve status [--router HOST:PORT] [--api-key KEY] [--json]

A router with API keys configured answers only callers with a key (`--api-key`, or
`QWENSERVE_API_KEY`), and shows the workers' addresses only to keys of an `admin: true` tenant (key
file); others see each row's stage, state and load with the address "-". With auth off (`qwen-serve up`
without keys) the caller is the machine's operator and sees everything.

The router answers `Router.GetStatus` by checking each stage worker's gRPC health and reading its
Prometheus endpoint (when the router was given the stages' metrics addresses, as `qwen-serve up`
and the operator do). This module holds both halves: `probe_stage` (what the router runs for each
worker) and the command that prints the table. A stage given to the router as a name (a headless
Service) has a row per pod; a pod gone from DNS whose streams are still finishing is DRAINING:

    STAGE      ADDRESS          STATE        RUN/WAIT  KV USE  TOK/S  RESTARTS  PRECISION
    router     127.0.0.1:50050  SERVING      1/0       -      41.7   0         -
    prefill    10.0.0.7:50052   SERVING      0/0       3.1%   182.0  0         weights=bfloat16 kv=bfloat16 activations=float32
    decode     10.0.0.8:50053   SERVING      2/0       9.4%   35.0   1         weights=bfloat16 kv=bfloat16 activations=float32
    decode     10.0.0.9:50053   DRAINING     1/0       4.0%   12.5   0         float32

RESTARTS is how many times `qwen-serve up` restarted the process after it exited (its /metrics gauge
qwenserve_stage_restarts; 0 in a cluster, where the pod's restart count says it). PRECISION is the dtypes an
engine computes in (its qwenserve_engine_precision_info metric; `--dtype auto` chooses them at start).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from qwenserve.flags import StrictParser
from qwenserve.v1 import router_pb2, router_pb2_grpc

# States of a process that is well: serving, or finishing its streams after the router stopped sending it any.
HEALTHY_STATES = frozenset({"SERVING", "DRAINING"})
# The engine gauges a status row reads; their names are the same contract the autoscaler relies on.
RUNNING = "qwenserve_engine_running_requests"
WAITING = "qwenserve_engine_waiting_requests"
KV_USAGE = "qwenserve_kv_blocks_usage_ratio"
THROUGHPUT = "qwenserve_engine_throughput_tokens_per_second"
# How many times `qwen-serve up` restarted the process (qwenserve/supervision.py), on every stage's page.
RESTARTS = "qwenserve_stage_restarts"
# An engine stage's dtypes by part (engine/precision.py), an info metric.
PRECISION = "qwenserve_engine_precision_info"
PRECISION_PARTS = ("weights", "kv", "activations")


def parse_gauges(text: str, names: Iterable[str]) -> dict[str, float]:
    """The unlabelled samples named `names` from a Prometheus text page (absent names are left out)."""
    wanted = set(names)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and not sample.labels:
                found[sample.name] = sample.value
    return found


def parse_precision(text: str) -> str:
    """An engine stage's precision from its metrics page: one dtype's name where every part has it
    ("float32"), else each part's ("weights=bfloat16 kv=bfloat16 activations=float32"); "" where not published."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PRECISION and all(part in sample.labels for part in PRECISION_PARTS):
                dtypes = [sample.labels[part] for part in PRECISION_PARTS]
                if len(set(dtypes)) == 1:
                    return dtypes[0]
                return " ".join(f"{part}={dtype}" for part, dtype in zip(PRECISION_PARTS, dtypes, strict=True))
    return ""


def scrape(metrics_address: str, timeout_s: float = 2.0) -> str:
    """The /metrics page of `host:port` (raises OSError when it does not answer)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as reply:
        return reply.read().decode()


async def health_state(channel: grpc.aio.Channel, timeout_s: float = 2.0) -> str:
    """The gRPC health of the server behind `channel`: SERVING, NOT_SERVING, UNREACHABLE or UNKNOWN."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        return "UNREACHABLE" if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "UNKNOWN"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def probe_stage(
    stage: str, address: str, channel: grpc.aio.Channel, metrics_address: str = ""
) -> router_pb2.StageStatus:
    """One worker's row: its health over `channel`, and its load from its metrics endpoint if known."""
    row = router_pb2.StageStatus(stage=stage, address=address, metrics_address=metrics_address)
    row.state = await health_state(channel)
    if not metrics_address:
        return row
    try:
        text = await asyncio.to_thread(scrape, metrics_address)
    except (OSError, urllib.error.URLError):
        return row
    gauges = parse_gauges(text, (RUNNING, WAITING, KV_USAGE, THROUGHPUT, RESTARTS))
    row.restarts = int(gauges.get(RESTARTS, 0))
    row.precision = parse_precision(text)
    if stage in ("prefill", "decode") and RUNNING in gauges:
        row.load_known = True
        row.running = int(gauges[RUNNING])
        row.waiting = int(gauges.get(WAITING, 0))
        row.kv_usage = gauges.get(KV_USAGE, 0.0)
        row.tokens_per_second = gauges.get(THROUGHPUT, 0.0)
    return row


def without_addresses(stages: Iterable[router_pb2.StageStatus]) -> list[router_pb2.StageStatus]:
    """The rows with their gRPC and metrics addresses blanked (state, load and counts kept), for a caller who
    may not see where the workers are."""
    rows = []
    for stage in stages:
        row = router_pb2.StageStatus()
        row.CopyFrom(stage)
        row.address = row.metrics_address = ""
        rows.append(row)
    return rows


def format_table(stages: Iterable[router_pb2.StageStatus]) -> str:
    """The compact table `qwen-serve status` prints; "-" where a value is not known."""
    header = ("STAGE", "ADDRESS", "STATE", "RUN/WAIT", "KV USE", "TOK/S", "RESTARTS", "PRECISION")
    rows = [header]
    for s in stages:
        load = s.load_known
        rows.append((
            s.stage,
            s.address or "-",
            s.state,
            f"{s.running}/{s.waiting}" if load else "-",
            f"{100 * s.kv_usage:.1f}%" if load and s.stage != "router" else "-",
            f"{s.tokens_per_second:.1f}" if load else "-",
            str(s.restarts),
            s.precision or "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


async def fetch_status(router: str, timeout_s: float, api_key: str | None = None) -> router_pb2.GetStatusResponse:
    """Ask the router at `router` (host:port) for the deployment's status."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await stub.GetStatus(router_pb2.GetStatusRequest(), timeout=timeout_s, metadata=metadata)


def main(argv: list[str]) -> int:
    """Entry point of `qwen-serve status`: 0 when every process is SERVING (or DRAINING), 1 otherwise, 2 if the
    router is unreachable."""
    parser = StrictParser(prog="qwen-serve status", description=__doc__.splitlines()[0])
    parser.add_argument("--router", default=os.environ.get("QWENSERVE_ROUTER", "127.0.0.1:50050"),
                        help="the router's gRPC address [env QWENSERVE_ROUTER]")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--api-key", default=os.environ.get("QWENSERVE_API_KEY"),
                        help="API key, when the router requires one [env QWENSERVE_API_KEY]")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        status = asyncio.run(fetch_status(args.router, args.timeout_s, args.api_key))
    except grpc.aio.AioRpcError as e:
        print(f"qwen-serve status: the router at {args.router} did not answer: {e.code().name} {e.details()}",
              file=sys.stderr)
        return 2
    if args.json:
        from google.protobuf.json_format import MessageToDict

        rows = [MessageToDict(s, always_print_fields_with_no_presence=True) for s in status.stages]
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(status.stages))
    return 0 if all(s.state in HEALTHY_STATES for s in status.stages) else 1
