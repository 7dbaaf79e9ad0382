"""The one HTTP server of a stage's metrics and probes: `/metrics`, `/healthz` (live), `/readyz` (ready).

`qwenserve.grpc_server.serve` starts it for every stage with a metrics port; the router also answers
`/metrics` on its OpenAI HTTP port (`metrics_page`).
"""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from prometheus_client import REGISTRY, CollectorRegistry

from qwenserve.telemetry.metrics import metrics_page

log = logging.getLogger(__name__)


class MetricsServer:
    """An HTTP server on its own daemon thread: `/metrics`, `/healthz` (live), `/readyz` (ready).

    `live` and `ready` are callables the service supplies (e.g. from its health object); they may
    be set after start, since the server usually starts before the model is loaded. Without
    `live`, /healthz answers 200 while the process serves HTTP; without `ready`, /readyz answers
    503 so an unwired readiness probe is never mistaken for a ready pod. Constructing one binds the
    port (0: a free one, then `.port`) and starts serving; `close()` stops it.
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "0.0.0.0",
        registry: CollectorRegistry | None = None,
        live: Callable[[], bool] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.live = live
        self.ready = ready
        self._httpd = http.server.ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"metrics-http-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """Base URL of the server, for logs and tests."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _probe(check: Callable[[], bool] | None, default: bool) -> bool:
    if check is None:
        return default
    try:
        return bool(check())
    except Exception:  # a probe that raises is a failing probe, and the reason belongs in the log
        log.exception("health probe raised")
        return False


def _make_handler(server: MetricsServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == "/metrics":
                self._reply(200, *metrics_page(server.registry, self.headers.get("Accept", "")))
            elif path == "/healthz":
                ok = _probe(server.live, default=True)
                self._reply(200 if ok else 503, b"ok\n" if ok else b"not live\n")
            elif path == "/readyz":
                ok = _probe(server.ready, default=False)
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._reply(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            # Prometheus scrapes every few seconds; one access line per scrape is noise.
            return

    return Handler
