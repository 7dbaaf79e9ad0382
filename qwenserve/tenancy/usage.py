"""Usage metering: per-tenant counters of requests, prompt, cached prompt, completion and reasoning tokens, in
total and per model (what `pricing.py` bills).

Redis layout: one hash per tenant, `<prefix>:{<tenant>}` with the fields of `USAGE_FIELDS` (the totals) and
`model:<model>:<field>` (the same per model), and a set `<prefix>:tenants` of the tenants seen. These are billing totals, so they never expire;
they grow with the number of tenants, not requests. One `record()` is one round trip (a
MULTI/EXEC pipeline of HINCRBYs, so a request's counters always move together).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from qwenserve.tenancy.tenants import Tenant

log = logging.getLogger(__name__)

USAGE_FIELDS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "reasoning_tokens")
MODEL_FIELD_PREFIX = "model:"

TENANT_REQUESTS = Counter("qwenserve_tenant_requests_total", "Finished requests per tenant.", ["tenant"])
TENANT_TOKENS = Counter(
    "qwenserve_tenant_tokens_total",
    "Tokens per tenant: prompt (all prompt tokens), cached_prompt (of which served from the prefix cache), "
    "completion, reasoning (of which spent thinking).",
    ["tenant", "kind"],
)
METERING_ERRORS = Counter(
    "qwenserve_usage_metering_errors_total",
    "Usage records that could not be written to the backend.",
    ["backend"],
)


class UsageMeterUnavailable(Exception):
    """The usage backend (Redis) could not be reached; the usage of this request is not recorded."""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one finished request consumed (the terminal event's usage)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # part of prompt_tokens served from the prefix cache
    requests: int = 1
    reasoning_tokens: int = 0  # part of completion_tokens spent thinking
    model: str = ""  # the model that answered; "" when not known (billed at the default prices)

    def __post_init__(self) -> None:
        for name in USAGE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"UsageRecord.{name} must be a non-negative int, got {value!r}")
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError("UsageRecord.cached_prompt_tokens cannot exceed prompt_tokens")
        if self.reasoning_tokens > self.completion_tokens:
            raise ValueError("UsageRecord.reasoning_tokens cannot exceed completion_tokens")

    def as_dict(self) -> dict[str, int]:
        """The counters as a dict with the names of `USAGE_FIELDS`."""
        return {name: getattr(self, name) for name in USAGE_FIELDS}


def _tenant_id(tenant: Tenant | str) -> str:
    return tenant if isinstance(tenant, str) else tenant.id


def _observe(tenant_id: str, usage: UsageRecord) -> None:
    TENANT_REQUESTS.labels(tenant_id).inc(usage.requests)
    TENANT_TOKENS.labels(tenant_id, "prompt").inc(usage.prompt_tokens)
    TENANT_TOKENS.labels(tenant_id, "cached_prompt").inc(usage.cached_prompt_tokens)
    TENANT_TOKENS.labels(tenant_id, "completion").inc(usage.completion_tokens)
    TENANT_TOKENS.labels(tenant_id, "reasoning").inc(usage.reasoning_tokens)


class UsageMeter(ABC):
    """Per-tenant usage totals."""

    @abstractmethod
    async def record(self, tenant: Tenant | str, usage: UsageRecord) -> None:
        """Add one request's usage to the tenant's totals (and the Prometheus counters)."""

    @abstractmethod
    async def read(self, tenant: Tenant | str | None = None) -> dict:
        """One tenant's totals `{field: int}`, or with None every tenant's `{tenant_id: {field: int}}`."""

    @abstractmethod
    async def read_by_model(self, tenant: Tenant | str) -> dict[str, dict[str, int]]:
        """One tenant's usage per model `{model: {field: int}}`; usage recorded without a model is under ""."""

    async def close(self) -> None:
        """Release connections. The in-process meter holds none."""
        return None


