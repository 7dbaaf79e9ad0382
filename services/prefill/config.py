"""The prefill stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from qwenserve.addresses import is_wildcard_host
from qwenserve.flags import StrictParser, option
from qwenserve.preflight import StartupError
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
    advertise_host: str = option(
        "", help="address decode workers dial for this worker's handoffs (default: --host, or this host's primary "
                 "address when --host is a wildcard; a pod: its pod IP)")
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
    if config.advertise_host and is_wildcard_host(config.advertise_host):
        parser.error(f"--advertise-host {config.advertise_host} is a wildcard address, which decode workers cannot "
                     "dial; give this host's address")
    return config


def check(config: PrefillServiceConfig) -> PrefillServiceConfig:
    """The engine stage's checks, then the address handoffs advertise (--advertise-host, resolved here)."""
    config = check_engine_stage(config)
    return dataclasses.replace(config, advertise_host=advertise_host(config.host, config.advertise_host))


def advertise_host(host: str, advertise: str = "") -> str:
    """The address put in every handoff: `advertise`, else `host` unless it is a wildcard, else the address of
    this host's default route. Raises StartupError when none is known."""
    if advertise:
        return advertise
    if not is_wildcard_host(host):
        return host
    primary = primary_address(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if primary is None:
        raise StartupError(f"--host {host} is a wildcard address and this host has no default route to take its "
                           "address from; set --advertise-host (QWENSERVE_ADVERTISE_HOST) to the address decode "
                           "workers reach this worker on (a pod: its status.podIP)")
    return primary


def primary_address(family: int = socket.AF_INET) -> str | None:
    """The local address of the default route (a UDP socket's connect sends nothing), or None without one."""
    probe = ("192.0.2.1", 9) if family == socket.AF_INET else ("2001:db8::1", 9)  # documentation addresses
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)
            address: str = s.getsockname()[0]
    except OSError:
        return None
    return None if is_wildcard_host(address) else address
