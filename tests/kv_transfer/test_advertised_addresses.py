"""Prefill hands out addresses other processes can dial: --advertise-host, never a wildcard bind address."""

from __future__ import annotations

import pytest

from qwenserve import addresses
from qwenserve.addresses import endpoint_host, endpoint_of, is_wildcard_host
from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVTransport
from qwenserve.preflight import StartupError
from qwenserve.stages import prefill as prefill_config


@pytest.mark.parametrize(("host", "wildcard"), [
    ("0.0.0.0", True), ("::", True), ("[::]", True), ("", True), ("0:0:0:0:0:0:0:0", True),
    ("10.1.2.3", False), ("::1", False), ("prefill-0.example", False), ("127.0.0.1", False),
])
def test_wildcards_are_the_unspecified_addresses(host: str, wildcard: bool) -> None:
    assert is_wildcard_host(host) is wildcard


def test_endpoints_bracket_ipv6_and_give_their_host_back() -> None:
    assert endpoint_of("fd00::7", 50052) == "[fd00::7]:50052" and endpoint_host("[fd00::7]:50052") == "fd00::7"
    assert endpoint_of("10.0.0.5", 1) == "10.0.0.5:1" and endpoint_host("10.0.0.5:1") == "10.0.0.5"


def test_the_advertised_host_is_the_flag_else_a_dialable_bind_address_else_the_primary_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert addresses.advertise_host("0.0.0.0", "10.9.8.7") == "10.9.8.7"
    assert addresses.advertise_host("127.0.0.1") == "127.0.0.1"
    monkeypatch.setattr(addresses, "primary_address", lambda family: "10.1.1.1")
    assert addresses.advertise_host("0.0.0.0") == "10.1.1.1"
    monkeypatch.setattr(addresses, "primary_address", lambda family: None)  # no default route (a bare netns)
    with pytest.raises(StartupError, match="set --advertise-host"):
        addresses.advertise_host("0.0.0.0")


def test_the_primary_address_is_never_a_wildcard() -> None:
    address = addresses.primary_address()
    assert address is None or not is_wildcard_host(address)


def test_advertise_host_comes_from_its_variable_and_a_wildcard_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("QWENSERVE_ADVERTISE_HOST", "10.2.3.4")  # a pod's status.podIP, via the downward API
    assert prefill_config.parse_config(["--host", "0.0.0.0"]).advertise_host == "10.2.3.4"
    with pytest.raises(SystemExit) as refused:
        prefill_config.parse_config(["--advertise-host", "0.0.0.0"])
    assert refused.value.code == 2
    assert "--advertise-host 0.0.0.0 is a wildcard address" in capsys.readouterr().err


@pytest.mark.parametrize("config", [
    ExporterConfig(transport=KVTransport.KV_TRANSPORT_GRPC, control_endpoint="0.0.0.0:50052", use_shm=False),
    ExporterConfig(transport=KVTransport.KV_TRANSPORT_SHM, control_endpoint="[::]:50052"),
    ExporterConfig(transport=KVTransport.KV_TRANSPORT_MOONCAKE, control_endpoint="10.0.0.1:50052",
                   mooncake_host="0.0.0.0", use_shm=False),
])
def test_the_exporter_refuses_to_advertise_a_wildcard(config: ExporterConfig) -> None:
    with pytest.raises(ValueError, match="wildcard address"):
        KVExporter(config)
