"""Command-line flags with `QWENSERVE_*` environment fallbacks, and the one start-up line that prints them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any


def env_name(flag: str) -> str:
    """`--kv-transfer` -> `QWENSERVE_KV_TRANSFER`."""
    return "QWENSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, *, default: Any = None, type: Any = str,
             help: str = "", **kwargs: Any) -> None:
    """Add `flag` whose default comes from its environment variable when set."""
    env = os.environ.get(env_name(flag))
    if env is not None:
        default = type(env) if type is not bool else env.lower() in ("1", "true", "yes", "on")
    if type is bool:
        # BooleanOptionalAction reads any "--no-..." spelling as False, so negative names are plain switches.
        action = "store_true" if flag.startswith("--no-") else argparse.BooleanOptionalAction
        parser.add_argument(flag, action=action, default=bool(default),
                            help=f"{help} [env {env_name(flag)}]", **kwargs)
        return
    parser.add_argument(flag, type=type, default=default, help=f"{help} [env {env_name(flag)}]", **kwargs)


def address_list(value: str) -> list[str]:
    """`host:port,host:port` -> list; empty string -> []."""
    return [a.strip() for a in value.split(",") if a.strip()]


def print_config(component: str, config: object) -> None:
    """Print a component's configuration once at start-up (secrets are never fields of these)."""
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else vars(config)
    body = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"{component} config: {body}", file=sys.stderr, flush=True)
