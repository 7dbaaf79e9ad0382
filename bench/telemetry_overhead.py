"""What tracing costs: per span, and per gRPC call on loopback, with tracing off and on.

    .venv/bin/python bench/telemetry_overhead.py [--calls 300] [--rounds 9] [--spans 200000]

Off must be indistinguishable from no instrumentation at all (the issue asks for "no measurable
cost"); on shows what an operator pays when they export traces (here to memory, no network).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

from grpc import aio

from qwenserve.telemetry import tracing
from qwenserve.telemetry.logs import bind_request_id
from qwenserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc


class Info(tokenizer_pb2_grpc.TokenizerServicer):
    async def GetInfo(self, request, context):
        return tokenizer_pb2.TokenizerInfo(vocab_size=1)


def bench_spans(n: int) -> dict[str, float]:
    """Nanoseconds per `with tracer.start_as_current_span(...)`, against an empty `with`."""
    tracer = tracing.get_tracer("bench")
    out: dict[str, float] = {}
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with contextlib.nullcontext():
            pass
    out["baseline (nullcontext)"] = (time.perf_counter_ns() - t0) / n
    for mode in ("none", "memory"):
        tracing.setup_tracing("bench", exporter=mode)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with tracer.start_as_current_span("s"):
                pass
        out[f"span, tracing {'off' if mode == 'none' else 'on'}"] = (time.perf_counter_ns() - t0) / n
        if mode == "memory":
            tracing.memory_exporter().clear()
    tracing.shutdown_tracing()
    return out


async def _calls(stub: tokenizer_pb2_grpc.TokenizerStub, n: int) -> float:
    """Microseconds per unary call over `n` sequential calls, each inside a request."""
    t0 = time.perf_counter()
    for _ in range(n):
        with bind_request_id("bench"):
            await stub.GetInfo(tokenizer_pb2.GetInfoRequest())
    return (time.perf_counter() - t0) / n * 1e6


async def bench_grpc(n: int, rounds: int) -> dict[str, tuple[float, float]]:
    """(median, min) microseconds per GetInfo round trip, by instrumentation.

    The cases take turns round by round, so a noisy neighbour on a shared machine hits all of
    them alike instead of whichever happened to run during the noise.
    """
    servers, stubs = [], {}
    for instrumented in (False, True):
        server = aio.server(interceptors=tracing.server_interceptors() if instrumented else None)
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Info(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        channel = aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=tracing.client_interceptors() if instrumented else None
        )
        stubs[instrumented] = tokenizer_pb2_grpc.TokenizerStub(channel)
        await _calls(stubs[instrumented], 50)  # connect and warm up
    cases = {
        "no interceptors": ("none", False),
        "interceptors, tracing off": ("none", True),
        "interceptors, tracing on (memory)": ("memory", True),
    }
    samples: dict[str, list[float]] = {label: [] for label in cases}
    for _ in range(rounds):
        for label, (mode, instrumented) in cases.items():
            tracing.setup_tracing("bench", exporter=mode)
            samples[label].append(await _calls(stubs[instrumented], n))
    tracing.shutdown_tracing()
    for server in servers:
        await server.stop(None)
    return {label: (statistics.median(v), min(v)) for label, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per case per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--spans", type=int, default=200_000)
    args = parser.parse_args()
    for label, ns in bench_spans(args.spans).items():
        print(f"{label:<40} {ns:10.0f} ns")
    for label, (median, best) in asyncio.run(bench_grpc(args.calls, args.rounds)).items():
        print(f"{label:<40} {median:10.1f} us/call median, {best:.1f} best of {args.rounds} rounds")


if __name__ == "__main__":
    main()
