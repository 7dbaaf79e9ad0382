"""Flags: environment fallbacks and switches whose names start with --no-."""

from __future__ import annotations

import argparse

import pytest

from qwenserve.flags import add_flag, address_list, env_name


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flag(parser, "--no-auth", type=bool, default=False)
    add_flag(parser, "--warm", type=bool, default=True)
    add_flag(parser, "--kv-cache-gb", type=float, default=1.0)
    return parser


def test_a_negative_switch_turns_on_when_given() -> None:
    assert _parser().parse_args(["--no-auth"]).no_auth is True
    assert _parser().parse_args([]).no_auth is False


def test_positive_switches_can_be_turned_off() -> None:
    assert _parser().parse_args(["--no-warm"]).warm is False


def test_environment_is_the_fallback_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_name("--kv-cache-gb"), "0.5")
    monkeypatch.setenv("QWENSERVE_NO_AUTH", "true")
    assert _parser().parse_args([]).kv_cache_gb == 0.5
    assert _parser().parse_args([]).no_auth is True
    assert _parser().parse_args(["--kv-cache-gb", "2"]).kv_cache_gb == 2.0


def test_address_lists() -> None:
    assert address_list(" a:1, b:2 ,") == ["a:1", "b:2"]
    assert address_list("") == []
