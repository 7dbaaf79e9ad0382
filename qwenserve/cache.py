"""Where qwen-serve keeps what it derives once per machine: converted vocabularies, the default model, kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$QWENSERVE_CACHE, else $XDG_CACHE_HOME/qwen-serve (~/.cache/qwen-serve)."""
    if env := os.environ.get("QWENSERVE_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "qwen-serve"
