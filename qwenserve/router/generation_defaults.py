"""A checkpoint's sampling defaults (`generation_config.json`), applied where a request leaves a setting out.

`--generation-config` as vLLM spells it: `auto` reads the served model's folder, a folder path reads
that folder's file, `vllm` (or `none`) applies no model defaults. As vLLM does, only the sampling
settings are taken (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the
default max_tokens); a request's own value always wins, so does an explicit 0 or 1.0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from qwenserve.v1 import common_pb2

FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty")
INT_KEYS = {"top_k": "top_k", "max_new_tokens": "max_tokens"}  # generation_config name -> SamplingParams field
MODES = ("auto", "vllm", "none")


class GenerationConfigError(ValueError):
    """The generation config named cannot be read or holds a value no request could have."""


def load_generation_defaults(source: str, model: str | Path | None) -> dict[str, float | int]:
    """The sampling defaults `--generation-config source` means for `model` (a checkpoint folder)."""
    if source in ("vllm", "none"):
        return {}
    if source == "auto":
        if model is None:
            return {}
        folder = Path(model)
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise GenerationConfigError(f"--generation-config {source}: not a folder (give auto, vllm, none or a "
                                        "folder holding generation_config.json)")
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise GenerationConfigError(f"--generation-config {source}: no generation_config.json there")
        return {}
    try:
        raw: Any = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GenerationConfigError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path} is not a JSON object")
    defaults: dict[str, float | int] = {}
    for key in FLOAT_KEYS:
        value = raw.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise GenerationConfigError(f"{path}: {key} must be a number, not {value!r}")
            defaults[key] = float(value)
    for key, field in INT_KEYS.items():
        value = raw.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise GenerationConfigError(f"{path}: {key} must be an integer, not {value!r}")
            defaults[field] = max(0, value)  # a negative top_k (vLLM's "off") is 0 here
    return defaults


def with_defaults(sampling: common_pb2.SamplingParams, defaults: dict[str, float | int],
                  room: int) -> common_pb2.SamplingParams:
    """A copy of `sampling` whose unset fields take the defaults (a default max_tokens at most `room`, the
    tokens the context has left after the prompt, as vLLM caps it)."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    for field, value in defaults.items():
        if not out.HasField(field):
            setattr(out, field, min(int(value), room) if field == "max_tokens" else value)
    return out
