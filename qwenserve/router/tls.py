"""TLS for the router's two ports: one certificate and key for gRPC and HTTP, optionally client certificates.

    tls = TlsConfig.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca)   # None: plaintext
    server.add_secure_port(address, grpc_server_credentials(tls))                 # gRPC
    web.TCPSite(runner, host, port, ssl_context=http_ssl_context(tls))           # aiohttp

Plaintext stays the local default; a certificate without its key (or the reverse) is an error
rather than a silent fallback to plaintext.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """The TLS flags or files are unusable; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM files: the server's certificate chain and key, and the CA that signs client certificates."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @classmethod
    def from_flags(cls, cert: str | Path | None, key: str | Path | None,
                   client_ca: str | Path | None = None) -> TlsConfig | None:
        """None when no TLS flag is given; raises TlsConfigError for half a configuration or missing files."""
        if not cert and not key:
            if client_ca:
                raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not cert or not key:
            raise TlsConfigError("TLS needs both --tls-cert and --tls-key")
        config = cls(Path(cert), Path(key), Path(client_ca) if client_ca else None)
        for flag, path in (("--tls-cert", config.cert), ("--tls-key", config.key), ("--tls-client-ca", config.client_ca)):
            if path is not None and not path.is_file():
                raise TlsConfigError(f"{flag}: {path} is not a readable file")
        return config

    @property
    def requires_client_cert(self) -> bool:
        """True when clients must present a certificate signed by `client_ca` (mutual TLS)."""
        return self.client_ca is not None


def http_ssl_context(config: TlsConfig) -> ssl.SSLContext:
    """A server-side SSLContext for aiohttp (TLS 1.2 or later)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.cert, config.key)
    except ssl.SSLError as e:
        raise TlsConfigError(f"{config.cert} / {config.key}: not a matching PEM certificate and key ({e})") from e
    if config.client_ca is not None:
        try:
            context.load_verify_locations(cafile=config.client_ca)
        except ssl.SSLError as e:
            raise TlsConfigError(f"{config.client_ca}: not a PEM CA bundle ({e})") from e
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    """Credentials for `server.add_secure_port()`; requires client certificates when a client CA is set."""
    # gRPC reads PEM lazily and fails obscurely at the first handshake; the ssl module checks them now.
    http_ssl_context(config)
    root = config.client_ca.read_bytes() if config.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(config.key.read_bytes(), config.cert.read_bytes())],
        root_certificates=root,
        require_client_auth=config.requires_client_cert,
    )
