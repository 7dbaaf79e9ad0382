"""The inference engine: models on a paged KV cache with continuous batching (no network here).

Public API (imported lazily, so `qwenserve.engine.sampling_params` stays cheap to import without torch):
LLMEngine, EngineConfig, SamplingParams, RequestOutput, TokenLogprob, TokenCounts, EngineStats, KVLayout,
KVImport, KVExportSink and the error types in `qwenserve.engine.errors`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "qwenserve.engine.engine",
    "EngineConfig": "qwenserve.engine.config",
    "SamplingParams": "qwenserve.engine.sampling_params",
    "InvalidSamplingParams": "qwenserve.engine.sampling_params",
    "RequestOutput": "qwenserve.engine.outputs",
    "TokenLogprob": "qwenserve.engine.outputs",
    "TokenCounts": "qwenserve.engine.outputs",
    "EngineStats": "qwenserve.engine.outputs",
    "KVLayout": "qwenserve.engine.kv_layout",
    "KVImport": "qwenserve.engine.kv_layout",
    "KVExportSink": "qwenserve.engine.kv_layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import public names on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qwenserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
