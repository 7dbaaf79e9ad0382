"""API keys -> tenants: loading the key files and the keys given beside them, and authenticating a request.

The key file (YAML or JSON, same schema; a Kubernetes Secret mounted as a file works as is):

    # api-keys.yaml
    default_tenant: local            # optional; the tenant of --no-auth mode ("default")
    default_limits:                  # optional; limits of tenants named only in --api-keys
      requests_per_minute: 60
      tokens_per_minute: 100000
    tiers:                           # optional; a tier's priority (lower is admitted first) and limits
      paid: {priority: 0, tokens_per_minute: 500000}
      free: {priority: 2, tokens_per_minute: 20000, max_tokens: 512}
    tenants:                         # tenant id -> limits; an omitted or null limit is unlimited
      acme:
        tier: paid                   # optional: the tier's priority and limits (its own limits win)
        requests_per_minute: 600
        tokens_per_minute: 200000
        max_tokens: 4096             # cap on one request's output budget
        models: [qwen3-8b]           # optional: the models it may use (a router serving several)
        admin: false                 # optional: true lets its keys see the deployment's topology (GetStatus)
        content_filter:              # optional: never sent; a match ends the answer (content_filter)
          words: ["secret sauce"]    # whole words, any case
          patterns: ['[0-9]{3}-[0-9]{4}']  # regexes of bounded length
    keys:
      - tenant: acme
        sha256: "5e8848..."          # hex SHA-256 of the key: the file then holds no secret
        name: acme-prod              # optional label for logs
      - tenant: acme
        key: "sk-acme-dev"           # or the key itself

A directory (a Secret mounted as a volume) loads every `*.yaml`, `*.yml` and `*.json` in it,
skipping Kubernetes' hidden `..data` entries; a tenant defined twice is an error.

Beside the file, `load_key_store` takes values (the router's front door passes its flags', which fall back to
their `QWENSERVE_*` variables): more keys as "key1:tenantA,key2:tenantB" (`--api-keys`; the tenant follows the
last ':'), vLLM's single `--api-key`, `--no-auth`, and the default limits (`--default-requests-per-minute`,
`--default-tokens-per-minute`; the operator sets their variables from the QwenDeployment) for when no file
gives `default_limits`.

Only SHA-256 digests of keys are kept in memory.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from qwenserve.tenancy.content_filter import ContentFilterError, content_filter_from
from qwenserve.tenancy.tenants import (
    TenancyConfigError,
    Tenant,
    TenantLimits,
    check_tenant_id,
    parse_limits,
)

DEFAULT_TENANT = "default"
TENANT_EXTRAS = ("content_filter", "models", "tier", "priority", "admin")  # a tenant's entries besides its limits


class Unauthenticated(Exception):
    """No API key, or one that matches no tenant (HTTP 401 / gRPC UNAUTHENTICATED)."""


def key_digest(api_key: str) -> bytes:
    """SHA-256 of a key: what the key store holds and compares instead of the key."""
    return hashlib.sha256(api_key.encode("utf-8")).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The key from an `Authorization: Bearer <key>` header value (HTTP, or gRPC metadata)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass
class KeyFileContents:
    """What one key file declares, before merging."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    keys: list[tuple[bytes, str]] = field(default_factory=list)  # (sha256 digest, tenant id)
    default_tenant: str | None = None
    default_limits: TenantLimits | None = None


