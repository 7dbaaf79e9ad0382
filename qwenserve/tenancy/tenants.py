"""Tenants and their limits."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from qwenserve.tenancy.content_filter import ContentFilter

TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_tokens")


class TenancyConfigError(ValueError):
    """The API-key file or the key settings are malformed; the message says where."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Limits of one tenant; `None` means unlimited.

    The rate limiter applies `requests_per_minute` and `tokens_per_minute` per window, which is a
    minute unless the window is configured shorter (tests). `max_tokens` caps one request's output
    budget; the router clamps or rejects above it.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who pays for a request: the unit of limits and usage metering."""

    id: str
    limits: TenantLimits = TenantLimits()
    # Words and patterns its answers must never contain (tenancy/content_filter.py); None: no filter.
    content_filter: ContentFilter | None = None
    # The models it may use, on a router serving several (router/models.py); None: any.
    models: tuple[str, ...] | None = None
    # Its tier (key file `tiers:`) and admission priority: lower is admitted first by the engines, and a
    # waiting request's priority improves with time (engine/admission_policy.py), so no tier starves.
    tier: str = ""
    priority: int = 0
    # May its keys see the deployment's topology (GetStatus's worker addresses)? Key file `admin: true`.
    admin: bool = False


def parse_limits(raw: object, where: str) -> TenantLimits:
    """TenantLimits from a mapping such as `{"requests_per_minute": 60, "tokens_per_minute": 1e5}`."""
    if raw is None:
        return TenantLimits()
    if not isinstance(raw, Mapping):
        raise TenancyConfigError(f"{where}: expected a mapping of limits, got {type(raw).__name__}")
    unknown = set(raw) - set(LIMIT_FIELDS)
    if unknown:
        raise TenancyConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {list(LIMIT_FIELDS)}")
    values: dict[str, int | None] = {}
    for name in LIMIT_FIELDS:
        value = raw.get(name)
        if value is None:
            values[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
            raise TenancyConfigError(f"{where}.{name}: expected a positive integer or null, got {value!r}")
        values[name] = int(value)
    return TenantLimits(**values)


def check_tenant_id(tenant_id: object, where: str) -> str:
    """A tenant id is 1-64 characters of letters, digits, '_', '.', '-' (safe in Redis keys and labels)."""
    if not isinstance(tenant_id, str) or not TENANT_ID.match(tenant_id):
        raise TenancyConfigError(
            f"{where}: invalid tenant id {tenant_id!r} (1-64 of letters, digits, '_', '.', '-')"
        )
    return tenant_id
