"""A deployment's stage secret: the file that proves a caller is one of the deployment's own stages.

One secret per deployment (`--stage-secret-file`, QWENSERVE_STAGE_SECRET_FILE: a file, so the value is never in
argv or the environment that `ps` shows; `qwen-serve up` writes one per run, the operator one Secret per
QwenDeployment). The secret itself never travels: callers send `credential`, an HMAC of a fixed label under it,
and servers compare in constant time. The gRPC side (the server's check, the channels' metadata) is
qwenserve/stage_auth.py; this module is pure, so the stage configs can carry a secret without importing gRPC.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from qwenserve.preflight import StartupError

#: A secret shorter than this is refused: a guessable one protects nothing.
MIN_SECRET_BYTES = 16
_LABEL = b"qwenserve stage credential v1"


@dataclass(frozen=True)
class StageSecret:
    """A deployment's shared stage secret and the credential its stages present and check."""

    value: bytes = field(repr=False)

    @classmethod
    def from_file(cls, path: str | Path) -> StageSecret:
        """The secret in `path` (surrounding whitespace ignored); StartupError when it is missing or too short."""
        try:
            value = Path(path).read_bytes().strip()
        except OSError as e:
            raise StartupError(f"--stage-secret-file {path}: cannot read it ({e.strerror or e})") from None
        if len(value) < MIN_SECRET_BYTES:
            raise StartupError(f"--stage-secret-file {path}: the secret has {len(value)} bytes, fewer than "
                               f"{MIN_SECRET_BYTES}; make one with `openssl rand -hex 32`")
        return cls(value)

    @property
    def credential(self) -> str:
        """What callers send (an HMAC of a fixed label under the secret, never the secret)."""
        return hmac.new(self.value, _LABEL, hashlib.sha256).hexdigest()

    def accepts(self, presented: str | bytes | None) -> bool:
        """Whether `presented` is this deployment's credential (constant-time)."""
        if presented is None:
            return False
        given = presented.encode() if isinstance(presented, str) else presented
        return hmac.compare_digest(given, self.credential.encode())


def load_stage_secret(path: str) -> StageSecret | None:
    """The secret of `--stage-secret-file` (None when no file is given)."""
    return StageSecret.from_file(path) if path else None


def per_run_secret_file() -> Path:
    """A fresh secret for one run of `qwen-serve up`, in a folder of its own (0700) that goes when the run ends."""
    folder = Path(tempfile.mkdtemp(prefix="qwenserve-up-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return write_stage_secret(folder)


def write_stage_secret(folder: Path) -> Path:
    """A fresh random secret in `folder`/stage-secret, readable by this user only (a new file, never reused)."""
    path = folder / "stage-secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path
