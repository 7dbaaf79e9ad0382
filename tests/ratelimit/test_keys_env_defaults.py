"""The router's key settings from its QWENSERVE_* variables (what the operator sets from a QwenDeployment): the
variables become flag values, and the front door hands those values to the key store."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwenserve.router.front_door import FrontConfig, load_front_keys
from qwenserve.stages.router import parse_config
from qwenserve.tenancy import TenantLimits, load_key_store
from qwenserve.tenancy.tenants import TenancyConfigError

WORKERS = ["--decode", "127.0.0.1:1"]


def test_default_limits_come_from_the_variables_in_no_auth_mode() -> None:
    config = parse_config(WORKERS, environ={"QWENSERVE_NO_AUTH": "1", "QWENSERVE_DEFAULT_REQUESTS_PER_MINUTE": "30",
                                            "QWENSERVE_DEFAULT_TOKENS_PER_MINUTE": "5000"})
    tenant = load_front_keys(config.front).authenticate(None)
    assert (tenant.limits.requests_per_minute, tenant.limits.tokens_per_minute) == (30, 5000)


def test_unset_default_limits_mean_unlimited() -> None:
    assert load_key_store(no_auth=True).authenticate(None).limits == TenantLimits()
    assert load_front_keys(FrontConfig(no_auth=True)).authenticate(None).limits == TenantLimits()


def test_a_bad_default_limit_variable_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(WORKERS, environ={"QWENSERVE_NO_AUTH": "1", "QWENSERVE_DEFAULT_TOKENS_PER_MINUTE": "lots"})
    assert exit_info.value.code == 2
    assert "QWENSERVE_DEFAULT_TOKENS_PER_MINUTE='lots' is not a valid int" in capsys.readouterr().err


@pytest.mark.parametrize("limit", [0, -5])
def test_a_default_limit_below_one_is_a_clear_error(limit: int) -> None:
    with pytest.raises(TenancyConfigError, match=f"--default-tokens-per-minute {limit}: give a positive limit"):
        load_front_keys(FrontConfig(no_auth=True, default_tokens_per_minute=limit))


def test_the_keys_file_and_listed_keys_come_from_their_variables(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("tenants: {acme: {requests_per_minute: 5}}\nkeys: [{tenant: acme, key: sk-file}]\n")
    config = parse_config(WORKERS, environ={"QWENSERVE_API_KEYS_FILE": str(keys_file),
                                            "QWENSERVE_API_KEYS": "sk-listed:newco",
                                            "QWENSERVE_DEFAULT_REQUESTS_PER_MINUTE": "7"})
    store = load_front_keys(config.front)
    assert store.authenticate("sk-file").limits.requests_per_minute == 5
    assert store.authenticate("sk-listed").limits.requests_per_minute == 7  # newco: not in the file
    assert not store.no_auth
