"""The gRPC contracts: generated code is fresh, and the services read as the design says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from qwenserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2_grpc,
)

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_not_stale() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_every_stage_has_a_service() -> None:
    assert hasattr(tokenizer_pb2_grpc, "TokenizerServicer")
    assert hasattr(prefill_pb2_grpc, "PrefillServicer")
    assert hasattr(decode_pb2_grpc, "DecodeServicer")
    assert hasattr(router_pb2_grpc, "RouterServicer")


def test_generate_is_server_streaming_and_accepts_three_inputs() -> None:
    method = router_pb2.DESCRIPTOR.services_by_name["Router"].methods_by_name["Generate"]
    assert method.server_streaming and not method.client_streaming
    oneof = router_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert {f.name for f in oneof.fields} == {"prompt", "chat", "prompt_token_ids"}


def test_removed_fields_stay_reserved() -> None:
    # `n` was removed from GenerateRequest; its number must never be reused.
    text = (ROOT / "proto" / "qwenserve" / "v1" / "router.proto").read_text()
    assert "reserved 10;" in text and 'reserved "n";' in text


def test_empty_sampling_params_mean_defaults() -> None:
    params = common_pb2.SamplingParams()
    assert not params.HasField("temperature") and not params.HasField("max_tokens")
