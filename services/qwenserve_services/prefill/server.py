"""The Prefill stage: prompt in, first token and a KV handoff out (plus the KVTransfer service).

`qwen-serve serve prefill [MODEL] [--port N] [--kv-transfer shm|network]`; the options are
PrefillServiceConfig's (`config.py`).
"""

from __future__ import annotations

import asyncio
import logging
import sys

import grpc

from qwenserve.addresses import endpoint_of
from qwenserve.engine.engine import LLMEngine
from qwenserve.grpc_server import GrpcServerConfig, serve
from qwenserve.kv_transfer.exporter import ExporterConfig, KVExporter, MiB
from qwenserve.kv_transfer.grpc_transport import add_kv_transfer_service
from qwenserve.rpc_errors import abort
from qwenserve.stage_auth import guarding_secret
from qwenserve.stages.common import argv_or_sys, checked, run_checked
from qwenserve.stages.prefill import PrefillServiceConfig, check, parse_config
from qwenserve.telemetry.metrics import handoff_metrics
from qwenserve.v1 import common_pb2, kv_transfer_pb2, prefill_pb2, prefill_pb2_grpc
from qwenserve.worker.errors import grpc_status
from qwenserve.worker.prefill_worker import PrefillWorker
from qwenserve_services.stage_common import (
    ENGINE_STARTUP_ERRORS,
    engine_failure,
    engine_info,
    observe_engine_steps,
    publish_engine_metrics,
    warm_up_engine,
)

log = logging.getLogger(__name__)

SERVICES = [
    prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
    kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name,
]


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        try:
            response = await self.worker.prefill(request)
        except Exception as e:
            await abort(context, *grpc_status(e))
        handoff_id = response.kv_handle.handoff_id
        if handoff_id:
            # A caller whose deadline passed while the handoff was being published (a stopped or overloaded
            # worker) never reads the handle: free it now, not at the lease's expiry. gRPC tells a handler
            # that returns normally nothing of a caller's cancel, so that case is left to the lease.
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                self.worker.exporter.release(handoff_id, "cancelled")
                log.info("handoff %s freed: the caller's deadline passed before it could read it", handoff_id)
                await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, common_pb2.ErrorDetail(
                    code="deadline_exceeded", message="the deadline passed during the prefill"))
        return response

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: common_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        return engine_info(self.worker.engine)


TRANSPORTS = {"shm": common_pb2.KV_TRANSPORT_SHM, "network": common_pb2.KV_TRANSPORT_GRPC,
              "mooncake": common_pb2.KV_TRANSPORT_MOONCAKE}


async def run(config: PrefillServiceConfig) -> None:
    assert config.model is not None, "check() resolves the model"
    engine = LLMEngine.from_pretrained(config.model, config.engine)
    transport = TRANSPORTS[config.kv_transfer]
    server_config = GrpcServerConfig(
        host=config.host, port=config.port, grace_s=config.grace_s, metrics_port=config.metrics_port,
        stage_secret=guarding_secret(config.stage_secret_file, "prefill"),
    )
    # Every address in a handle is one decode workers dial: the advertised one, never the bind address.
    exporter = KVExporter(ExporterConfig(
        transport=transport, use_shm=config.kv_transfer == "shm",
        control_endpoint=endpoint_of(config.advertise_host, config.port), mooncake_host=config.advertise_host,
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


def start(config: PrefillServiceConfig) -> int:
    """`qwen-serve serve prefill` from its parsed and checked config (the CLI did both, before importing this
    module) to the stage's exit code."""
    return run_checked("prefill", config, run, startup_errors=ENGINE_STARTUP_ERRORS)


def main(argv: list[str] | None = None) -> int:
    """`python -m qwenserve_services.prefill.server [flags]`: parse, check, start."""
    config = checked("prefill", parse_config(argv_or_sys(argv)), check)
    return 1 if config is None else start(config)


if __name__ == "__main__":
    sys.exit(main())
