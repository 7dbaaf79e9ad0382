"""The Prefill stage: prompt in, first token and a KV handoff out (plus the KVTransfer service).

`qwen-serve serve prefill --model PATH [--port N] [--kv-transfer shm|network]`
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass

import grpc

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.flags import add_flag
from qwenserve.grpc_server import GrpcServerConfig, run_stage, serve
from qwenserve.kv_transfer.exporter import ExporterConfig, KVExporter, MiB
from qwenserve.kv_transfer.grpc_transport import add_kv_transfer_service
from qwenserve.rpc_errors import abort
from qwenserve.telemetry.metrics import handoff_metrics
from qwenserve.v1 import common_pb2, kv_transfer_pb2, prefill_pb2, prefill_pb2_grpc
from qwenserve.worker.errors import grpc_status
from qwenserve.worker.prefill_worker import PrefillWorker
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

SERVICES = [
    prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
    kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name,
]


@dataclass(frozen=True)
class PrefillServiceConfig:
    host: str
    port: int
    model: str
    kv_transfer: str
    lease_s: float
    kv_pool_mib: int
    kv_max_mib: int
    grace_s: float
    metrics_port: int
    engine: EngineConfig
    log_json: bool | None = None
    log_level: str | None = None
    served_model_name: str = ""  # the model_name label of vLLM's metrics


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        try:
            return await self.worker.prefill(request)
        except Exception as e:
            await abort(context, *grpc_status(e))

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: common_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        return engine_info(self.worker.engine)


def parse_config(argv: list[str]) -> PrefillServiceConfig:
    parser = argparse.ArgumentParser(prog="qwen-serve serve prefill", description=__doc__.splitlines()[0])
    add_flag(parser, "--host", default="127.0.0.1")
    add_flag(parser, "--port", type=int, default=50052)
    add_flag(parser, "--model", default=None, help="checkpoint folder (default: the built-in model)")
    add_flag(parser, "--kv-transfer", default="shm", choices=["shm", "network"], help="handoff transport")
    add_flag(parser, "--lease-s", type=float, default=30.0, help="how long an unacknowledged handoff is kept")
    add_flag(parser, "--kv-pool-mib", type=int, default=256,
             help="handoff memory kept ready (pre-faulted); a larger handoff gets a region of its own")
    add_flag(parser, "--kv-max-mib", type=int, default=4096, help="most memory unreleased handoffs may hold")
    add_flag(parser, "--grace-s", type=float, default=10.0, help="drain time on SIGTERM")
    add_engine_flags(parser)
    add_metrics_flag(parser)
    args, _unknown = parser.parse_known_args(argv)
    model = resolve_model(args.model)
    return PrefillServiceConfig(
        host=args.host, port=args.port, model=model, kv_transfer=args.kv_transfer,
        lease_s=args.lease_s, kv_pool_mib=args.kv_pool_mib, kv_max_mib=args.kv_max_mib, grace_s=args.grace_s, metrics_port=args.metrics_port, engine=engine_config(args),
        log_json=args.log_json, log_level=args.log_level, served_model_name=served_model_name(args, model),
    )


async def run(config: PrefillServiceConfig) -> None:
    engine = LLMEngine.from_pretrained(config.model, config.engine)
    transport = common_pb2.KV_TRANSPORT_SHM if config.kv_transfer == "shm" else common_pb2.KV_TRANSPORT_GRPC
    server_config = GrpcServerConfig(
        host=config.host, port=config.port, grace_s=config.grace_s, metrics_port=config.metrics_port
    )
    # The control endpoint must be the address decode workers reach us on.
    exporter = KVExporter(ExporterConfig(
        transport=transport, use_shm=config.kv_transfer == "shm",
        control_endpoint=f"{config.host}:{config.port}",
        pool_bytes=config.kv_pool_mib * MiB, max_bytes=config.kv_max_mib * MiB,
    )).start()
    steps = observe_engine_steps(engine)
    worker = PrefillWorker(engine, exporter, lease_s=config.lease_s, steps=steps, handoff=handoff_metrics())

    def register(server: grpc.aio.Server) -> None:
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server)
        add_kv_transfer_service(server, exporter)

    publisher = asyncio.create_task(
        publish_engine_metrics(engine, exporter, steps=steps, model_name=config.served_model_name)
    )
    try:
        await serve(server_config, "prefill", SERVICES, register, warm_up=lambda: warm_up_engine(engine),
                    failure=engine_failure(engine))
    finally:
        publisher.cancel()
        exporter.close()
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qwen-serve serve prefill`."""
    return run_stage("prefill", parse_config(sys.argv[1:] if argv is None else argv), run,
                     startup_errors=ENGINE_STARTUP_ERRORS)
