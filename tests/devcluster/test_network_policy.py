"""NetworkPolicy objects as the dev cluster's nftables rules (network_policy.py), without a cluster: the operator's
own policies for a 2 + 2 deployment, selectors, named ports, ipBlocks; `nft --check` parses the result where nft
is installed. Enforcement on a running cluster is tested in test_scaled_cluster.py."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from qwenserve_devcluster.network_policy import PodEndpoint, pod_rules, ruleset, selects
from qwenserve_operator.crd import with_defaults
from qwenserve_operator.manifests import network_policy
from qwenserve_operator.naming import selector_labels

NAME = "qwen-cpu"
STAGES = ("tokenizer", "prefill", "prefill", "decode", "decode", "router")


def _pods() -> list[PodEndpoint]:
    return [PodEndpoint(f"{NAME}-{stage}-{i}", f"10.213.0.{i + 2}", selector_labels(NAME, stage), {"grpc": 50000 + i})
            for i, stage in enumerate(STAGES)]


def _operator_policies(mode: str = "network") -> list[dict]:
    spec = with_defaults({"model": {"name": "m"}, "kvTransfer": {"mode": mode}})
    return [network_policy(NAME, "default", "uid", stage, spec) for stage in ("tokenizer", "prefill", "decode", "router")]


def _rules(stage_index: int, policies: list[dict] | None = None) -> list[str] | None:
    pods = _pods()
    return pod_rules(pods[stage_index], _operator_policies() if policies is None else policies, pods, "default")


def test_the_operators_policies_open_decode_to_the_router_and_prefill_to_the_router_and_decode_only():
    # Pods: tokenizer .2, prefill .3 .4, decode .5 .6, router .7
    assert _rules(3) == ["ip saddr 10.213.0.7 tcp dport 50053 accept", "ip saddr 10.213.0.7 tcp dport 9090 accept"]
    assert _rules(1) == ["ip saddr { 10.213.0.5, 10.213.0.6, 10.213.0.7 } tcp dport 50052 accept",
                         "ip saddr 10.213.0.7 tcp dport 9090 accept"]
    assert _rules(0) == ["ip saddr 10.213.0.7 tcp dport 50051 accept", "ip saddr 10.213.0.7 tcp dport 9090 accept"]
    assert _rules(5) == ["tcp dport { 50050, 8000 } accept", "ip saddr 10.213.0.7 tcp dport 9090 accept"]


def test_a_pod_no_policy_selects_is_open_and_one_selected_by_a_policy_without_rules_is_closed():
    other = [{"spec": {"podSelector": {"matchLabels": {"app": "other"}}}}]
    assert _rules(3, other) is None
    deny_all = [{"spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}]
    assert _rules(3, deny_all) == []
    egress_only = [{"spec": {"podSelector": {}, "policyTypes": ["Egress"]}}]
    assert _rules(3, egress_only) is None
    script = ruleset(deny_all, _pods(), "default")
    assert script.count("\t\tdrop\n") == len(STAGES) and "10.213.0.5 : jump to-10-213-0-5" in script


def test_selectors_named_ports_ip_blocks_and_namespace_selectors_follow_kubernetes_semantics():
    labels = {"tier": "db", "env": "prod"}
    assert selects({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["db", "cache"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["prod"]}]}, labels)
    assert selects({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, labels)
    assert not selects({"matchLabels": {"tier": "db"}, "matchExpressions": [{"key": "x", "operator": "Exists"}]},
                       labels)
    policy = {"spec": {"podSelector": {}, "ingress": [
        {"from": [{"ipBlock": {"cidr": "10.213.0.0/24", "except": ["10.213.0.250/32"]}}],
         "ports": [{"port": "grpc"}, {"port": "missing"}, {"port": 7000, "endPort": 7010}, {"port": 53,
                                                                                             "protocol": "UDP"}]},
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}}}]},
        {"from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]},
        {"ports": [{"port": "missing"}]},
    ]}}
    assert _rules(2, [policy]) == [
        "ip saddr 10.213.0.0/24 ip saddr != 10.213.0.250/32 tcp dport { 50002, 7000-7010 } accept",
        "ip saddr { 10.213.0.2, 10.213.0.3, 10.213.0.4, 10.213.0.5, 10.213.0.6, 10.213.0.7 } accept"]


@pytest.mark.skipif(shutil.which("nft") is None or os.geteuid() != 0, reason="needs nft (Debian nftables) and root")
def test_nft_accepts_the_ruleset_of_the_operators_policies():
    for mode in ("network", "shm", "mooncake"):
        script = ruleset(_operator_policies(mode), _pods(), "default")
        done = subprocess.run(["nft", "--check", "-f", "-"], input=script, capture_output=True, text=True)
        assert done.returncode == 0, f"{mode}: {done.stderr}\n{script}"
