"""A prefill-like exporter process for the cross-process tests (not a test module).

    python exporter_process.py SEGMENT_PREFIX NUM_TOKENS SEED

Serves KVTransfer on loopback, exports NUM_TOKENS tokens of deterministic KV over shared memory,
prints the handle (base64 of the proto) on one line, then waits for "quit" on stdin and prints
its counters as JSON before exiting.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sys

import grpc
import torch

from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVLayout, add_kv_transfer_service

LAYOUT = KVLayout("float16", 16, 2, 2, 8, "fp-test")


def deterministic_kv(num_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.token_shape(num_tokens), generator=generator).to(LAYOUT.torch_dtype())


async def main(prefix: str, num_tokens: int, seed: int) -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    exporter = KVExporter(
        ExporterConfig(control_endpoint=f"127.0.0.1:{port}", segment_prefix=prefix, pool_bytes=1 << 20)
    ).start()
    add_kv_transfer_service(server, exporter)
    await server.start()
    slot = exporter.reserve("cross-process", LAYOUT, num_tokens)
    slot.tensor.copy_(deterministic_kv(num_tokens, seed))
    handle = slot.publish(lease_s=60)
    print(base64.b64encode(handle.SerializeToString()).decode(), flush=True)
    while (await asyncio.to_thread(sys.stdin.readline)).strip() != "quit":
        pass
    await server.stop(grace=None)
    print(json.dumps(dataclasses.asdict(exporter.counters())), flush=True)
    exporter.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
