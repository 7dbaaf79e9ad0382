"""The one KV layout: its wire form round-trips, and the one check names what differs, ignoring block size."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qwenserve.engine.errors import RequestError
from qwenserve.engine.kv_handoff import KVImport
from qwenserve.kv_layout import KVLayout, KVLayoutMismatch
from qwenserve.protocol import kv_layout_from_proto, kv_layout_to_proto
from qwenserve.v1 import common_pb2

LAYOUT = KVLayout("bfloat16", 16, 2, 4, 32, "fp-1")


def test_a_layout_survives_the_wire_unchanged() -> None:
    message = kv_layout_to_proto(LAYOUT)
    assert isinstance(message, common_pb2.KVLayout)
    assert kv_layout_from_proto(common_pb2.KVLayout.FromString(message.SerializeToString())) == LAYOUT


def test_a_wire_layout_that_describes_no_kv_is_refused_with_the_field_at_fault() -> None:
    no_heads = kv_layout_to_proto(LAYOUT)
    no_heads.num_kv_heads = 0
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_layout_from_proto(no_heads)
    with pytest.raises(ValueError, match="int8"):
        kv_layout_from_proto(common_pb2.KVLayout(dtype="int8", num_layers=2, num_kv_heads=4, head_dim=32))


def test_the_check_names_every_field_that_differs_and_ignores_the_block_size() -> None:
    LAYOUT.check_accepts(dataclasses.replace(LAYOUT, block_size=64))
    other = dataclasses.replace(LAYOUT, model_fingerprint="fp-2", head_dim=64)
    with pytest.raises(KVLayoutMismatch, match="handoff h1 does not fit here") as refused:
        LAYOUT.check_accepts(other, "handoff h1")
    assert "model_fingerprint: got 'fp-2', need 'fp-1'" in str(refused.value)
    assert "head_dim: got 64, need 32" in str(refused.value)
    # The engine refuses the request that brings such KV: a client's error at a worker's edge.
    offered = KVImport(torch.zeros(other.token_shape(1), dtype=torch.bfloat16), other)
    with pytest.raises(KVLayoutMismatch, match="head_dim: got 64, need 32") as refused_by_engine:
        offered.check_fits(LAYOUT, 4)
    assert isinstance(refused_by_engine.value, RequestError)
