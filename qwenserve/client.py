"""`qwen-serve generate "prompt"`: stream an answer from a running router over gRPC."""

from __future__ import annotations

import os
import sys

import grpc

from qwenserve.flags import StrictParser
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc


def main(argv: list[str]) -> int:
    """Print the streamed text as it arrives, then the finish reason and usage on stderr."""
    parser = StrictParser(prog="qwen-serve generate", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--router", default=os.environ.get("QWENSERVE_ROUTER", "127.0.0.1:50050"))
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--api-key", default=os.environ.get("QWENSERVE_API_KEY"))
    args = parser.parse_args(argv)

    request = router_pb2.GenerateRequest(stop=args.stop)
    if args.raw:
        request.prompt = args.prompt
    else:
        request.chat.messages.add(role="user", content=args.prompt)
        request.chat.add_generation_prompt = True
    request.sampling.max_tokens = args.max_tokens
    request.sampling.temperature = args.temperature
    if args.seed is not None:
        request.sampling.seed = args.seed
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    with grpc.insecure_channel(args.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        try:
            for msg in stub.Generate(request, metadata=metadata):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    reason = common_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
                    detail = f" ({msg.error.code}: {msg.error.message})" if msg.HasField("error") else ""
                    print(f"\n[finish={reason}{detail} prompt={msg.usage.prompt_tokens} "
                          f"completion={msg.usage.completion_tokens} cached={msg.usage.cached_prompt_tokens}]",
                          file=sys.stderr)
                    return 0 if msg.finish_reason != common_pb2.FINISH_REASON_ERROR else 1
        except grpc.RpcError as e:
            print(f"\nqwen-serve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print("\nqwen-serve generate: the stream ended without a finish reason", file=sys.stderr)
    return 1
