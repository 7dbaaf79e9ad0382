"""The router stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qwenserve.flags import StrictParser, address_list, nested, option
from qwenserve.preflight import StartupError, check_model_folder, check_port_free
from qwenserve.presets import PRESET_NAMES
from qwenserve.router.config import RouterConfig
from qwenserve.router.front_door import FrontConfig, load_front_keys
from qwenserve.router.generation_defaults import GenerationConfigError, load_generation_defaults
from qwenserve.router.models import ModelsConfigError, load_models_file
from qwenserve.router.tls import TlsConfigError
from qwenserve.stages.common import (
    StageConfig,
    check_common,
    resolve_model,
    stage_parser,
)
from qwenserve.tenancy.tenants import TenancyConfigError


@dataclass(frozen=True)
class RouterServiceConfig(StageConfig):
    """Everything the router stage is configured by (flags, else QWENSERVE_* environment)."""

    port: int = option(50050, help="gRPC port (0: a free one, printed at start)")
    model: str | None = option(None, positional=True,
                               help="checkpoint folder: its tokenizer files and config.json (default: the built-in)")
    http_port: int = option(0, help="OpenAI-compatible HTTP port (0: off)")
    served_model_name: str = option("", aliases=("--model-name",),
                                    help="the name clients use for the model (default: the folder's name)")
    router: RouterConfig = nested(RouterConfig)  # how requests are treated; the stage sets each model's wiring
    tokenizer: str = option("127.0.0.1:50051", help="tokenizer service address")
    prefill: list[str] = option(default_factory=list, type=address_list,
                                help="prefill workers, comma-separated host:port (a name: each pod it resolves to)")
    decode: list[str] = option(default_factory=list, type=address_list,
                               help="decode workers, comma-separated host:port (a name: each pod it resolves to; "
                                    "at least one)")
    preset: str = option("none", choices=PRESET_NAMES,
                         help="latency or throughput, as the engine stages': here it sets "
                              "--max-streams-per-decode-worker; flags given beside it win")
    models_file: str = option(
        "", help="serve several models, each with its own stages, fallback and canary (a YAML file, see "
                 "qwenserve/router/models.py); the model, --tokenizer, --prefill and --decode are then unused")
    generation_config: str = option(
        "auto", help="sampling defaults for what a request leaves out: auto (the model folder's "
                     "generation_config.json), vllm or none (no model defaults), or a folder holding that file")
    tokenizer_metrics: str = option("", help="the tokenizer's metrics host:port (for status)")
    prefill_metrics: list[str] = option(default_factory=list, type=address_list,
                                        help="prefill workers' metrics host:port, as --prefill")
    decode_metrics: list[str] = option(default_factory=list, type=address_list,
                                       help="decode workers' metrics host:port, as --decode")
    front: FrontConfig = nested(FrontConfig)
    model_name: str = field(default="", init=False)  # the name served: --served-model-name or the folder's

    def __post_init__(self) -> None:
        name = self.served_model_name or (Path(self.model).name if self.model else "")
        object.__setattr__(self, "model_name", name)


def build_parser(prog: str | None = None, argv: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None) -> StrictParser:
    """`qwen-serve serve router`'s parser (with the defaults of the preset `argv` names; variables from
    `environ`, default this process's)."""
    return stage_parser("router", RouterServiceConfig,
                        "The Router stage: gRPC Generate and the OpenAI HTTP front over the workers.", prog, argv,
                        environ)


def parse_config(argv: Sequence[str], prog: str | None = None,
                 environ: Mapping[str, str] | None = None) -> RouterServiceConfig:
    """Flags, falling back to QWENSERVE_* variables (of `environ`, default this process's), falling back to
    defaults."""
    parser = build_parser(prog, argv, environ)
    config: RouterServiceConfig = parser.parse_config(RouterServiceConfig, argv)
    if not config.decode and not config.models_file:
        parser.error("at least one --decode worker is required (host:port[,host:port]), or --models-file")
    router = config.router
    if router.max_streams_per_decode_worker < 0 or router.max_queue_wait_s < 0 or router.priority_aging_s < 0:
        parser.error("--max-streams-per-decode-worker, --max-queue-wait-s and --priority-aging-s must be >= 0")
    return config


def check(config: RouterServiceConfig) -> RouterServiceConfig:
    """Before serving: the model folder, the ports, the TLS files and the API keys."""
    check_common(config, needs_tokenizer=True)
    if config.http_port and config.http_port != config.port:
        check_port_free(config.host, config.http_port, "--http-port")
    try:
        config.front.tls  # noqa: B018 - reads and checks the files
        load_front_keys(config.front)
        load_generation_defaults(config.generation_config, resolve_model(config.model))
        if config.models_file:
            for entry in load_models_file(config.models_file).entries:
                if entry.model is not None:
                    check_model_folder(entry.model, f"{config.models_file}: model {entry.name}", needs_tokenizer=True)
    except (TlsConfigError, TenancyConfigError, GenerationConfigError, ModelsConfigError) as e:
        raise StartupError(str(e)) from None
    return dataclasses.replace(config, model=resolve_model(config.model))
