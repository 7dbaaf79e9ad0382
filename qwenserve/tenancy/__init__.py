"""Tenants: API keys -> tenants with limits (`keys`), and per-tenant usage metering (`usage`)."""

from qwenserve.tenancy.keys import KeyStore, Unauthenticated, bearer_token, key_digest, load_key_store
from qwenserve.tenancy.tenants import TenancyConfigError, Tenant, TenantLimits
from qwenserve.tenancy.usage import (
    InProcessUsageMeter,
    RedisUsageMeter,
    UsageMeter,
    UsageMeterUnavailable,
    UsageRecord,
)

__all__ = [
    "InProcessUsageMeter",
    "KeyStore",
    "RedisUsageMeter",
    "TenancyConfigError",
    "Tenant",
    "TenantLimits",
    "Unauthenticated",
    "UsageMeter",
    "UsageMeterUnavailable",
    "UsageRecord",
    "bearer_token",
    "key_digest",
    "load_key_store",
]
