"""`qwen-serve usage show [--redis-url URL] [--tenant ID] [--json]`: the metered totals per tenant."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from qwenserve.flags import StrictParser
from qwenserve.ratelimit.redis_client import connect
from qwenserve.tenancy.usage import USAGE_FIELDS, RedisUsageMeter, UsageMeterUnavailable


def _parser() -> argparse.ArgumentParser:
    parser = StrictParser(prog="qwen-serve usage", description="Per-tenant usage totals.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print requests and tokens per tenant")
    show.add_argument(
        "--redis-url",
        default=os.environ.get("QWENSERVE_REDIS_URL"),
        help="Redis holding the counters (default: $QWENSERVE_REDIS_URL)",
    )
    show.add_argument("--tenant", help="only this tenant")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.add_argument("--key-prefix", default="qwenserve:usage", help=argparse.SUPPRESS)
    show.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for Redis (default 2)")
    return parser


def format_table(totals: dict[str, dict[str, int]]) -> str:
    """A fixed-width table: one row per tenant, one column per counter."""
    header = ("tenant", *USAGE_FIELDS)
    rows = [(tenant_id, *(str(row[f]) for f in USAGE_FIELDS)) for tenant_id, row in sorted(totals.items())]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in (header, *rows)
    ]
    return "\n".join(lines)


async def _show(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    meter = RedisUsageMeter(
        connect(args.redis_url, timeout_s=args.timeout, max_connections=2), key_prefix=args.key_prefix
    )
    try:
        if args.tenant:
            return {args.tenant: await meter.read(args.tenant)}
        return await meter.read(None)
    finally:
        await meter.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qwen-serve usage`; returns the exit code."""
    args = _parser().parse_args(argv)
    if not args.redis_url:
        print(
            "qwen-serve usage: no Redis to read from; pass --redis-url or set QWENSERVE_REDIS_URL "
            "(without Redis, usage lives only inside the router process)",
            file=sys.stderr,
        )
        return 2
    try:
        totals = asyncio.run(_show(args))
    except UsageMeterUnavailable as exc:
        print(f"qwen-serve usage: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(totals, indent=2, sort_keys=True))
    elif not totals:
        print("no usage recorded yet")
    else:
        print(format_table(totals))
    return 0