def parse_key_file(data: object, where: str) -> KeyFileContents:
    """Validate a decoded key file (see the module docstring for the schema)."""
    if data is None:
        return KeyFileContents()
    if not isinstance(data, Mapping):
        raise TenancyConfigError(f"{where}: expected a mapping at the top level")
    unknown = set(data) - {"tenants", "keys", "default_tenant", "default_limits", "tiers"}
    if unknown:
        raise TenancyConfigError(f"{where}: unknown field(s) {sorted(unknown)}")
    out = KeyFileContents()
    if data.get("default_tenant") is not None:
        out.default_tenant = check_tenant_id(data["default_tenant"], f"{where}: default_tenant")
    if data.get("default_limits") is not None:
        out.default_limits = parse_limits(data["default_limits"], f"{where}: default_limits")
    tiers = _tiers(data.get("tiers"), where)
    tenants = data.get("tenants") or {}
    if not isinstance(tenants, Mapping):
        raise TenancyConfigError(f"{where}: 'tenants' must map tenant ids to limits")
    for tenant_id, entry in tenants.items():
        check_tenant_id(tenant_id, f"{where}: tenants")
        here = f"{where}: tenants.{tenant_id}"
        extras = entry if isinstance(entry, Mapping) else {}
        limits = {k: v for k, v in extras.items() if k not in TENANT_EXTRAS} if isinstance(entry, Mapping) else entry
        try:
            rules = content_filter_from(extras.get("content_filter"), f"{here}.content_filter")
        except ContentFilterError as e:
            raise TenancyConfigError(str(e)) from None
        models = extras.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise TenancyConfigError(f"{here}.models: expected a list of model names")
        tier_name = extras.get("tier") or ""
        if tier_name and tier_name not in tiers:
            raise TenancyConfigError(f"{here}.tier: {tier_name!r} is not one of the tiers ({', '.join(tiers) or 'none'})")
        tier_priority, tier_limits = tiers.get(tier_name, (0, {}))
        priority = _priority(extras.get("priority", tier_priority), f"{here}.priority")
        admin = extras.get("admin", False)
        if not isinstance(admin, bool):
            raise TenancyConfigError(f"{here}.admin: expected true or false, got {admin!r}")
        own = limits if isinstance(limits, Mapping) else {}
        merged = {**tier_limits, **{k: v for k, v in own.items() if v is not None}} if tier_name else limits
        out.tenants[tenant_id] = Tenant(tenant_id, parse_limits(merged, here), rules,
                                        tuple(models) if models is not None else None, tier_name, priority, admin)
    keys = data.get("keys") or []
    if not isinstance(keys, list):
        raise TenancyConfigError(f"{where}: 'keys' must be a list")
    for i, entry in enumerate(keys):
        here = f"{where}: keys[{i}]"
        if not isinstance(entry, Mapping):
            raise TenancyConfigError(f"{here}: expected a mapping with 'tenant' and 'key' or 'sha256'")
        unknown = set(entry) - {"tenant", "key", "sha256", "name"}
        if unknown:
            raise TenancyConfigError(f"{here}: unknown field(s) {sorted(unknown)}")
        tenant_id = check_tenant_id(entry.get("tenant"), f"{here}.tenant")
        if ("key" in entry) == ("sha256" in entry):
            raise TenancyConfigError(f"{here}: give exactly one of 'key' or 'sha256'")
        if "key" in entry:
            if not isinstance(entry["key"], str) or not entry["key"]:
                raise TenancyConfigError(f"{here}.key: expected a non-empty string")
            digest = key_digest(entry["key"])
        else:
            try:
                digest = bytes.fromhex(str(entry["sha256"]))
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise TenancyConfigError(f"{here}.sha256: expected 64 hex digits")
        out.keys.append((digest, tenant_id))
    return out


def _priority(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise TenancyConfigError(f"{where}: expected an integer in [0, 100] (lower is admitted first), got {value!r}")
    return value


def _tiers(raw: object, where: str) -> dict[str, tuple[int, dict[str, object]]]:
    """Tier name -> (priority, its limits as a raw mapping the tenants' own limits are laid over)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise TenancyConfigError(f"{where}: 'tiers' must map tier names to a priority and limits")
    tiers = {}
    for name, entry in raw.items():
        here = f"{where}: tiers.{name}"
        if not isinstance(name, str) or not name or not isinstance(entry, Mapping):
            raise TenancyConfigError(f"{here}: expected a mapping of priority and limits")
        limits = {k: v for k, v in entry.items() if k != "priority"}
        parse_limits(limits, here)  # checked here, where the mistake is
        tiers[name] = (_priority(entry.get("priority", 0), f"{here}.priority"), limits)
    return tiers


def parse_api_keys(value: str) -> list[tuple[str, str]]:
    """("key", "tenant") pairs from "key1:tenantA,key2:tenantB" (keys may contain ':')."""
    pairs = []
    for i, item in enumerate(part.strip() for part in value.split(",")):
        if not item:
            continue
        key, sep, tenant_id = item.rpartition(":")
        if not sep or not key:
            raise TenancyConfigError(f"--api-keys (QWENSERVE_API_KEYS) item {i + 1}: expected 'key:tenant'")
        pairs.append((key, check_tenant_id(tenant_id, f"--api-keys (QWENSERVE_API_KEYS) item {i + 1}")))
    return pairs


def read_key_files(path: str | Path) -> list[KeyFileContents]:
    """Parse a key file, or each key file in a directory (a mounted Kubernetes Secret)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p
            for p in path.iterdir()
            if not p.name.startswith(".") and p.suffix in (".yaml", ".yml", ".json") and p.is_file()
        )
        if not files:
            raise TenancyConfigError(f"{path}: no *.yaml, *.yml or *.json key files in this directory")
    elif path.is_file():
        files = [path]
    else:
        raise TenancyConfigError(f"{path}: API key file not found")
    contents = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TenancyConfigError(f"{file}: cannot read it as UTF-8 text ({exc})") from exc
        try:
            data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise TenancyConfigError(f"{file}: not valid {file.suffix.lstrip('.').upper()}: {_one_line(exc)}") from exc
        contents.append(parse_key_file(data, str(file)))
    return contents


