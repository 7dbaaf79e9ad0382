"""Per-pod discovery: which pods a stage has, what changed, and the loop that keeps them current."""

from __future__ import annotations

import asyncio
import socket

import pytest

from qwenserve.router.discovery import (
    Change,
    PodDiscovery,
    diff,
    metrics_address,
    parse_target,
    pods_of,
    system_resolver,
)


def test_diff_names_added_and_removed_pods_sorted() -> None:
    change = diff({"10.0.0.1:50053", "10.0.0.2:50053"}, {"10.0.0.3:50053", "10.0.0.2:50053", "10.0.0.0:50053"})
    assert change == Change(added=("10.0.0.0:50053", "10.0.0.3:50053"), removed=("10.0.0.1:50053",))
    assert not diff({"a"}, {"a"})


@pytest.mark.parametrize(("entry", "host", "port", "literal"), [
    ("127.0.0.1:50053", "127.0.0.1", 50053, True),
    ("[::1]:50053", "::1", 50053, True),
    ("decode.ns.svc.cluster.local:50053", "decode.ns.svc.cluster.local", 50053, False),
    ("dns:///decode:50053", "decode", 50053, False),
    ("localhost:7", "localhost", 7, False),
])
def test_entries_are_literal_pods_or_names(entry: str, host: str, port: int, literal: bool) -> None:
    target = parse_target(entry)
    assert (target.host, target.port, target.literal) == (host, port, literal)


@pytest.mark.parametrize("entry", ["decode", "decode:", ":50053", "decode:http", "decode:70000"])
def test_an_entry_without_host_and_port_is_refused_by_name(entry: str) -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        parse_target(entry)


def test_a_stage_has_its_literal_pods_and_every_address_of_its_names() -> None:
    targets = [parse_target(e) for e in ("10.0.0.9:1", "decode:2", "other:3", "[fd00::1]:4")]
    resolved = {"decode:2": ["10.0.0.1", "fd00::2"], "other:3": []}
    assert pods_of(targets, resolved) == ["10.0.0.9:1", "10.0.0.1:2", "[fd00::2]:2", "[fd00::1]:4"]
    assert pods_of([parse_target("10.0.0.1:2"), parse_target("decode:2")], resolved) == ["10.0.0.1:2", "[fd00::2]:2"]


def test_a_pods_metrics_are_its_own_entry_s_or_its_ip_at_the_name_s_metrics_port() -> None:
    entries, metrics = ["127.0.0.1:5000", "decode.ns:50053"], ["127.0.0.1:9000", "decode.ns:9090"]
    assert metrics_address("127.0.0.1:5000", entries, metrics) == "127.0.0.1:9000"
    assert metrics_address("10.1.2.3:50053", entries, metrics) == "10.1.2.3:9090"
    assert metrics_address("[fd00::3]:50053", entries, metrics) == "[fd00::3]:9090"
    assert metrics_address("10.1.2.3:50053", entries, metrics[:1]) == ""


class Table:
    """A resolver answering from a dict the test changes: a missing name is NXDOMAIN; `outage` a DNS server
    that does not answer."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.asked: list[str] = []
        self.outage = False

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if self.outage:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if host not in self.records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.records[host]


async def test_discovery_reports_each_change_and_a_name_that_cannot_be_resolved_now_keeps_its_pods() -> None:
    table = Table({"decode": ["10.0.0.1", "10.0.0.2"]})
    changes: list[tuple[str, Change]] = []
    discovery = PodDiscovery({"prefill": ["10.0.0.5:1"], "decode": ["decode:2"]},
                             lambda stage, change: changes.append((stage, change)), table)
    assert discovery.pods == {"prefill": ["10.0.0.5:1"], "decode": []}
    await discovery.refresh()
    assert changes == [("decode", Change(added=("10.0.0.1:2", "10.0.0.2:2")))]
    table.records["decode"] = ["10.0.0.2", "10.0.0.3"]
    await discovery.refresh()
    assert changes[1:] == [("decode", Change(added=("10.0.0.3:2",), removed=("10.0.0.1:2",)))]
    table.outage = True
    await discovery.refresh()
    assert len(changes) == 2 and discovery.pods["decode"] == ["10.0.0.2:2", "10.0.0.3:2"]
    assert table.asked == ["decode"] * 3  # literal entries are never resolved


async def test_a_name_that_no_longer_exists_has_no_pods() -> None:
    table = Table({"decode": ["10.0.0.1"]})
    changes: list[Change] = []
    discovery = PodDiscovery({"decode": ["decode:2"]}, lambda _, change: changes.append(change), table)
    await discovery.refresh()
    del table.records["decode"]  # a headless Service without a ready pod: NXDOMAIN
    await discovery.refresh()
    assert changes[1:] == [Change(removed=("10.0.0.1:2",))] and discovery.pods["decode"] == []


async def test_discovery_resolves_again_every_interval_until_closed() -> None:
    table = Table({"decode": ["10.0.0.1"]})
    changes: list[Change] = []
    discovery = PodDiscovery({"decode": ["decode:2"]}, lambda _, change: changes.append(change), table,
                             interval_s=0.05)
    await discovery.refresh()
    discovery.start()
    table.records["decode"] = ["10.0.0.4"]
    async with asyncio.timeout(5):
        while len(changes) < 2:
            await asyncio.sleep(0.01)
    await discovery.close()
    asked = len(table.asked)
    await asyncio.sleep(0.2)
    assert changes[1] == Change(added=("10.0.0.4:2",), removed=("10.0.0.1:2",)) and len(table.asked) == asked


async def test_the_system_resolver_resolves_localhost() -> None:
    assert "127.0.0.1" in await system_resolver("localhost", 50053)
