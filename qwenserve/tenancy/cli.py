"""`qwen-serve usage show [--redis-url URL] [--tenant ID] [--by-model] [--prices FILE] [--json]`: the metered
totals per tenant (or per tenant and model), and with a price list the billed units (`pricing.py`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from qwenserve.flags import StrictParser
from qwenserve.ratelimit.redis_client import connect
from qwenserve.tenancy.pricing import PriceList, PriceListError, load_price_list
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
    show.add_argument("--by-model", action="store_true", help="a row per tenant and model")
    show.add_argument("--prices", metavar="FILE",
                      help="a price list (YAML: default and per-model units per token): adds billed_units")
    show.add_argument("--key-prefix", default="qwenserve:usage", help=argparse.SUPPRESS)
    show.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for Redis (default 2)")
    return parser


def format_table(totals: dict[str, dict[str, float]]) -> str:
    """A fixed-width table: one row per tenant (or "tenant/model"), one column per counter (and billed units)."""
    columns = [f for f in (*USAGE_FIELDS, "billed_units") if any(f in row for row in totals.values())]
    header = ("tenant", *columns)
    rows = [(tenant_id, *(_cell(row[f]) for f in columns)) for tenant_id, row in sorted(totals.items())]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in (header, *rows)
    ]
    return "\n".join(lines)


def _attributed(totals: dict[str, int], models: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per-model usage, with what no model accounts for (recorded before usage had a model) under ""."""
    rest = {f: totals[f] - sum(m[f] for m in models.values()) for f in USAGE_FIELDS}
    if any(v > 0 for v in rest.values()):
        unnamed = models.get("", dict.fromkeys(USAGE_FIELDS, 0))
        models = {**models, "": {f: unnamed[f] + max(0, rest[f]) for f in USAGE_FIELDS}}
    return models


def _cell(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.4f}"


async def _show(args: argparse.Namespace, prices: PriceList | None) -> dict[str, dict]:
    """{tenant: counts} (with billed_units and, as JSON, models), or {"tenant/model": counts} with --by-model."""
    meter = RedisUsageMeter(
        connect(args.redis_url, timeout_s=args.timeout, max_connections=2), key_prefix=args.key_prefix
    )
    try:
        totals = {args.tenant: await meter.read(args.tenant)} if args.tenant else await meter.read(None)
        if prices is None and not args.by_model:
            return totals
        by_model = {tenant: _attributed(counts, await meter.read_by_model(tenant)) for tenant, counts in totals.items()}
    finally:
        await meter.close()
    if args.by_model:
        rows: dict[str, dict] = {}
        for tenant, models in by_model.items():
            for model, counts in models.items():
                billed = {} if prices is None else {"billed_units": prices.for_model(model).billed(counts)}
                rows[f"{tenant}/{model or '-'}"] = {**counts, **billed}
        return rows
    assert prices is not None
    return {tenant: {**counts, "billed_units": prices.billed(by_model[tenant])} for tenant, counts in totals.items()}


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
        prices = load_price_list(args.prices) if args.prices else None
        totals = asyncio.run(_show(args, prices))
    except PriceListError as exc:
        print(f"qwen-serve usage: {exc}", file=sys.stderr)
        return 2
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