def _one_line(exc: Exception) -> str:
    """A parser's error without the excerpt YAML quotes over several lines: the problem and where."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


class KeyStore:
    """Maps API keys to tenants, holding only key digests."""

    def __init__(
        self,
        tenants: Iterable[Tenant],
        keys: Iterable[tuple[bytes, str]],
        *,
        no_auth: bool = False,
        default_tenant: str = DEFAULT_TENANT,
    ) -> None:
        self._tenants = {t.id: t for t in tenants}
        # Indexed by the first 8 bytes of the digest; the full digest is compared in constant time.
        self._by_prefix: dict[bytes, list[tuple[bytes, Tenant]]] = {}
        self._count = 0
        for digest, tenant_id in keys:
            if tenant_id not in self._tenants:
                raise TenancyConfigError(f"an API key names tenant {tenant_id!r}, which is not defined")
            bucket = self._by_prefix.setdefault(digest[:8], [])
            previous = next((t for d, t in bucket if d == digest), None)
            if previous is not None:
                if previous.id != tenant_id:
                    raise TenancyConfigError(
                        f"one API key is given to two tenants ({previous.id!r} and {tenant_id!r})"
                    )
                continue
            bucket.append((digest, self._tenants[tenant_id]))
            self._count += 1
        self.no_auth = no_auth
        self.default_tenant = self._tenants.get(default_tenant) or Tenant(default_tenant)

    def authenticate(self, api_key: str | None) -> Tenant:
        """The tenant of `api_key`; raises `Unauthenticated` when it is missing or unknown.

        In no-auth mode every request, with or without a key, belongs to the default tenant.
        """
        if self.no_auth:
            return self.default_tenant
        if not api_key:
            raise Unauthenticated(
                "missing API key: send 'Authorization: Bearer <key>' (gRPC: 'authorization' metadata)"
            )
        digest = key_digest(api_key)
        # Timing can reveal at most which 8-byte digest prefix exists, and an attacker cannot choose
        # keys by digest prefix; the secret-dependent part, the full digest, is compared in constant time.
        tenant = None
        for stored, candidate in self._by_prefix.get(digest[:8], ()):
            if hmac.compare_digest(stored, digest):
                tenant = candidate
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant

    def is_admin(self, tenant: Tenant) -> bool:
        """Whether `tenant`'s callers may see operator-only details (the workers' addresses in GetStatus): an
        `admin: true` tenant, or anyone when auth is off, since then the caller is the machine's operator."""
        return self.no_auth or tenant.admin

    def tenant(self, tenant_id: str) -> Tenant:
        """A tenant by id (KeyError when unknown)."""
        if tenant_id == self.default_tenant.id:
            return self._tenants.get(tenant_id, self.default_tenant)
        return self._tenants[tenant_id]

    @property
    def tenants(self) -> list[Tenant]:
        """All configured tenants."""
        return list(self._tenants.values())

    def __len__(self) -> int:
        """Number of API keys."""
        return self._count


def load_key_store(
    path: str | Path | None = None,
    *,
    api_keys: str = "",
    api_key: str | None = None,
    no_auth: bool = False,
    default_limits: TenantLimits | None = None,
) -> KeyStore:
    """Build the key store from a key file/directory and the keys given beside it (see the module docstring).

    `api_keys` is "key1:tenantA,key2:tenantB"; `api_key` is one more key, of the default tenant (vLLM's single
    `--api-key`); `default_limits` are the limits of tenants nothing else limits (a key file's `default_limits`
    win). Raises `TenancyConfigError` with the file and field at fault.
    """
    parts = read_key_files(path) if path is not None else []
    tenants: dict[str, Tenant] = {}
    keys: list[tuple[bytes, str]] = []
    default_tenant, default_limits = DEFAULT_TENANT, default_limits or TenantLimits()
    for part in parts:
        for tenant_id, tenant in part.tenants.items():
            if tenant_id in tenants and tenants[tenant_id] != tenant:
                raise TenancyConfigError(f"tenant {tenant_id!r} is defined twice with different limits")
            tenants[tenant_id] = tenant
        keys.extend(part.keys)
        default_tenant = part.default_tenant or default_tenant
        default_limits = part.default_limits or default_limits
    for key, tenant_id in parse_api_keys(api_keys):
        tenants.setdefault(tenant_id, Tenant(tenant_id, default_limits))
        keys.append((key_digest(key), tenant_id))
    if api_key:
        keys.append((key_digest(api_key), default_tenant))
    if not keys and not no_auth:
        raise TenancyConfigError(
            "no API keys configured: give --api-key, --api-keys or --api-keys-file (or set QWENSERVE_API_KEY, "
            "QWENSERVE_API_KEYS or QWENSERVE_API_KEYS_FILE), or run with --no-auth"
        )
    tenants.setdefault(default_tenant, Tenant(default_tenant, default_limits))
    return KeyStore(tenants.values(), keys, no_auth=no_auth, default_tenant=default_tenant)
