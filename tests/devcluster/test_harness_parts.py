"""The dev-cluster's parts without a cluster: container paths and $(VAR) expansion, Service DNS, leftovers, the API
server's bounded request log."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import aiohttp
import kmock
import pytest
from dnslib import QTYPE, RCODE, DNSRecord

from qwenserve_devcluster.api import ApiServer, declare_resources
from qwenserve_devcluster.container import expand, translate
from qwenserve_devcluster.dns import ClusterDNS, resolv_conf
from qwenserve_devcluster.network import leftovers, remove_leftovers


def test_paths_under_a_mounted_or_image_folder_are_rewritten_to_their_host_folder():
    paths = {"/models/Qwen3-0.6B": "/cache/tiny", "/tmp": "/state/pod/tmp"}
    assert translate("/models/Qwen3-0.6B", paths) == "/cache/tiny"
    assert translate("/models/Qwen3-0.6B/config.json", paths) == "/cache/tiny/config.json"
    assert translate("--model=/models/Qwen3-0.6B", paths) == "--model=/cache/tiny"
    assert translate("/tmpfoo", paths) == "/tmpfoo"
    assert translate("qwen-cpu-decode.default.svc.cluster.local:50053", paths) == (
        "qwen-cpu-decode.default.svc.cluster.local:50053")


def test_variables_expand_as_kubernetes_does():
    env = {"POD_IP": "10.213.0.7"}
    assert expand("--advertise=$(POD_IP):50052", env) == "--advertise=10.213.0.7:50052"
    assert expand("$(UNDEFINED)", env) == "$(UNDEFINED)"
    assert expand("$$(POD_IP)", env) == "$(POD_IP)"


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(name: str, port: int) -> DNSRecord:
    return DNSRecord.parse(DNSRecord.question(name, "A").send("127.0.0.1", port, timeout=5))


def test_service_names_answer_every_ready_pod_and_other_names_are_not_forwarded():
    port = _free_udp_port()
    dns = ClusterDNS("127.0.0.1", port)
    dns.start()
    try:
        dns.records.set({("demo-decode", "ns1"): ["10.213.0.4", "10.213.0.6"], ("demo-prefill", "ns1"): []})
        reply = _ask("demo-decode.ns1.svc.cluster.local", port)
        assert sorted(str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A) == ["10.213.0.4", "10.213.0.6"]
        empty = _ask("DEMO-PREFILL.ns1.svc.cluster.local", port)
        assert empty.header.rcode == RCODE.NOERROR and not empty.rr
        assert _ask("demo-decode.other.svc.cluster.local", port).header.rcode == RCODE.NXDOMAIN
        assert _ask("example.com", port).header.rcode == RCODE.NXDOMAIN
    finally:
        dns.stop()
    conf = resolv_conf("10.213.0.1", "ns1")
    assert "nameserver 10.213.0.1" in conf and "search ns1.svc.cluster.local svc.cluster.local" in conf


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
def test_what_a_crashed_run_left_behind_is_removed_by_its_prefix():
    prefix = "qst-"
    subprocess.run(["ip", "netns", "add", f"{prefix}pod"], check=True)
    subprocess.run(["ip", "link", "add", f"{prefix}br0", "type", "bridge"], check=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", f"{prefix}pod", "sleep", "300"])
    try:
        assert sorted(leftovers(prefix)) == [f"link {prefix}br0", f"netns {prefix}pod"]
        removed = remove_leftovers(prefix)
        assert len(removed) == 2
        assert orphan.wait(timeout=10) == -9  # the process in the namespace was killed
        assert leftovers(prefix) == []
    finally:
        orphan.kill()
        remove_leftovers(prefix)


def test_the_api_server_keeps_a_bounded_request_log_and_serves_on():
    # kmock matches every request by scanning the requests it kept: unbounded, a running cluster's API slowed to
    # 0.2-0.4 s a call within minutes. The dev cluster keeps the last few.
    async def run() -> tuple[int, list[str]]:
        async with ApiServer() as server, kmock.Server(server) as http:
            declare_resources(server)
            server.request_log = 8
            url = str(http.url).rstrip("/") + "/api/v1/namespaces/default/configmaps"
            async with aiohttp.ClientSession() as session:
                for i in range(200):
                    body = {"metadata": {"name": f"c{i}"}, "data": {"i": str(i)}}
                    async with session.post(url, json=body) as response:
                        assert response.status == 200, await response.text()
                async with session.get(url) as response:
                    names = [item["metadata"]["name"] for item in (await response.json())["items"]]
            return len(list(server)), names

    kept, names = asyncio.run(run())
    assert kept <= 16
    assert names == [f"c{i}" for i in range(200)]
