"""Cluster DNS for the pods: `<svc>.<ns>.svc.cluster.local` answers with the IPs of the Service's ready pods.

Every Service is answered as a headless one (an A record per ready pod; there are no virtual IPs
here). Short names (`<svc>`, `<svc>.<ns>`) resolve through the search list of the pods' resolv.conf.
Names outside the cluster domain get NXDOMAIN: nothing is forwarded, so no query leaves the bridge.
"""

from __future__ import annotations

import threading

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSServer

CLUSTER_DOMAIN = "cluster.local"
TTL = 1  # seconds: the router re-resolves quickly after a scale change


def resolv_conf(nameserver: str, namespace: str) -> str:
    """The /etc/resolv.conf of a pod in `namespace`, as a kubelet writes it."""
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"nameserver {nameserver}\nsearch {search}\noptions ndots:5\n"


class ServiceRecords(BaseResolver):
    """The A records of the Services; `set` replaces them all at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, list[str]] = {}

    def set(self, records: dict[tuple[str, str], list[str]]) -> None:
        """records: (service, namespace) -> pod IPs."""
        fqdns = {f"{svc}.{ns}.svc.{CLUSTER_DOMAIN}.": ips for (svc, ns), ips in records.items()}
        with self._lock:
            self._records = fqdns

    def lookup(self, name: str) -> list[str] | None:
        """The IPs of a fully qualified name (with or without the final dot); None if it is unknown."""
        name = name.lower() if name.endswith(".") else name.lower() + "."
        with self._lock:
            return self._records.get(name)

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        """dnslib's hook: answer one query."""
        reply = request.reply()
        question = request.q
        ips = self.lookup(str(question.qname))
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif question.qtype in (QTYPE.A, QTYPE.ANY):
            for address in ips:
                reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(address), ttl=TTL))
        return reply  # a known name without A records for this type: NOERROR, no answers


class ClusterDNS:
    """A UDP and TCP DNS server on `address:port` serving ServiceRecords, in background threads."""

    def __init__(self, address: str, port: int = 53) -> None:
        self.records = ServiceRecords()
        self._servers = [DNSServer(self.records, address=address, port=port, tcp=tcp, logger=_Quiet())
                         for tcp in (False, True)]

    def start(self) -> None:
        """Start serving (returns at once)."""
        for server in self._servers:
            server.start_thread()

    def stop(self) -> None:
        """Stop serving and close the sockets."""
        for server in self._servers:
            server.stop()
            server.server.server_close()


class _Quiet:
    """dnslib logs every query by default; the harness wants none of it."""

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None
