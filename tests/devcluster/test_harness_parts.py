"""The dev-cluster's parts without a cluster: container paths and $(VAR) expansion, Service DNS, leftovers."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
from dnslib import QTYPE, RCODE, DNSRecord

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
