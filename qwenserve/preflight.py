"""Start-up checks that fail in one line, before anything slow happens (weights loading, children starting).

Each check raises StartupError with a message that names the cause and the fix; the stages and
`qwen-serve up` print it as one line on stderr and exit non-zero.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from qwenserve.checkpoint_config import read_config_json


class StartupError(Exception):
    """A stage or `qwen-serve up` cannot start; the message says why and what to change."""


def one_line(err: BaseException) -> str:
    """An error's message on one line (some libraries' messages span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def check_model_folder(model: str | Path, flag: str = "--model", *, needs_tokenizer: bool = False) -> None:
    """`model` is a Hugging Face checkpoint folder: it exists, is a folder and has a readable config.json
    (and tokenizer.json when `needs_tokenizer`)."""
    folder = Path(model)
    fix = f"give {flag} a Hugging Face checkpoint folder, or leave it out for the built-in model"
    if not folder.exists():
        raise StartupError(f"{flag} {folder}: no such file or folder; {fix}")
    if not folder.is_dir():
        raise StartupError(f"{flag} {folder} is a file, not a folder; {fix}")
    config = folder / "config.json"
    if not config.is_file():
        raise StartupError(f"{flag} {folder} has no config.json, so it is not a checkpoint folder; {fix}")
    try:
        read_config_json(folder)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise StartupError(f"{flag} {folder}: config.json is not readable JSON ({e}); {fix}") from None
    if needs_tokenizer and not (folder / "tokenizer.json").is_file():
        raise StartupError(f"{flag} {folder} has no tokenizer.json; copy the checkpoint's tokenizer files there")


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Nothing listens on host:port, so a server can bind it (0 always can: the OS picks)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As servers bind: a port whose last connections linger in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(f"port {port} on {host} is in use (another qwen-serve?); "
                                   f"stop that process or choose another {flag}") from None
            if e.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
                reason = "not an address of this host" if e.errno == errno.EADDRNOTAVAIL else "not permitted"
                raise StartupError(f"cannot bind {host}:{port}: {reason}; change --host or {flag}") from None
            raise StartupError(f"cannot bind {host}:{port} ({e.strerror}); change --host or {flag}") from None
        except socket.gaierror as e:
            raise StartupError(f"--host {host}: cannot resolve it ({e.strerror}); give an address of this host") \
                from None
