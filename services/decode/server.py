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
from qwenserve.flags import add_flag
from qwenserve.grpc_server import GrpcServerConfig, run_stage, serve
from qwenserve.kv_transfer.importer import ImporterConfig
from qwenserve.rpc_errors import abort
from qwenserve.telemetry.metrics import handoff_metrics
from qwenserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from qwenserve.worker.decode_worker import DecodeWorker
from qwenserve.worker.errors import grpc_status
from qwenserve.worker.handoff_telemetry import TracedKVImporter
from qwenserve_services.stage_common import (
    ENGINE_STARTUP_ERRORS,
    add_engine_flags,
    add_metrics_flag,
    engine_config,
    engine_failure,
    engine_info,
    observe_engine_steps,
    publish_engine_metrics,
    resolve_model,
    served_model_name,
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
    stream_interval_ms: float = 0.0
    log_json: bool | None = None
    log_level: str | None = None
    served_model_name: str = ""  # the model_name label of vLLM's metrics


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        try:
            async for msg in self.worker.decode(request):
                yield msg
        except Exception as e:
            await abort(context, *grpc_status(e))

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: common_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        return engine_info(self.worker.engine)


def parse_config(argv: list[str]) -> DecodeServiceConfig:
    parser = argparse.ArgumentParser(prog="qwen-serve serve decode", description=__doc__.splitlines()[0])
    add_flag(parser, "--host", default="127.0.0.1")
    add_flag(parser, "--port", type=int, default=50053)
    add_flag(parser, "--model", default=None, help="checkpoint folder (default: the built-in model)")
    add_flag(parser, "--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    add_flag(parser, "--stream-interval-ms", type=float, default=0.0,
             help="send tokens at most this often after the first (fewer, fuller messages; 0: at once)")
    add_engine_flags(parser)
    add_metrics_flag(parser)
    args, _unknown = parser.parse_known_args(argv)
    model = resolve_model(args.model)
    return DecodeServiceConfig(
        host=args.host, port=args.port, model=model, grace_s=args.grace_s,
        metrics_port=args.metrics_port, engine=engine_config(args), stream_interval_ms=args.stream_interval_ms,
        log_json=args.log_json, log_level=args.log_level, served_model_name=served_model_name(args, model),
    )


async def run(config: DecodeServiceConfig) -> None:
    engine = LLMEngine.from_pretrained(config.model, config.engine)
    # The transports prefill workers hand off over; a Mooncake handle is refused, not a reason to open Mooncake.
    importer = TracedKVImporter(ImporterConfig(
        transports=frozenset({common_pb2.KV_TRANSPORT_SHM, common_pb2.KV_TRANSPORT_GRPC})
    ))
    steps = observe_engine_steps(engine)
    worker = DecodeWorker(
        engine, importer, steps=steps, handoff=handoff_metrics(),
        stream_interval_s=config.stream_interval_ms / 1000,
    )

    def register(server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)

    publisher = asyncio.create_task(
        publish_engine_metrics(engine, None, steps=steps, model_name=config.served_model_name)
    )
    server_config = GrpcServerConfig(
        host=config.host, port=config.port, grace_s=config.grace_s, metrics_port=config.metrics_port
    )
    try:
        await serve(server_config, "decode", SERVICES, register, warm_up=lambda: warm_up_engine(engine),
                    failure=engine_failure(engine))
    finally:
        publisher.cancel()
        await importer.close()
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qwen-serve serve decode`."""
    return run_stage("decode", parse_config(sys.argv[1:] if argv is None else argv), run,
                     startup_errors=ENGINE_STARTUP_ERRORS)
