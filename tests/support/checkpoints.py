"""The tiny Qwen3 checkpoint (the real vocabulary, random weights) that most tests serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qwenserve.default_model import TINY_CONFIG, write_checkpoint

# The default model's shape with a 1024-token context: long enough for every prompt the tests send.
TINY: dict[str, Any] = {**TINY_CONFIG, "max_position_embeddings": 1024}


def tiny_checkpoint(folder: Path, seed: int = 11, generation_config: dict[str, Any] | None = None,
                    **config: Any) -> Path:
    """TINY with `config`'s keys replaced, written to `folder` with weights drawn from `seed` (and
    `generation_config` as its generation_config.json, where given)."""
    return write_checkpoint(folder, {**TINY, **config}, seed=seed, generation_config=generation_config)
