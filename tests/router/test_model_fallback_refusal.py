"""ModelRoutes.choose: a model that cannot serve hands its request to its fallback, and a tenant not allowed
that fallback gets a 403 naming it rather than the primary's 503."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from qwenserve.router.errors import ModelNotAllowed
from qwenserve.router.models import ModelEntry, ModelRoutes


@dataclass
class _Fleet:
    serving: bool

    def can_serve(self) -> bool:
        return self.serving


@dataclass
class _Router:
    fleet: _Fleet


def _routes(primary_serving: bool, fallback_serving: bool = True) -> ModelRoutes:
    routers = {"primary": _Router(_Fleet(primary_serving)), "backup": _Router(_Fleet(fallback_serving))}
    entries = {"primary": ModelEntry("primary", "t:1", ("d:1",), fallback="backup"),
               "backup": ModelEntry("backup", "t:2", ("d:2",))}
    return ModelRoutes(routers, "primary", entries)


def test_a_primary_without_decode_workers_falls_back_for_a_tenant_allowed_both() -> None:
    assert _routes(primary_serving=False).choose("primary", ["primary", "backup"])[0] == "backup"


def test_a_tenant_not_allowed_the_fallback_is_refused_naming_it() -> None:
    with pytest.raises(ModelNotAllowed, match="'backup'|backup") as refused:
        _routes(primary_serving=False).choose("primary", ["primary"])
    assert "primary" in str(refused.value)


def test_the_primary_answers_when_it_can_or_when_no_fallback_could() -> None:
    assert _routes(primary_serving=True).choose("primary", ["primary"])[0] == "primary"
    assert _routes(primary_serving=False, fallback_serving=False).choose("primary", ["primary"])[0] == "primary"
