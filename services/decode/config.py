"""The decode stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

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
class DecodeServiceConfig(EngineStageConfig):
    """Everything the decode stage is configured by (flags, else QWENSERVE_* environment)."""

    port: int = option(50053, help="gRPC port (0: a free one, printed at start)")
    stream_interval_ms: float = option(
        0.0, help="send tokens at most this often after the first (fewer, fuller messages; 0: at once)")


def build_parser(prog: str | None = None) -> StrictParser:
    """`qwen-serve serve decode`'s parser."""
    return stage_parser("decode", DecodeServiceConfig,
                        "The Decode stage: import a handoff (or prefill locally) and stream tokens.", prog)


def parse_config(argv: Sequence[str], prog: str | None = None) -> DecodeServiceConfig:
    """Flags, falling back to QWENSERVE_* environment variables, falling back to defaults."""
    parser = build_parser(prog)
    config: DecodeServiceConfig = parser.parse_config(DecodeServiceConfig, argv)
    check_engine_options(parser, config)
    return config


check = check_engine_stage
