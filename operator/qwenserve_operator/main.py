"""`qwen-serve operator`: run the QwenDeployment operator (kopf).

    qwen-serve operator [--namespace NS ...] [--all-namespaces] [--interval SECONDS]
                        [--liveness-port PORT] [--verbose]

Environment fallbacks: QWENSERVE_OPERATOR_NAMESPACES (comma-separated), QWENSERVE_OPERATOR_INTERVAL.
Without a namespace and without --all-namespaces it watches the namespace it runs in.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Sequence

import kopf

from qwenserve.flags import StrictParser
from qwenserve_operator.handlers import make_registry
from qwenserve_operator.reconciler import OperatorConfig

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Command-line options with QWENSERVE_OPERATOR_* environment fallbacks."""
    parser = StrictParser(prog="qwen-serve operator", description=__doc__.splitlines()[0])
    env_namespaces = [n for n in os.environ.get("QWENSERVE_OPERATOR_NAMESPACES", "").split(",") if n]
    parser.add_argument("--namespace", "-n", action="append", dest="namespaces", default=None,
                        help="namespace to watch (repeatable)")
    parser.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--interval", type=float, default=float(os.environ.get("QWENSERVE_OPERATOR_INTERVAL", 15)),
                        help="seconds between autoscaling / drift passes (default 15)")
    parser.add_argument("--liveness-port", type=int, default=8080, help="/healthz port; 0 disables it")
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(list(argv))
    args.namespaces = args.namespaces or env_namespaces
    return args


def _own_namespace() -> str:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip()
    except OSError:
        return "default"


def main(argv: Sequence[str]) -> int:
    """Run the operator until SIGINT/SIGTERM; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = OperatorConfig(interval=args.interval)
    namespaces = [] if args.all_namespaces else (args.namespaces or [_own_namespace()])
    print(f"qwen-serve operator: {config}, namespaces={namespaces or 'all'}", flush=True)
    settings = kopf.OperatorSettings()
    # CRD and namespace scanning need cluster-wide rights; the namespaces are known up front.
    settings.scanning.disabled = True
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(kopf.operator(
        registry=make_registry(config),
        settings=settings,
        standalone=True,  # one replica (Recreate strategy): no peering objects needed
        clusterwide=args.all_namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
    ))
    return 0
