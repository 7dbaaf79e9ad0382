"""Default tenant limits from the environment (what the operator sets from a QwenDeployment)."""

from __future__ import annotations

import pytest

from qwenserve.tenancy import load_key_store
from qwenserve.tenancy.tenants import TenancyConfigError


def test_default_limits_come_from_the_environment_in_no_auth_mode() -> None:
    store = load_key_store(no_auth=True, env={"QWENSERVE_DEFAULT_REQUESTS_PER_MINUTE": "30",
                                              "QWENSERVE_DEFAULT_TOKENS_PER_MINUTE": "5000"})
    tenant = store.authenticate(None)
    assert (tenant.limits.requests_per_minute, tenant.limits.tokens_per_minute) == (30, 5000)


def test_unset_default_limits_mean_unlimited() -> None:
    tenant = load_key_store(no_auth=True, env={}).authenticate(None)
    assert tenant.limits.requests_per_minute is None and tenant.limits.tokens_per_minute is None


def test_a_bad_default_limit_is_a_clear_error() -> None:
    with pytest.raises(TenancyConfigError, match="tokens_per_minute"):
        load_key_store(no_auth=True, env={"QWENSERVE_DEFAULT_TOKENS_PER_MINUTE": "lots"})
