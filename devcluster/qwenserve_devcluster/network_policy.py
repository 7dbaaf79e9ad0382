"""NetworkPolicy enforcement on the dev cluster's bridge: the namespace's policies as nftables rules per pod.

`ruleset` is a pure function from the NetworkPolicy objects and the pods (name, IP, labels, named ports) to
one nftables table in the bridge family, hooked where the bridge forwards one pod's packets to another:

- a pod that some Ingress policy selects gets a chain of its own; a TCP connection to it opens (its SYN passes)
  only when a rule of one of those policies admits the source and the port, otherwise the SYN is dropped, as
  most CNI plugins do (the client sees a connect timeout);
- `from` peers: podSelector (this namespace), namespaceSelector (the one namespace the dev cluster runs, labelled
  `kubernetes.io/metadata.name`), both together, ipBlock with `except`; no `from` admits every source, no
  `ports` every port; named ports are looked up in the destination pod's container ports;
- only connection openings are judged (a SYN without ACK): replies and established streams pass, because the
  bridge family has no connection tracking on every kernel (nf_conntrack_bridge). TCP is all the stages speak,
  so UDP and SCTP rules are not enforced;
- traffic from this machine (probes, the operator's scrapes, the user's requests) is the node's and is not
  forwarded by the bridge, so it is admitted, as NetworkPolicy implementations admit the kubelet.

`PolicyFirewall` applies a ruleset with `nft -f` (atomically: the table is replaced in one transaction) only
when it changed, so the pod runner can ask on every pass and whenever it starts a pod.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

TABLE = "qs-policies"  # the prefix of every name a dev-cluster run makes, so leftovers are found by it
NAMESPACE_LABEL = "kubernetes.io/metadata.name"

Obj = dict[str, Any]


@dataclass(frozen=True)
class PodEndpoint:
    """What a policy needs of a pod: its IP, labels and named container ports."""

    name: str
    ip: str
    labels: dict[str, str]
    named_ports: dict[str, int] = field(default_factory=dict)


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects `labels`; an empty one selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def _ingress_policies(policies: Iterable[Obj]) -> list[Obj]:
    # A policy without policyTypes is an Ingress policy (and an Egress one too if it has egress rules).
    return [p for p in policies if "Ingress" in (p.get("spec", {}).get("policyTypes") or ["Ingress"])]


def _sources(peers: list[Obj], pods: list[PodEndpoint], namespace: str) -> tuple[list[str], list[Obj]]:
    """(pod IPs, ipBlocks) a rule's `from` admits."""
    ips: set[str] = set()
    blocks: list[Obj] = []
    namespace_labels = {NAMESPACE_LABEL: namespace}
    for peer in peers:
        if "ipBlock" in peer:
            blocks.append(peer["ipBlock"])
            continue
        if "namespaceSelector" in peer and not selects(peer["namespaceSelector"], namespace_labels):
            continue  # another namespace's pods: none run here
        ips |= {p.ip for p in pods if selects(peer.get("podSelector"), p.labels)}
    return sorted(ips, key=ipaddress.ip_address), blocks


def _ports(ports: list[Obj], pod: PodEndpoint) -> list[str]:
    """nft port expressions of a rule's TCP ports on `pod` (a named port the pod lacks matches nothing)."""
    out: list[str] = []
    for port in ports:
        if port.get("protocol", "TCP") != "TCP":
            continue
        number = port.get("port")
        if isinstance(number, str) and not number.isdigit():
            number = pod.named_ports.get(number)
        if number is None:
            continue
        out.append(f"{int(number)}-{int(port['endPort'])}" if port.get("endPort") else str(int(number)))
    return out


def _set(items: list[str]) -> str:
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


