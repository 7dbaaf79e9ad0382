"""The router stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from qwenserve.flags import StrictParser, address_list, nested, option
from qwenserve.preflight import StartupError, check_model_folder, check_port_free
from qwenserve.presets import PRESET_NAMES
from qwenserve.router.front_door import FrontConfig, load_front_keys
from qwenserve.router.generation_defaults import GenerationConfigError, load_generation_defaults
from qwenserve.router.models import ModelsConfigError, load_models_file
from qwenserve.router.tls import TlsConfigError
from qwenserve.stages.common import (
    COMMON_ENVIRONMENT,
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
    max_model_len: int | None = option(
        None, help="longest request, prompt + output tokens, as the engines' --max-model-len (default: the model's)")
    tokenizer: str = option("127.0.0.1:50051", help="tokenizer service address")
    prefill: list[str] = option(default_factory=list, type=address_list,
                                help="prefill workers, comma-separated host:port (a name: each pod it resolves to)")
    decode: list[str] = option(default_factory=list, type=address_list,
                               help="decode workers, comma-separated host:port (a name: each pod it resolves to; "
                                    "at least one)")
    local_prefill_threshold: int = option(
        0, help="prompts shorter than this many tokens are prefilled on the decode worker")
    connect_timeout_s: float = option(
        5.0, help="a worker whose connection is not ready within this many seconds is skipped")
    prefill_timeout_s: float = option(
        300.0, help="deadline of one prefill call (plus 0.1 s a prompt token) when the request has none sooner"
    )
    tokenizer_timeout_s: float = option(
        30.0, help="deadline of one tokenizer call (and of a worker's GetInfo) when the request has none sooner")
    stall_timeout_s: float = option(
        30.0, help="a decode stream silent this long (first token included) fails over to another worker")
    resolve_interval_s: float = option(
        5.0, help="how often --prefill / --decode names (a headless Service) are resolved again to their pods")
    cold_start_wait_s: float = option(
        0.0, help="hold a request this long while the decode stage has no pod (scaled to zero) for one to start; "
                  "then 503 with Retry-After (0: at once)")
    max_streams_per_decode_worker: int = option(
        0, help="at most this many requests in flight per decode worker, counted before prefill; more wait here "
                "(tier priority, then arrival), so no stream stalls for a decode slot after its first token (0: no bound)")
    max_queue_wait_s: float = option(
        60.0, help="a request waiting longer than this for a decode stream slot gets 503 with Retry-After")
    priority_aging_s: float = option(
        5.0, help="requests waiting for a decode stream slot go by tier priority, one level better per this many "
                  "seconds waited, as in the engines")
    preset: str = option("none", choices=PRESET_NAMES,
                         help="latency or throughput, as the engine stages': here it sets "
                              "--max-streams-per-decode-worker; flags given beside it win")
    reasoning_parser: str = option(
        "qwen3", choices=("qwen3", "none"),
        help="chat answers: a <think> block goes to reasoning_content (none: it stays in the content)")
    tool_call_parser: str = option(
        "hermes", choices=("hermes", "none"),
        help="chat requests with tools: <tool_call> blocks become tool_calls (none: tools are refused)")
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

    # Keys as "key:tenant,..." (secrets stay out of argv; qwenserve/tenancy/keys.py).
    ENVIRONMENT: ClassVar[frozenset[str]] = COMMON_ENVIRONMENT | {"QWENSERVE_API_KEYS"}

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
    if config.max_streams_per_decode_worker < 0 or config.max_queue_wait_s < 0 or config.priority_aging_s < 0:
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
