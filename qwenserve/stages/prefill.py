"""The prefill stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

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
class PrefillServiceConfig(EngineStageConfig):
    """Everything the prefill stage is configured by (flags, else QWENSERVE_* environment)."""

    port: int = option(50052, help="gRPC port of Prefill and KVTransfer (0: a free one, printed at start)")
    kv_transfer: str = option("shm", choices=KV_TRANSFER_MODES,
                              help="handoff transport (mooncake: Mooncake Transfer Engine, an optional package)")
    advertise_host: str = option(
        "", help="address decode workers dial for this worker's handoffs (default: --host, or this host's primary "
                 "address when --host is a wildcard; a pod: its pod IP)")
    lease_s: float = option(30.0, help="how long an unacknowledged handoff is kept, in seconds")
    kv_pool_mib: int = option(256, help="handoff memory kept ready (pre-faulted); a larger handoff gets a region "
                                        "of its own")
    kv_max_mib: int = option(4096, help="most memory unreleased handoffs may hold")


def build_parser(prog: str | None = None, argv: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None) -> StrictParser:
    """`qwen-serve serve prefill`'s parser (variables from `environ`, default this process's)."""
    return stage_parser("prefill", PrefillServiceConfig,
                        "The Prefill stage: prompt in, first token and a KV handoff out.", prog, argv, environ)


def parse_config(argv: Sequence[str], prog: str | None = None,
                 environ: Mapping[str, str] | None = None) -> PrefillServiceConfig:
    """Flags, falling back to QWENSERVE_* variables (of `environ`, default this process's), falling back to
    defaults."""
    parser = build_parser(prog, argv, environ)
    config: PrefillServiceConfig = parser.parse_config(PrefillServiceConfig, argv)
    check_engine_options(parser, config)
    check_advertise_host(parser, config.advertise_host, "decode workers")
    return config


def check(config: PrefillServiceConfig) -> PrefillServiceConfig:
    """The engine stage's checks, then the address handoffs advertise (--advertise-host, resolved here)."""
    config = check_engine_stage(config)
    check_kv_transfer(config.kv_transfer)
    return dataclasses.replace(config, advertise_host=advertise_host(config.host, config.advertise_host))