def pod_rules(pod: PodEndpoint, policies: list[Obj], pods: list[PodEndpoint], namespace: str) -> list[str] | None:
    """The accept rules of the chain guarding `pod`, or None when no Ingress policy selects it (it is open)."""
    selecting = [p for p in _ingress_policies(policies) if selects(p.get("spec", {}).get("podSelector"), pod.labels)]
    if not selecting:
        return None
    rules: list[str] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            if rule.get("ports"):
                ports = _ports(rule["ports"], pod)
                if not ports:
                    continue
                port_match = f"tcp dport {_set(ports)} "
            else:
                port_match = ""
            if not rule.get("from"):
                rules.append(f"{port_match}accept")
                continue
            ips, blocks = _sources(rule["from"], pods, namespace)
            if ips:
                rules.append(f"ip saddr {_set(ips)} {port_match}accept")
            for block in blocks:
                if ipaddress.ip_network(block["cidr"], strict=False).version != 4:
                    continue  # the bridge's pods have IPv4 addresses only
                excepted = f"ip saddr != {_set(list(block['except']))} " if block.get("except") else ""
                rules.append(f"ip saddr {block['cidr']} {excepted}{port_match}accept")
    return rules


def ruleset(policies: list[Obj], pods: list[PodEndpoint], namespace: str) -> str:
    """The nftables script that replaces the dev cluster's policy table with one enforcing `policies`."""
    chains: list[str] = []
    jumps: list[str] = []
    for pod in sorted(pods, key=lambda p: ipaddress.ip_address(p.ip)):
        rules = pod_rules(pod, policies, pods, namespace)
        if rules is None:
            continue
        chain = "to-" + pod.ip.replace(".", "-")
        jumps.append(f"{pod.ip} : jump {chain}")
        body = "".join(f"\t\t{r}\n" for r in rules)
        chains.append(f"\tchain {chain} {{\n\t\tcomment \"{pod.name}\"\n{body}\t\tdrop\n\t}}\n")
    forward = "\tchain forward {\n\t\ttype filter hook forward priority 0; policy accept;\n"
    if jumps:
        # Only a connection's opening is judged: SYN set, ACK clear.
        forward += f"\t\ttcp flags & (syn | ack) == syn ip daddr vmap {{ {', '.join(jumps)} }}\n"
    forward += "\t}\n"
    # "add" then "delete" then the table: one transaction that works whether or not the table exists.
    return f"add table bridge {TABLE}\ndelete table bridge {TABLE}\ntable bridge {TABLE} {{\n{''.join(chains)}{forward}}}\n"


class PolicyFirewall:
    """Applies rulesets with `nft`; without nft (Debian package nftables) it says once that nothing is enforced."""

    def __init__(self, namespace: str, log: Callable[[str], None] = print) -> None:
        self.namespace = namespace
        self.log = log
        self.policies: list[Obj] = []
        self.enabled = shutil.which("nft") is not None
        self._applied: str | None = None
        self._last_error = ""
        if not self.enabled:
            log("NetworkPolicies are not enforced: nft is not installed (Debian package nftables)")

    def apply(self, pods: list[PodEndpoint]) -> bool:
        """Enforce `self.policies` on `pods` if that changes the rules; whether the rules in force are current."""
        if not self.enabled:
            return False
        script = ruleset(self.policies, pods, self.namespace)
        if script == self._applied:
            return True
        done = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True)
        if done.returncode != 0:
            error = done.stderr.strip()
            if error != self._last_error:  # once per distinct failure, not on every pass
                self.log(f"NetworkPolicies not applied: nft: {error}")
                self._last_error = error
            return False
        self._applied, self._last_error = script, ""
        return True

    def close(self) -> None:
        """Remove the table (pods are gone; nothing to enforce)."""
        remove_table()
        self._applied = None


def remove_table() -> None:
    """Remove the dev cluster's policy table if nft is installed and the table exists (an earlier run's too)."""
    if shutil.which("nft") is not None:
        subprocess.run(["nft", "delete", "table", "bridge", TABLE], capture_output=True)
