"""Wiring the router's front door into a service process: flags, the gatekeeper, the HTTP server.

    add_front_flags(parser)                                   # keys, limits, Redis, TLS, body size
    front = FrontConfig.from_args(args)
    gatekeeper = make_gatekeeper(front, metrics)              # key store + limiter + usage meter
    http = await start_http_front(router, gatekeeper, front, model_name, host, http_port, tokenizer.token_bytes)
    ...
    await http.cleanup(); await gatekeeper.drain(); await close_gatekeeper(gatekeeper)

Every flag has a `QWENSERVE_*` environment fallback with the names the limiter and key-store
libraries read themselves (`QWENSERVE_API_KEYS_FILE`, `QWENSERVE_REDIS_URL`, ...).
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from qwenserve.flags import add_flag
from qwenserve.ratelimit import RateLimiterConfig, make_rate_limiter
from qwenserve.ratelimit.redis_client import connect
from qwenserve.router.admission import Gatekeeper
from qwenserve.router.generation import Router
from qwenserve.router.openai_http import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, build_app, serve_http
from qwenserve.router.tls import TlsConfig, add_tls_flags, http_ssl_context
from qwenserve.telemetry.metrics import RouterMetrics
from qwenserve.tenancy import InProcessUsageMeter, RedisUsageMeter, load_key_store
from qwenserve.tenancy.usage import UsageMeter


@dataclass(frozen=True)
class FrontConfig:
    """The front door's settings (no secrets: keys live in the key file or environment)."""

    api_keys_file: str | None
    no_auth: bool
    redis_url: str | None
    ratelimit_window_s: float | None
    ratelimit_failure_mode: str | None
    http_max_body_bytes: int
    tls: TlsConfig | None
    http_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FrontConfig:
        """From the flags `add_front_flags` added; raises TlsConfigError for half a TLS setup."""
        return cls(
            api_keys_file=args.api_keys_file or None,
            no_auth=args.no_auth,
            redis_url=args.redis_url or None,
            ratelimit_window_s=args.ratelimit_window_s,
            ratelimit_failure_mode=args.ratelimit_failure_mode,
            http_max_body_bytes=args.http_max_body_bytes,
            tls=TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca),
            http_body_timeout_s=args.http_body_timeout_s,
        )


def add_front_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the front door, each with its QWENSERVE_* environment fallback."""
    add_flag(parser, "--api-keys-file", help="API keys -> tenants and limits (YAML/JSON file or directory)")
    add_flag(parser, "--no-auth", type=bool, default=False, help="accept every request as the default tenant")
    add_flag(parser, "--redis-url", help="Redis for rate limits and usage shared by router replicas")
    add_flag(parser, "--ratelimit-window-s", type=float, help="the window of per-minute limits (default 60)")
    add_flag(parser, "--ratelimit-failure-mode", choices=["open", "closed"],
             help="when Redis is down: admit (open, default) or refuse (closed)")
    add_flag(parser, "--http-max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
             help="larger HTTP request bodies get a 413")
    add_flag(parser, "--http-body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
             help="an HTTP request body not fully received in this many seconds gets a 408")
    add_tls_flags(parser)


def make_gatekeeper(config: FrontConfig, metrics: RouterMetrics | None = None) -> Gatekeeper:
    """Key store, limiter (Redis or in-process) and usage meter (Redis or in-process).

    Raises TenancyConfigError when no keys are configured and --no-auth is not given.
    """
    keys = load_key_store(config.api_keys_file, no_auth=config.no_auth or None)
    limiter_config = RateLimiterConfig.from_env(
        redis_url=config.redis_url,
        window_s=config.ratelimit_window_s,
        failure_mode=config.ratelimit_failure_mode,
    )
    meter: UsageMeter
    if limiter_config.redis_url:
        meter = RedisUsageMeter(connect(limiter_config.redis_url, timeout_s=limiter_config.redis_timeout_s))
    else:
        meter = InProcessUsageMeter()
    return Gatekeeper(keys, make_rate_limiter(limiter_config), meter, metrics)


async def close_gatekeeper(gatekeeper: Gatekeeper) -> None:
    """Finish pending settlements, then close the limiter's and meter's connections."""
    await gatekeeper.drain()
    await gatekeeper.limiter.close()
    if gatekeeper.meter is not None:
        await gatekeeper.meter.close()


async def start_http_front(
    router: Router,
    gatekeeper: Gatekeeper,
    config: FrontConfig,
    model_name: str,
    host: str,
    port: int,
    token_bytes: Callable[[int], bytes] | None,
) -> web.AppRunner:
    """Serve the OpenAI-compatible app on host:port (TLS when configured); `await runner.cleanup()` stops it."""
    app = build_app(router, gatekeeper, model_name, token_bytes=token_bytes,
                    max_body_bytes=config.http_max_body_bytes, body_timeout_s=config.http_body_timeout_s)
    context: ssl.SSLContext | None = http_ssl_context(config.tls) if config.tls is not None else None
    return await serve_http(app, host, port, context)
