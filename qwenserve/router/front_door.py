"""Wiring the router's front door into a service process: flags, the gatekeeper, the HTTP server.

    front: FrontConfig = nested(FrontConfig)                  # in a stage's config: keys, limits, Redis, TLS
    gatekeeper = make_gatekeeper(front, metrics)              # key store + limiter + usage meter
    http = await start_http_front(router, gatekeeper, front, model_name, host, http_port, tokenizer.token_bytes)
    ...
    await http.cleanup(); await gatekeeper.drain(); await close_gatekeeper(gatekeeper)

Every option is a flag with its `QWENSERVE_<FLAG>` environment fallback (`qwenserve.flags`); the key store and
the limiter get their settings from here, not from the environment.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from qwenserve.flags import add_options, config_from_args, option
from qwenserve.ratelimit import RateLimiterConfig, make_rate_limiter
from qwenserve.ratelimit.redis_client import connect
from qwenserve.router.gatekeeper import Gatekeeper
from qwenserve.router.generation import Router
from qwenserve.router.models import ModelRoutes
from qwenserve.router.openai_http import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, build_app, serve_http
from qwenserve.router.tls import TlsConfig, http_ssl_context
from qwenserve.telemetry.metrics import RouterMetrics
from qwenserve.tenancy import InProcessUsageMeter, KeyStore, RedisUsageMeter, load_key_store
from qwenserve.tenancy.tenants import TenancyConfigError, TenantLimits
from qwenserve.tenancy.usage import UsageMeter


@dataclass(frozen=True)
class FrontConfig:
    """The front door's settings; the one secret among them (`api_key`) is never printed."""

    api_key: str | None = option(None, secret=True,
                                 help="the one API key clients must send (as vLLM's --api-key), default tenant")
    api_keys_file: str | None = option(None, help="API keys -> tenants and limits (YAML/JSON file or directory)")
    api_keys: str | None = option(None, secret=True,
                                  help="more API keys as key:tenant,... (the tenant follows the last ':'); a tenant "
                                       "the keys file does not define gets the default limits")
    no_auth: bool = option(False, help="accept every request as the default tenant")
    default_requests_per_minute: int | None = option(
        None, help="limit of tenants the keys file gives none (and of everyone under --no-auth); default none")
    default_tokens_per_minute: int | None = option(None, help="as --default-requests-per-minute, for tokens")
    redis_url: str | None = option(None, help="Redis for rate limits and usage shared by router replicas")
    redis_timeout_s: float = option(0.25, help="Redis connect and reply timeout, in seconds")
    ratelimit_window_s: float = option(60.0, help="the window of per-minute limits, in seconds")
    ratelimit_failure_mode: str = option("open", choices=("open", "closed"),
                                         help="when Redis is down: admit (open) or refuse (closed)")
    http_max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, help="larger HTTP request bodies get a 413")
    http_body_timeout_s: float = option(DEFAULT_BODY_TIMEOUT_S,
                                        help="an HTTP request body not fully received in this many seconds gets a 408")
    tls_cert: str | None = option(None, help="PEM certificate chain: serve gRPC and HTTP over TLS")
    tls_key: str | None = option(None, help="PEM private key of --tls-cert")
    tls_client_ca: str | None = option(None, help="PEM CA bundle: require client certificates signed by it")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FrontConfig:
        """From the flags `add_front_flags` added."""
        config: FrontConfig = config_from_args(cls, args)
        return config

    @property
    def tls(self) -> TlsConfig | None:
        """The TLS files, or None for plaintext; raises TlsConfigError for half a setup or a missing file."""
        return TlsConfig.from_flags(self.tls_cert, self.tls_key, self.tls_client_ca)


def add_front_flags(parser: argparse.ArgumentParser) -> None:
    """The front door's flags (FrontConfig's options) on a parser of its own; a stage's config nests them."""
    add_options(parser, FrontConfig)


def make_gatekeeper(config: FrontConfig, metrics: RouterMetrics | None = None) -> Gatekeeper:
    """Key store, limiter (Redis or in-process) and usage meter (Redis or in-process).

    Raises TenancyConfigError when no keys are configured and --no-auth is not given.
    """
    keys = load_front_keys(config)
    limiter_config = RateLimiterConfig(
        redis_url=config.redis_url or None,
        window_s=config.ratelimit_window_s,
        failure_mode=config.ratelimit_failure_mode,  # type: ignore[arg-type]
        redis_timeout_s=config.redis_timeout_s,
    )
    meter: UsageMeter
    if limiter_config.redis_url:
        meter = RedisUsageMeter(connect(limiter_config.redis_url, timeout_s=limiter_config.redis_timeout_s))
    else:
        meter = InProcessUsageMeter()
    return Gatekeeper(keys, make_rate_limiter(limiter_config), meter, metrics)


def load_front_keys(config: FrontConfig) -> KeyStore:
    """The key store the front door authenticates with: the keys file, `--api-key`, `--api-keys` and the default
    limits, all from the flags (or their variables). Raises TenancyConfigError naming what is wrong."""
    for flag, limit in (("--default-requests-per-minute", config.default_requests_per_minute),
                        ("--default-tokens-per-minute", config.default_tokens_per_minute)):
        if limit is not None and limit < 1:
            raise TenancyConfigError(f"{flag} {limit}: give a positive limit, or none for no limit")
    default_limits = TenantLimits(config.default_requests_per_minute, config.default_tokens_per_minute)
    return load_key_store(config.api_keys_file or None, api_keys=config.api_keys or "", api_key=config.api_key or None,
                          no_auth=config.no_auth, default_limits=default_limits)


async def close_gatekeeper(gatekeeper: Gatekeeper) -> None:
    """Finish pending settlements, then close the limiter's and meter's connections."""
    await gatekeeper.drain()
    await gatekeeper.limiter.close()
    if gatekeeper.meter is not None:
        await gatekeeper.meter.close()


async def start_http_front(
    router: Router | ModelRoutes,
    gatekeeper: Gatekeeper,
    config: FrontConfig,
    model_name: str,
    host: str,
    port: int,
    token_bytes: Callable[[int], bytes] | None = None,
) -> web.AppRunner:
    """Serve the OpenAI-compatible app on host:port (TLS when configured); `await runner.cleanup()` stops it."""
    app = build_app(router, gatekeeper, model_name, token_bytes=token_bytes,
                    max_body_bytes=config.http_max_body_bytes, body_timeout_s=config.http_body_timeout_s)
    context: ssl.SSLContext | None = http_ssl_context(config.tls) if config.tls is not None else None
    return await serve_http(app, host, port, context)
