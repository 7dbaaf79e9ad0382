"""The Decode stage: import a handoff (or prefill locally) and stream tokens.

`qwen-serve serve decode [MODEL] [--port N]`; the options are DecodeServiceConfig's (`config.py`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from qwenserve.engine.engine import LLMEngine
from qwenserve.grpc_server import GrpcServerConfig, serve
from qwenserve.kv_transfer.importer import ImporterConfig
from qwenserve.rpc_errors import abort
from qwenserve.stage_auth import guarding_secret
from qwenserve.stages.common import argv_or_sys, checked, run_checked
from qwenserve.stages.decode import DecodeServiceConfig, check, parse_config
from qwenserve.telemetry.metrics import handoff_metrics
from qwenserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from qwenserve.worker.decode_worker import DecodeWorker
from qwenserve.worker.errors import grpc_status
from qwenserve.worker.handoff_telemetry import TracedKVImporter
from qwenserve_services.stage_common import (
    ENGINE_STARTUP_ERRORS,
    engine_failure,
    engine_info,
    observe_engine_steps,
    publish_engine_metrics,
    warm_up_engine,
)

SERVICES = [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name]


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        # Headers at once, before the import and the engine: the router's sign that this worker took the call
        # (a stopped one sends none, and a model with a fallback hands its request over within seconds).
        await context.send_initial_metadata(())
        try:
            async for msg in self.worker.decode(request):
                yield msg
        except Exception as e:
            await abort(context, *grpc_status(e))

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: common_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        info = engine_info(self.worker.engine)
        info.sends_headers_on_accept = True
        return info


#: What decode fetches over, by --kv-transfer (None: whatever prefill's default and network modes hand out).
IMPORT_TRANSPORTS: dict[str | None, frozenset[int]] = {
    None: frozenset({common_pb2.KV_TRANSPORT_SHM, common_pb2.KV_TRANSPORT_GRPC}),
    "shm": frozenset({common_pb2.KV_TRANSPORT_SHM}),
    "network": frozenset({common_pb2.KV_TRANSPORT_GRPC}),
    "mooncake": frozenset({common_pb2.KV_TRANSPORT_MOONCAKE}),
}


async def run(config: DecodeServiceConfig) -> None:
    assert config.model is not None, "check() resolves the model"
    secret = guarding_secret(config.stage_secret_file, "decode")
    engine = LLMEngine.from_pretrained(config.model, config.engine)
    # The transports prefill workers hand off over; a Mooncake handle is refused unless the deployment chose
    # Mooncake, not a reason to start a Transfer Engine.
    importer = TracedKVImporter(ImporterConfig(
        transports=IMPORT_TRANSPORTS[config.kv_transfer], mooncake_host=config.advertise_host or "127.0.0.1",
    ), stage_secret=secret)  # prefill's KVTransfer asks decode for the deployment's credential too
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
        host=config.host, port=config.port, grace_s=config.grace_s, metrics_port=config.metrics_port,
        stage_secret=secret,
    )
    try:
        await serve(server_config, "decode", SERVICES, register, warm_up=lambda: warm_up_engine(engine),
                    failure=engine_failure(engine))
    finally:
        publisher.cancel()
        await importer.close()
        engine.shutdown()


def start(config: DecodeServiceConfig) -> int:
    """`qwen-serve serve decode` from its parsed and checked config (the CLI did both, before importing this
    module) to the stage's exit code."""
    return run_checked("decode", config, run, startup_errors=ENGINE_STARTUP_ERRORS)


def main(argv: list[str] | None = None) -> int:
    """`python -m qwenserve_services.decode.server [flags]`: parse, check, start."""
    config = checked("decode", parse_config(argv_or_sys(argv)), check)
    return 1 if config is None else start(config)


if __name__ == "__main__":
    sys.exit(main())
