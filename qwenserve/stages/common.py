"""What every stage's configuration shares, and the way from argv to a running stage.

A stage's options are one frozen dataclass (`qwenserve/stages/<stage>.py`) deriving from `StageConfig`; its
flags, their `QWENSERVE_<FLAG>` fallbacks and the strict parser come from that dataclass (`qwenserve.flags`).
Parsing only reads the command line (the operator's contract test parses rendered manifests with it); the
checks of the host (the model folder, free ports, key files) run at start, each failing in one line.

These modules import no torch and no gRPC servers, so `qwen-serve up` can build every stage's argv from them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ClassVar, TypeVar

from qwenserve.addresses import is_wildcard_host
from qwenserve.engine.admission_policy import WatermarkSettings
from qwenserve.engine.config import EngineConfig
from qwenserve.flags import StrictParser, add_options, nested, option, option_specs
from qwenserve.preflight import StartupError, check_model_folder, check_port_free, one_line
from qwenserve.presets import PRESET_NAMES, preset_defaults, preset_named
from qwenserve.stage_secret import load_stage_secret

C = TypeVar("C", bound="StageConfig")

#: The stages, in the order `qwen-serve up` starts them; each has a module here named after it.
STAGES: tuple[str, ...] = ("tokenizer", "prefill", "decode", "router")

#: How prefill hands KV to decode: shared memory on one host, a gRPC byte stream, or Mooncake Transfer Engine.
KV_TRANSFER_MODES = ("shm", "network", "mooncake")

#: What every stage reads from the environment besides its flags' variables: `--log-json`'s QWENSERVE_LOG_FORMAT
#: (the operator sets it), the first-use progress mode and name, and where the built-in model is cached.
COMMON_ENVIRONMENT = frozenset({"QWENSERVE_LOG_FORMAT", "QWENSERVE_PROGRESS", "QWENSERVE_PROGRESS_NAME",
                                "QWENSERVE_CACHE", "QWENSERVE_SUPERVISOR"})


@dataclass(frozen=True)
class StageConfig:
    """The options every stage has."""

    host: str = option("127.0.0.1", help="address to bind (a pod: 0.0.0.0)")
    port: int = option(0, help="gRPC port (0: a free one, printed at start)")
    model: str | None = option(None, positional=True,
                               help="Hugging Face checkpoint folder (default: the built-in small Qwen3)")
    grace_s: float = option(10.0, help="drain time on SIGTERM, in seconds")
    metrics_port: int = option(0, help="Prometheus /metrics, /healthz, /readyz port (0: off)")
    # QWENSERVE_LOG_FORMAT=json (read by the logging setup) is this switch's variable: the operator sets it.
    log_json: bool | None = option(None, env=False, help="log one JSON object per line [env QWENSERVE_LOG_FORMAT=json]")
    log_level: str | None = option(None, help="DEBUG, INFO, WARNING, ... (default INFO)")
    stage_secret_file: str = option(
        "", help="file holding the deployment's stage secret: prefill, decode and the tokenizer serve only callers "
                 "that prove they know it, the router and decode prove it (qwen-serve up makes one per run; "
                 "unset: any caller is served, with a warning)")

    #: Variables the stage reads that are no flag's (see `variables`).
    ENVIRONMENT: ClassVar[frozenset[str]] = COMMON_ENVIRONMENT

    @classmethod
    def variables(cls) -> frozenset[str]:
        """Every QWENSERVE_* variable this stage reads: its flags' and ENVIRONMENT."""
        return frozenset(spec.env for spec in option_specs(cls) if spec.env) | cls.ENVIRONMENT


@dataclass(frozen=True)
class EngineStageConfig(StageConfig):
    """The options prefill and decode share: the engine's, and the names vLLM users type for them."""

    served_model_name: str = option(
        "", help="the model's name in vLLM's metrics' model_name label, as the router's (default: the folder's)")
    tensor_parallel_size: int = option(1, help="GPUs one engine spans; only 1 is supported")
    preset: str = option("none", choices=PRESET_NAMES,
                         help="latency or throughput: sets the step budget, max sequences, admission policy, burst "
                              "steps and (decode) stream interval together; flags given beside it win")
    engine: EngineConfig = nested(EngineConfig, kv_cache_memory_gb=1.0)


