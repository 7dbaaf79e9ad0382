"""The prefill stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qwenserve.flags import StrictParser, option
from qwenserve_services.stage_config import (
    EngineStageConfig,
    check_engine_options,
    check_engine_stage,
    stage_parser,
)


@dataclass(frozen=True)
class PrefillServiceConfig(EngineStageConfig):
    """Everything the prefill stage is configured by (flags, else QWENSERVE_* environment)."""

    port: int = option(50052, help="gRPC port of Prefill and KVTransfer (0: a free one, printed at start)")
    kv_transfer: str = option("shm", choices=("shm", "network"), help="handoff transport")
    lease_s: float = option(30.0, help="how long an unacknowledged handoff is kept, in seconds")
    kv_pool_mib: int = option(256, help="handoff memory kept ready (pre-faulted); a larger handoff gets a region "
                                        "of its own")
    kv_max_mib: int = option(4096, help="most memory unreleased handoffs may hold")


def build_parser(prog: str | None = None) -> StrictParser:
    """`qwen-serve serve prefill`'s parser."""
    return stage_parser("prefill", PrefillServiceConfig,
                        "The Prefill stage: prompt in, first token and a KV handoff out.", prog)


def parse_config(argv: Sequence[str], prog: str | None = None) -> PrefillServiceConfig:
    """Flags, falling back to QWENSERVE_* environment variables, falling back to defaults."""
    parser = build_parser(prog)
    config: PrefillServiceConfig = parser.parse_config(PrefillServiceConfig, argv)
    check_engine_options(parser, config)
    return config


check = check_engine_stage
