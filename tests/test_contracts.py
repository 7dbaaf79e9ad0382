"""The gRPC contracts: generated code is fresh, and the services read as the design says."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2

from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_not_stale() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


class Echo(router_pb2_grpc.RouterServicer):
    """Answers Generate with two messages: which input arrived, then the end."""

    async def Generate(  # noqa: N802 - the RPC's name
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        yield router_pb2.GenerateResponse(text=request.WhichOneof("input") or "")
        yield router_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)


async def test_generate_streams_its_answer_for_each_of_three_inputs() -> None:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            requests = [router_pb2.GenerateRequest(prompt="hi"),
                        router_pb2.GenerateRequest(chat=common_pb2.ChatInput()),
                        router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1, 2]))]
            for request in requests:
                answer = [message async for message in stub.Generate(request)]
                assert [m.text for m in answer] == [request.WhichOneof("input"), ""]
                assert answer[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        await server.stop(None)
    # The inputs are alternatives: giving one drops another.
    request = router_pb2.GenerateRequest(prompt="hi")
    request.prompt_token_ids.ids.append(1)
    assert request.WhichOneof("input") == "prompt_token_ids" and not request.prompt


def test_removed_fields_stay_reserved() -> None:
    # `n` (10) was removed from GenerateRequest: the generated code keeps it reserved, and an old client's value
    # parses as an unknown field, never as some newer field's.
    proto = descriptor_pb2.FileDescriptorProto.FromString(router_pb2.DESCRIPTOR.serialized_pb)
    message = next(m for m in proto.message_type if m.name == "GenerateRequest")
    assert any(r.start <= 10 < r.end for r in message.reserved_range) and "n" in message.reserved_name
    old = router_pb2.GenerateRequest.FromString(b"\x50\x02")  # field 10, varint 2
    assert old.ListFields() == [] and old.SerializeToString() == b"\x50\x02"  # kept, set nothing


def test_empty_sampling_params_mean_defaults() -> None:
    params = common_pb2.SamplingParams()
    assert not params.HasField("temperature") and not params.HasField("max_tokens")
