"""The KV layout on the wire: conversion to and from `qwenserve.v1.KVLayout`, and the importer's check.

The layout itself is `qwenserve.kv_layout.KVLayout`, shared with the engine.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Protocol

from qwenserve.kv_layout import KVLayout
from qwenserve.kv_transfer.errors import KVLayoutInvalid, KVLayoutMismatch
from qwenserve.v1 import common_pb2

__all__ = ["KVLayout", "LayoutLike", "as_layout", "check_layout_matches", "layout_from_proto", "layout_to_proto"]


class LayoutLike(Protocol):
    """Anything with KVLayout's fields: the dataclass or the proto message."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_fingerprint: str


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(**{f.name: getattr(layout, f.name) for f in fields(layout)})


def layout_from_proto(message: common_pb2.KVLayout) -> KVLayout:
    """Raises KVLayoutInvalid for a message that describes no usable layout."""
    return as_layout(message)


def as_layout(layout: LayoutLike) -> KVLayout:
    """Accept the dataclass, the proto message or any object with the same fields."""
    if isinstance(layout, KVLayout):
        return layout
    try:
        return KVLayout(**{f.name: getattr(layout, f.name) for f in fields(KVLayout)})
    except ValueError as e:
        raise KVLayoutInvalid(str(e)) from e


def check_layout_matches(actual: KVLayout, expected: KVLayout) -> None:
    """Raise KVLayoutMismatch naming every field where the handle differs from the importer."""
    diffs = expected.differences(actual)
    if diffs:
        raise KVLayoutMismatch(
            "KV handoff is incompatible with this worker (prefill and decode must serve the same "
            "model with the same KV layout): " + "; ".join(diffs)
        )
