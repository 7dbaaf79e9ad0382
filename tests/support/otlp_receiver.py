"""A minimal OTLP/gRPC trace collector, run as its own process: `python -m tests.support.otlp_receiver FILE`.

Prints its port on the first stdout line, then appends every span it is sent to FILE as one JSON
object per line. It runs out of the test process on purpose: a gRPC server's threads in the process
that forks the services (the launcher's preexec_fn) can abort the forked child.
"""

from __future__ import annotations

import json
import sys
import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Writes each received span as a JSON line."""

    def __init__(self, path: str) -> None:
        self.out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any) -> Any:  # noqa: N802
        lines = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(json.dumps({
                        "service": str(resource.get("service.name", "")), "name": span.name,
                        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_id": span.parent_span_id.hex(),
                        "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
                    }))
        with self.lock:
            self.out.write("".join(line + "\n" for line in lines))
            self.out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(sys.argv[1]), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
