"""The Router stage: gRPC `Generate` (and the OpenAI HTTP front) over the disaggregated workers.

`qwen-serve serve router [MODEL] --tokenizer H:P --prefill H:P[,H:P] --decode H:P[,H:P]`; the options are
RouterServiceConfig's (`qwenserve/stages/router.py`).

`--tokenizer-metrics`, `--prefill-metrics`, `--decode-metrics` (the stages' Prometheus host:port,
in the same order as their gRPC addresses; for a name, each of its pods at that port) let `GetStatus` /
`qwen-serve status` show their load. A name among `--prefill` / `--decode` stands for every pod it resolves
to, re-resolved every `--resolve-interval-s` (qwenserve/router/discovery.py); status lists every pod.

When API keys are configured, every RPC needs one: `ListModels` and `GetStatus` as much as
`Generate`. `GetStatus` shows the workers' addresses only to keys of an `admin: true` tenant (or to anyone
with auth off); other keys get the rows with the addresses blanked. On SIGTERM the router drains: streams still
running near the end of `--grace-s` end with finish reason ABORT rather than being cut off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from prometheus_client import Gauge

from qwenserve import supervision
from qwenserve.checkpoint_config import checkpoint_limits
from qwenserve.grpc_server import GrpcServerConfig, serve
from qwenserve.router import grpc_generate
from qwenserve.router.discovery import metrics_address
from qwenserve.router.errors import RouterError
from qwenserve.router.front_door import close_gatekeeper, make_gatekeeper, start_http_front
from qwenserve.router.gatekeeper import Gatekeeper, api_key_from_grpc_metadata
from qwenserve.router.generation import Router
from qwenserve.router.generation_defaults import load_generation_defaults
from qwenserve.router.models import ModelRoutes, ModelsConfigError, load_models_file
from qwenserve.router.reasoning import THINK_END, THINK_START
from qwenserve.router.request_ids import new_request_id
from qwenserve.router.tls import TlsConfigError, grpc_server_credentials
from qwenserve.stage_secret import load_stage_secret
from qwenserve.stages.common import argv_or_sys, checked, run_checked
from qwenserve.stages.router import RouterServiceConfig, check, parse_config
from qwenserve.status import probe_stage, without_addresses
from qwenserve.telemetry.logs import bind_request_id
from qwenserve.telemetry.metrics import RouterMetrics, router_metrics
from qwenserve.tenancy.tenants import TenancyConfigError, Tenant
from qwenserve.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from qwenserve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Generate goes through the front door (auth, limits, metering); the rest is the library's."""

    def __init__(
        self, routes: ModelRoutes, gatekeeper: Gatekeeper, metrics: RouterMetrics, config: RouterServiceConfig
    ) -> None:
        self.routes = routes
        self.gatekeeper = gatekeeper
        self.metrics = metrics
        self.config = config

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        async for msg in grpc_generate.generate(self.routes, self.gatekeeper, request, context):
            yield msg

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The caller's tenant; ends the call with UNAUTHENTICATED unless it carries a valid API key (or auth is
        off)."""
        try:
            return self.gatekeeper.authenticate(api_key_from_grpc_metadata(context.invocation_metadata()))
        except RouterError as e:
            await grpc_generate.refuse(context, e)

    async def ListModels(  # noqa: N802 - gRPC method name
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        await self._authenticate(context)
        return router_pb2.ListModelsResponse(models=[
            router_pb2.ModelCard(id=name, max_model_len=router.config.max_model_len, owned_by="qwen-serve")
            for name, router in self.routes.routers.items()
        ])

    async def GetStatus(  # noqa: N802 - gRPC method name
        self, request: router_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetStatusResponse:
        tenant = await self._authenticate(context)
        # The probes carry this id, not the caller's x-request-id (which could be up to gRPC's metadata limit).
        with bind_request_id(new_request_id("status")):
            status = await self._status()
        if self.gatekeeper.keys.is_admin(tenant):
            return status
        return router_pb2.GetStatusResponse(stages=without_addresses(status.stages))

    async def _status(self) -> router_pb2.GetStatusResponse:
        c = self.config
        me = router_pb2.StageStatus(
            stage="router", address=f"{c.host}:{c.port}", state="SERVING", load_known=True,
            metrics_address=f"{c.host}:{c.metrics_port}" if c.metrics_port else "",
            running=int(_gauge_value(self.metrics.in_flight)),
            tokens_per_second=self.metrics.completion_rate.per_second(), restarts=supervision.restarts(),
        )
        rows = []
        for router in self.routes.routers.values():
            one = self.routes.single()  # the flags' metrics addresses belong to the flags' one model
            stages = [("tokenizer", router.config.tokenizer_address, c.tokenizer_metrics if one else "")]
            # Every pod of every engine stage (a name stands for the pods it resolves to), draining ones too.
            for stage, entries, metrics in (("prefill", router.config.prefill_addresses, c.prefill_metrics),
                                            ("decode", router.config.decode_addresses, c.decode_metrics)):
                stages += [(stage, pod, metrics_address(pod, entries, metrics if one else []))
                           for pod in router.fleet.pods(stage)]
            probed = await asyncio.gather(*(
                probe_stage(stage, address, router.fleet.channel(address), metrics) for stage, address, metrics in stages
            ))
            draining = router.fleet.draining_pods()
            for row in probed:
                row.max_model_len = router.fleet.worker_limits.get(row.address, 0)
                if row.address in draining:
                    row.state = "DRAINING"
            rows += probed
        me.max_model_len = self.routes.routers[self.routes.default].config.max_model_len
        return router_pb2.GetStatusResponse(stages=[me, *rows])


def _gauge_value(gauge: Gauge) -> float:
    """The current value of an unlabelled gauge, through the collector interface."""
    return next(iter(gauge.collect())).samples[0].value


def _load_tokenizer(model: str | None) -> tuple[Tokenizer, int, str]:
    """The detokenizer's vocabulary, the model's positions (its context at most) and a model name, from the
    checkpoint."""
    if model is None:
        from qwenserve.default_model import ensure_default_model

        model = str(ensure_default_model())
    folder = Path(model)
    return Tokenizer.from_dir(folder), checkpoint_limits(folder).max_position_embeddings, folder.name


def _think_token_ids(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """The vocabulary's <think> and </think> ids (Qwen3's); None for a model without them."""
    start, end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
    return (start, end) if start is not None and end is not None else None


def _router(config: RouterServiceConfig, metrics: RouterMetrics, name: str, model: str | None, tokenizer: str,
            prefill: list[str], decode: list[str], stage_secret_file: str | None = None,
            has_fallback: bool = False) -> Router:
    """One model's Router: the flags' settings (config.router) with the model's wiring, its vocabulary and
    sampling defaults from its checkpoint; its stages' secret is `stage_secret_file` (another deployment's), else
    --stage-secret-file."""
    vocabulary, model_len, folder_name = _load_tokenizer(model)
    defaults = load_generation_defaults(config.generation_config, model)
    if defaults:
        log.info("%s: sampling defaults from the generation config (a request's own settings win): %s",
                 name or folder_name, defaults)
    return Router(
        dataclasses.replace(
            config.router, tokenizer_address=tokenizer, prefill_addresses=prefill, decode_addresses=decode,
            model_name=name or folder_name, max_model_len=config.router.max_model_len or model_len,
            think_token_ids=_think_token_ids(vocabulary), sampling_defaults=defaults,
            stage_secret=load_stage_secret(stage_secret_file or config.stage_secret_file),
            first_token_waits_for_decode=has_fallback,
        ),
        lambda skip: IncrementalDetokenizer(vocabulary, skip_special_tokens=skip),
        metrics,
        token_bytes=vocabulary.token_bytes,
    )


def build_routes(config: RouterServiceConfig, metrics: RouterMetrics) -> ModelRoutes:
    """The models this router serves: the one of its flags, or every one of --models-file."""
    if not config.models_file:
        router = _router(config, metrics, config.model_name, config.model, config.tokenizer, config.prefill,
                         config.decode)
        return ModelRoutes({router.config.model_name: router}, router.config.model_name)
    models = load_models_file(config.models_file)
    routers = {e.name: _router(config, metrics, e.name, e.model, e.tokenizer, list(e.prefill), list(e.decode),
                               e.stage_secret_file, e.fallback is not None) for e in models.entries}
    return ModelRoutes(routers, models.default, {e.name: e for e in models.entries},
                       on_fallback=lambda model, fallback: metrics.fallbacks.labels(model, fallback).inc())


async def run(config: RouterServiceConfig) -> None:
    metrics = router_metrics()
    routes = build_routes(config, metrics)
    metrics.model_name = routes.default  # the model_name label of vLLM's metrics
    gatekeeper = make_gatekeeper(config.front, metrics)
    runners = []
    routers = list(routes.routers.values())

    async def open_http() -> None:
        if config.http_port:
            runners.append(await start_http_front(routes, gatekeeper, config.front, routes.default, config.host,
                                                  config.http_port))

    starting: list[asyncio.Task[None]] = []

    async def warm_up() -> None:
        if routes.single():
            await routers[0].start()
            await open_http()
            return
        # Several models: one whose stages are down must not keep the others (or its fallback) off HTTP, nor health
        # at NOT_SERVING: HTTP opens at once, and the router serves once one model's router has started; the others
        # start on meanwhile, their requests getting a retryable 503 or going to their fallback until then.
        await open_http()
        starts = {name: asyncio.ensure_future(_keep_starting(name, router)) for name, router in routes.routers.items()}
        starting.extend(starts.values())
        await _first_started(starts)

    def register(server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(routes, gatekeeper, metrics, config), server)

    def drain() -> None:
        for router in routers:
            router.drain(config.grace_s)

    tls = config.front.tls
    server_config = GrpcServerConfig(
        host=config.host, port=config.port, grace_s=config.grace_s, metrics_port=config.metrics_port,
        credentials=grpc_server_credentials(tls) if tls is not None else None,
    )
    try:
        await serve(server_config, "router", [SERVICE_NAME], register, warm_up=warm_up, on_drain=drain)
    finally:
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        for runner in runners:
            await runner.cleanup()
        await close_gatekeeper(gatekeeper)
        for router in routers:
            await router.close()


async def _keep_starting(name: str, router: Router) -> None:
    """Start one of several models' routers, asking its tokenizer again until it answers: one model's stage down at
    start must not stop the router serving the others (a single model's router exits and is restarted instead)."""
    while True:
        try:
            await router.start()
            return
        except grpc.aio.AioRpcError as e:
            log.warning("%s: its tokenizer did not answer (%s); asking again", name, e.code().name)


async def _first_started(starts: dict[str, asyncio.Task[None]]) -> None:
    """Return once one of the models' routers (`starts`, by name) has started, naming those still starting."""
    done, _ = await asyncio.wait(starts.values(), return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        task.result()  # a fault of the router itself: the stage stops
    waiting = [name for name, task in starts.items() if not task.done()]
    if waiting:
        log.warning("router serving; still waiting for the workers of %s", ", ".join(waiting))


def start(config: RouterServiceConfig) -> int:
    """`qwen-serve serve router` from its parsed and checked config (the CLI did both, before importing this
    module) to the stage's exit code."""
    return run_checked("router", config, run,
                       startup_errors=(TenancyConfigError, TlsConfigError, TokenizerError, ModelsConfigError))


def main(argv: list[str] | None = None) -> int:
    """`python -m qwenserve_services.router.server [flags]`: parse, check, start."""
    config = checked("router", parse_config(argv_or_sys(argv)), check)
    return 1 if config is None else start(config)


if __name__ == "__main__":
    sys.exit(main())