def stage_module(stage: str) -> ModuleType:
    """`qwenserve.stages.<stage>`: the stage's config class, `build_parser`, `parse_config` and `check`."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; the stages are {', '.join(STAGES)}")
    return importlib.import_module(f"qwenserve.stages.{stage}")


def stage_parser(stage: str, config_class: type, description: str, prog: str | None = None,
                 argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> StrictParser:
    """The strict parser of a stage, every flag derived from `config_class`; the defaults are the preset's that
    `argv` (or QWENSERVE_PRESET) names, where the stage has those options. Variables are read from `environ`
    (default: this process's environment; a child's, for `qwen-serve up`, which passes them on unread)."""
    parser = StrictParser(prog=prog or f"qwen-serve serve {stage}", description=description)
    add_options(parser, config_class, defaults=preset_defaults(preset_named(argv, environ)), environ=environ)
    return parser


def undefined_flags(stage: str, argv: Sequence[str], taken: Sequence[str] = ()) -> list[str]:
    """The flags in `argv` that `qwen-serve serve STAGE` does not define, or that are in `taken` (set by whoever
    builds the rest of the command line): what the operator refuses in a spec's extra stage arguments."""
    known = stage_module(stage).build_parser()._option_string_actions
    flags = [token.split("=", 1)[0] for token in argv if token.startswith("--")]
    return [flag for flag in flags if flag not in known or flag in taken]


def check_common(config: StageConfig, *, needs_tokenizer: bool = False) -> None:
    """The checks every stage makes before loading anything: its model folder and its ports."""
    if config.model:
        check_model_folder(config.model, needs_tokenizer=needs_tokenizer)
    if config.stage_secret_file:
        load_stage_secret(config.stage_secret_file)
    check_port_free(config.host, config.port, "--port")
    if config.metrics_port and config.metrics_port != config.port:
        check_port_free(config.host, config.metrics_port, "--metrics-port")


def check_advertise_host(parser: StrictParser, host: str, dialled_by: str) -> None:
    """Refuse an --advertise-host that `dialled_by` could not dial: a wildcard names no host."""
    if host and is_wildcard_host(host):
        parser.error(f"--advertise-host {host} is a wildcard address, which {dialled_by} cannot dial; "
                     "give this host's address")


def check_engine_options(parser: StrictParser, config: EngineStageConfig) -> None:
    """Refuse what an engine stage cannot do here, in one line (tensor parallelism on a host without GPUs)."""
    engine = config.engine
    try:
        WatermarkSettings(engine.watermark_window, engine.watermark_percentile, engine.watermark_decay,
                          engine.watermark_reset_idle_s)
    except ValueError as e:
        parser.error(str(e))
    if engine.priority_aging_s < 0:
        parser.error("--priority-aging-s must be >= 0 (0: priorities never age)")
    tp = config.tensor_parallel_size
    if tp < 1:
        parser.error(f"--tensor-parallel-size {tp}: give 1")
    if tp > 1:
        import torch

        if not torch.cuda.is_available():
            parser.error("tensor parallelism needs GPUs; this host has none (use --tensor-parallel-size 1)")
        parser.error(f"--tensor-parallel-size {tp}: tensor parallelism is not supported yet; "
                     "run more decode workers instead (--tensor-parallel-size 1)")


def check_kv_transfer(mode: str | None) -> None:
    """Mooncake is an optional package: without it a stage that would hand off over it does not start."""
    if mode != "mooncake":
        return
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        raise StartupError(f"--kv-transfer mooncake needs Mooncake Transfer Engine, which is not importable ({e}); "
                           "install the mooncake extra (mooncake-transfer-engine-non-cuda) or choose network") from None


def check_engine_stage(config: EngineStageConfig) -> EngineStageConfig:
    """Before loading weights: the model folder and the ports; the built-in model is made if none is given, and
    the served name defaults to the checkpoint folder's name."""
    check_common(config)
    model = resolve_model(config.model)
    return dataclasses.replace(config, model=model, served_model_name=config.served_model_name or Path(model).name)


def checked(name: str, config: C, check: Callable[[C], C]) -> C | None:
    """`check(config)`: the host's side (model folder, ports, key files), returning the config with what it
    resolved (the built-in model's folder, the advertised address); None after the failure's one line on
    stderr. Runs once per process, before the server module (and torch) is imported."""
    from qwenserve.telemetry.logs import console

    try:
        return check(config)
    except StartupError as e:
        console("%s: cannot start: %s", name, one_line(e), level=logging.ERROR, stderr=True)
        return None


def run_checked(name: str, config: C, run: Callable[[C], Awaitable[None]],
                startup_errors: Sequence[type[Exception]] = ()) -> int:
    """From a checked config to the stage's exit code (`run_stage`: logging, the one config line, the event
    loop). Start-up failures are one line on stderr and exit status 1."""
    from qwenserve.grpc_server import run_stage

    return run_stage(name, config, run, startup_errors=(StartupError, *startup_errors))


def resolve_model(model: str | None) -> str:
    """The checkpoint to serve: the given folder, or the built-in default (made on first use)."""
    if model:
        return model
    from qwenserve.default_model import ensure_default_model

    return str(ensure_default_model())


def argv_or_sys(argv: Sequence[str] | None) -> list[str]:
    """The stage's arguments: `argv`, or the process's own."""
    return list(sys.argv[1:] if argv is None else argv)