class InProcessUsageMeter(UsageMeter):
    """Totals in a dict: for a single router without Redis (lost on restart)."""

    def __init__(self) -> None:
        self._totals: dict[str, dict[str, int]] = {}
        self._by_model: dict[str, dict[str, dict[str, int]]] = {}
        self._lock = threading.Lock()

    async def record(self, tenant: Tenant | str, usage: UsageRecord) -> None:
        """See `UsageMeter.record`."""
        tenant_id = _tenant_id(tenant)
        with self._lock:
            totals = self._totals.setdefault(tenant_id, dict.fromkeys(USAGE_FIELDS, 0))
            models = self._by_model.setdefault(tenant_id, {})
            per_model = models.setdefault(usage.model, dict.fromkeys(USAGE_FIELDS, 0))
            for name, value in usage.as_dict().items():
                totals[name] += value
                per_model[name] += value
        _observe(tenant_id, usage)

    async def read_by_model(self, tenant: Tenant | str) -> dict[str, dict[str, int]]:
        """See `UsageMeter.read_by_model`."""
        with self._lock:
            return {model: dict(c) for model, c in self._by_model.get(_tenant_id(tenant), {}).items()}

    async def read(self, tenant: Tenant | str | None = None) -> dict:
        """See `UsageMeter.read`."""
        with self._lock:
            if tenant is None:
                return {tid: dict(totals) for tid, totals in self._totals.items()}
            return dict(self._totals.get(_tenant_id(tenant), dict.fromkeys(USAGE_FIELDS, 0)))


class RedisUsageMeter(UsageMeter):
    """Totals in Redis, shared by every router replica and readable by `qwen-serve usage show`."""

    def __init__(self, client: Redis, *, key_prefix: str = "qwenserve:usage") -> None:
        self._client = client
        self._prefix = key_prefix

    def _key(self, tenant_id: str) -> str:
        return f"{self._prefix}:{{{tenant_id}}}"

    async def record(self, tenant: Tenant | str, usage: UsageRecord) -> None:
        """See `UsageMeter.record`. Raises `UsageMeterUnavailable` when Redis fails."""
        tenant_id = _tenant_id(tenant)
        key = self._key(tenant_id)
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                for name, value in usage.as_dict().items():
                    if value:
                        pipe.hincrby(key, name, value)
                        pipe.hincrby(key, f"{MODEL_FIELD_PREFIX}{usage.model}:{name}", value)
                pipe.sadd(f"{self._prefix}:tenants", tenant_id)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            METERING_ERRORS.labels("redis").inc()
            log.warning("usage metering: could not record %s for tenant %r: %s", usage, tenant_id, exc)
            raise UsageMeterUnavailable(f"could not record usage of tenant {tenant_id!r}: {exc}") from exc
        _observe(tenant_id, usage)

    async def read(self, tenant: Tenant | str | None = None) -> dict:
        """See `UsageMeter.read`. Raises `UsageMeterUnavailable` when Redis fails."""
        try:
            if tenant is not None:
                return _decode(await self._client.hgetall(self._key(_tenant_id(tenant))))
            tenant_ids = sorted(
                m.decode() if isinstance(m, bytes) else m
                for m in await self._client.smembers(f"{self._prefix}:tenants")
            )
            async with self._client.pipeline(transaction=False) as pipe:
                for tenant_id in tenant_ids:
                    pipe.hgetall(self._key(tenant_id))
                rows = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            raise UsageMeterUnavailable(f"could not read usage: {exc}") from exc
        return {tenant_id: _decode(row) for tenant_id, row in zip(tenant_ids, rows, strict=True)}

    async def read_by_model(self, tenant: Tenant | str) -> dict[str, dict[str, int]]:
        """See `UsageMeter.read_by_model`. Raises `UsageMeterUnavailable` when Redis fails."""
        try:
            row = await self._client.hgetall(self._key(_tenant_id(tenant)))
        except (RedisError, OSError, TimeoutError) as exc:
            raise UsageMeterUnavailable(f"could not read usage: {exc}") from exc
        models: dict[str, dict[str, int]] = {}
        for name, value in row.items():
            name = name.decode() if isinstance(name, bytes) else name
            if name.startswith(MODEL_FIELD_PREFIX):
                model, _, counter = name[len(MODEL_FIELD_PREFIX):].rpartition(":")
                if counter in USAGE_FIELDS:
                    models.setdefault(model, dict.fromkeys(USAGE_FIELDS, 0))[counter] = int(value)
        return models

    async def close(self) -> None:
        """Close the Redis client."""
        await self._client.aclose()


def _decode(row: dict) -> dict[str, int]:
    totals = dict.fromkeys(USAGE_FIELDS, 0)
    for name, value in row.items():
        name = name.decode() if isinstance(name, bytes) else name
        if name in totals:
            totals[name] = int(value)
    return totals
