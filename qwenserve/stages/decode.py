"""The decode stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qwenserve.addresses import advertise_host
from qwenserve.flags import StrictParser, option
from qwenserve.stages.common import (
    KV_TRANSFER_MODES,
    EngineStageConfig,
    check_advertise_host,
    check_engine_options,
    check_engine_stage,
    check_kv_transfer,
    stage_parser,
)


@dataclass(frozen=True)
class DecodeServiceConfig(EngineStageConfig):
    """Everything the decode stage is configured by (flags, else QWENSERVE_* environment)."""

    port: int = option(50053, help="gRPC port (0: a free one, printed at start)")
    stream_interval_ms: float = option(
        0.0, help="send tokens at most this often after the first (fewer, fuller messages; 0: at once)")
    kv_transfer: str | None = option(
        None, choices=KV_TRANSFER_MODES,
        help="the transport prefill workers hand off over; decode fetches over it alone (default: shm or network; "
             "mooncake only when named, as it starts a Transfer Engine)")
    advertise_host: str = option(
        "", help="address of this worker's Mooncake Transfer Engine (mooncake only; default: --host, or this host's "
                 "primary address when --host is a wildcard; a pod: its pod IP)")


def build_parser(prog: str | None = None, argv: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None) -> StrictParser:
    """`qwen-serve serve decode`'s parser (variables from `environ`, default this process's)."""
    return stage_parser("decode", DecodeServiceConfig,
                        "The Decode stage: import a handoff (or prefill locally) and stream tokens.", prog, argv,
                        environ)


def parse_config(argv: Sequence[str], prog: str | None = None,
                 environ: Mapping[str, str] | None = None) -> DecodeServiceConfig:
    """Flags, falling back to QWENSERVE_* variables (of `environ`, default this process's), falling back to
    defaults."""
    parser = build_parser(prog, argv, environ)
    config: DecodeServiceConfig = parser.parse_config(DecodeServiceConfig, argv)
    check_engine_options(parser, config)
    check_advertise_host(parser, config.advertise_host, "prefill workers")
    return config


def check(config: DecodeServiceConfig) -> DecodeServiceConfig:
    """The engine stage's checks; with Mooncake, the address its Transfer Engine announces."""
    config = check_engine_stage(config)
    check_kv_transfer(config.kv_transfer)
    if config.kv_transfer != "mooncake":
        return config
    return dataclasses.replace(config, advertise_host=advertise_host(config.host, config.advertise_host))
