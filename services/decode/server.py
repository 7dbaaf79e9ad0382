"""The Decode stage: import a handoff (or prefill locally) and stream tokens.

`qwen-serve serve decode --model PATH [--port N]`
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import RequestError
from qwenserve.flags import add_flag, print_config
from qwenserve.grpc_server import GrpcServerConfig, serve
from qwenserve.kv_transfer.importer import KVImporter
from qwenserve.v1 import decode_pb2, decode_pb2_grpc
from qwenserve.worker.decode_worker import DecodeWorker
from qwenserve.worker.errors import WorkerError
from qwenserve_services.stage_common import (
    add_engine_flags,
    add_metrics_flag,
    engine_config,
    publish_engine_metrics,
    resolve_model,
    start_metrics,
    warm_up_engine,
)

SERVICES = [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name]


@dataclass(frozen=True)
class DecodeServiceConfig:
    host: str
    port: int
    model: str
    grace_s: float
    metrics_port: int
    engine: EngineConfig


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        try:
            async for msg in self.worker.decode(request):
                yield msg
        except WorkerError as e:
            await context.abort(e.grpc_code, str(e))
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def parse_config(argv: list[str]) -> DecodeServiceConfig:
    parser = argparse.ArgumentParser(prog="qwen-serve serve decode", description=__doc__.splitlines()[0])
    add_flag(parser, "--host", default="127.0.0.1")
    add_flag(parser, "--port", type=int, default=50053)
    add_flag(parser, "--model", default=None, help="checkpoint folder (default: the built-in model)")
    add_flag(parser, "--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    add_engine_flags(parser)
    add_metrics_flag(parser)
    args, _unknown = parser.parse_known_args(argv)
    return DecodeServiceConfig(
        host=args.host, port=args.port, model=resolve_model(args.model), grace_s=args.grace_s,
        metrics_port=args.metrics_port, engine=engine_config(args),
    )


async def run(config: DecodeServiceConfig) -> None:
    engine = LLMEngine.from_pretrained(config.model, config.engine)
    importer = KVImporter()
    worker = DecodeWorker(engine, importer)

    def register(server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)

    start_metrics(config.host, config.metrics_port)
    publisher = asyncio.create_task(publish_engine_metrics(engine, None))
    try:
        await serve(GrpcServerConfig(host=config.host, port=config.port, grace_s=config.grace_s), "decode",
                    SERVICES, register, warm_up=lambda: warm_up_engine(engine))
    finally:
        publisher.cancel()
        await importer.close()
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qwen-serve serve decode`."""
    config = parse_config(sys.argv[1:] if argv is None else argv)
    print_config("decode", config)
    asyncio.run(run(config))
    return 0
