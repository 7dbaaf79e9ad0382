"""API keys -> tenants: file formats, keys listed beside the file, authentication, no-auth mode."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from qwenserve.tenancy import (
    TenancyConfigError,
    Tenant,
    TenantLimits,
    Unauthenticated,
    bearer_token,
    load_key_store,
)

KEY_FILE = """
default_tenant: local
default_limits:
  requests_per_minute: 10
tenants:
  acme:
    requests_per_minute: 600
    tokens_per_minute: 200000
    max_tokens: 4096
  globex: {}
keys:
  - tenant: acme
    sha256: "{digest}"
    name: acme-prod
  - tenant: globex
    key: "sk-globex-dev"
"""


def write_key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys.yaml"
    path.write_text(KEY_FILE.replace("{digest}", hashlib.sha256(b"sk-acme-prod").hexdigest()))
    return path


def test_keys_from_a_yaml_file_map_to_tenants_with_their_limits(tmp_path: Path) -> None:
    store = load_key_store(write_key_file(tmp_path))
    acme = store.authenticate("sk-acme-prod")
    assert acme == Tenant("acme", TenantLimits(600, 200000, 4096))
    assert store.authenticate("sk-globex-dev") == Tenant("globex", TenantLimits())
    assert len(store) == 2


def test_missing_or_wrong_key_is_unauthenticated(tmp_path: Path) -> None:
    store = load_key_store(write_key_file(tmp_path))
    for missing in (None, ""):
        with pytest.raises(Unauthenticated, match="missing API key"):
            store.authenticate(missing)
    for wrong in (
        "sk-acme-prodX",
        "sk-acme-pro",
        "SK-ACME-PROD",
        hashlib.sha256(b"sk-acme-prod").hexdigest(),
    ):
        with pytest.raises(Unauthenticated, match="invalid API key"):
            store.authenticate(wrong)


def test_only_digests_of_keys_are_kept_in_memory(tmp_path: Path) -> None:
    store = load_key_store(write_key_file(tmp_path), api_keys="sk-listed-secret:acme")
    assert store.authenticate("sk-listed-secret").id == "acme"
    held = repr(vars(store))
    assert "sk-globex-dev" not in held and "sk-listed-secret" not in held


def test_listed_keys_join_the_file_and_unknown_tenants_get_default_limits(tmp_path: Path) -> None:
    store = load_key_store(write_key_file(tmp_path), api_keys="k:1:acme, k2:newco")
    assert store.authenticate("k:1").id == "acme"  # a key may contain ':'; the tenant follows the last one
    assert store.authenticate("k2") == Tenant("newco", TenantLimits(requests_per_minute=10))


def test_json_file_and_secret_directory_load_the_same_schema(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    (secret / "..2024_01_01").mkdir(parents=True)  # Kubernetes' hidden timestamped dir is skipped
    (secret / "..2024_01_01" / "junk.yaml").write_text("not: [valid")
    (secret / "api-keys.json").write_text(
        json.dumps(
            {
                "tenants": {"acme": {"tokens_per_minute": 1000}},
                "keys": [{"tenant": "acme", "key": "sk-json"}],
            }
        )
    )
    store = load_key_store(secret)
    assert store.authenticate("sk-json") == Tenant("acme", TenantLimits(tokens_per_minute=1000))


def test_no_auth_mode_maps_everything_to_the_default_tenant(tmp_path: Path) -> None:
    store = load_key_store(write_key_file(tmp_path), no_auth=True)
    assert store.authenticate(None).id == "local"
    assert store.authenticate("whatever").id == "local"
    assert store.authenticate("sk-globex-dev").id == "local"
    bare = load_key_store(no_auth=True)
    assert bare.authenticate(None) == Tenant("default", TenantLimits())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants: {acme: {tokens_per_minute: -1}}\nkeys: []", "tokens_per_minute"),
        ("tenants: {acme: {tpm: 5}}", "unknown field"),
        ("keys: [{tenant: ghost, key: k}]", "'ghost', which is not defined"),
        ("tenants: {acme: {}}\nkeys: [{tenant: acme}]", "exactly one of 'key' or 'sha256'"),
        ("tenants: {acme: {}}\nkeys: [{tenant: acme, sha256: abc}]", "64 hex digits"),
        ("tenants: {'bad tenant': {}}", "invalid tenant id"),
        ("tenants: {a: {}, b: {}}\nkeys: [{tenant: a, key: k}, {tenant: b, key: k}]", "two tenants"),
        ("keys: [oops", "not valid YAML"),
        ("tenants: {ops: {admin: 'yes'}}", "admin: expected true or false"),
    ],
)
def test_malformed_key_files_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(TenancyConfigError, match=message):
        load_key_store(path)


def test_auth_without_any_key_configured_is_a_config_error() -> None:
    with pytest.raises(TenancyConfigError, match="no API keys configured"):
        load_key_store()
    with pytest.raises(TenancyConfigError, match="expected 'key:tenant'"):
        load_key_store(api_keys="justakey")


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer sk-123") == "sk-123"
    assert bearer_token("bearer   sk-123 ") == "sk-123"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


def test_tiers_give_their_tenants_a_priority_and_limits_that_the_tenants_own_refine() -> None:
    from qwenserve.tenancy.keys import parse_key_file

    data = {"tiers": {"paid": {"priority": 0, "tokens_per_minute": 5000},
                      "free": {"priority": 3, "tokens_per_minute": 100, "max_tokens": 64}},
            "tenants": {"acme": {"tier": "paid", "requests_per_minute": 10},
                        "student": {"tier": "free", "max_tokens": 32},
                        "vip": {"tier": "free", "priority": 1},
                        "plain": None}}
    tenants = parse_key_file(data, "keys.yaml").tenants
    assert (tenants["acme"].priority, tenants["acme"].limits.tokens_per_minute,
            tenants["acme"].limits.requests_per_minute) == (0, 5000, 10)
    assert (tenants["student"].tier, tenants["student"].priority, tenants["student"].limits.max_tokens,
            tenants["student"].limits.tokens_per_minute) == ("free", 3, 32, 100)
    assert tenants["vip"].priority == 1 and tenants["plain"].priority == 0 and tenants["plain"].tier == ""
    for bad, where in (({"tenants": {"a": {"tier": "gold"}}}, "tenants.a.tier"),
                       ({"tiers": {"x": {"priority": -1}}}, "tiers.x.priority"),
                       ({"tiers": {"x": {"tokens_per_minute": 0}}}, "tiers.x.tokens_per_minute")):
        with pytest.raises(TenancyConfigError, match=where.replace(".", r"\.")):
            parse_key_file(bad, "keys.yaml")


def test_only_a_tenant_marked_admin_is_an_admin_unless_auth_is_off(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {ops: {admin: true}, acme: {}}\n"
                    "keys: [{tenant: ops, key: sk-ops}, {tenant: acme, key: sk-acme}]\n")
    store = load_key_store(path)
    assert store.is_admin(store.authenticate("sk-ops"))
    assert not store.is_admin(store.authenticate("sk-acme"))
    assert load_key_store(path, no_auth=True).is_admin(Tenant("default"))  # the caller is the machine's operator
