"""Tokenizer throughput: in-process encode against tiktoken, and the gRPC service, unary and batched.

    .venv/bin/python bench/tokenizer_bench.py [--texts 2000] [--batch 256]

Targets (issue 2): in-process within 1.2x of tiktoken; >= 20,000 texts/s through the service with
batching; unary p50 < 1 ms on loopback. Prints every figure and the ratio to its baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import time

import grpc

from qwenserve.tokenizer import BuiltinVocab, Tokenizer
from qwenserve.tokenizer.builtin import tiktoken_encoding
from qwenserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc

WORDS = (
    "the model serves requests over gRPC while the router keeps the prefix cache warm and decode "
    "workers stream tokens back to clients 你好 世界 模型 推理 こんにちは 42 3.14 (x) {y} -- ok! "
).split()


def make_texts(n: int, rng: random.Random, tokenizer: Tokenizer) -> list[str]:
    """Texts of about 100 tokens each."""
    texts = []
    for _ in range(n):
        words: list[str] = []
        while tokenizer.count(" ".join(words)) < 100:
            words.append(rng.choice(WORDS))
        texts.append(" ".join(words))
    return texts


def best_of(repeats: int, fn) -> float:
    """Fastest wall time of `repeats` runs (the least disturbed by the other tenants of the machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_in_process(texts: list[str], tokenizer: Tokenizer) -> None:
    reference = tiktoken_encoding(BuiltinVocab.QWEN3)
    specials = set(tokenizer.special_tokens)
    tokens = sum(len(reference.encode(t, allowed_special=specials)) for t in texts)
    assert [reference.encode(t, allowed_special=specials) for t in texts] == tokenizer.encode_batch(texts)
    t_ref = best_of(5, lambda: [reference.encode(t, allowed_special=specials) for t in texts])
    t_ours = best_of(5, lambda: [tokenizer.encode(t) for t in texts])
    t_batch = best_of(5, lambda: tokenizer.encode_batch(texts))
    from tokenizers import Tokenizer as HFTokenizer

    from qwenserve.tokenizer import builtin_tokenizer_json

    hf = HFTokenizer.from_file(str(builtin_tokenizer_json(BuiltinVocab.QWEN3)))
    t_hf = best_of(5, lambda: [hf.encode(t, add_special_tokens=False).ids for t in texts])
    print(f"in-process, {len(texts)} texts, {tokens / len(texts):.0f} tokens each")
    print(f"  tiktoken encode (baseline)   {tokens / t_ref:>12,.0f} tokens/s")
    print(
        f"  Tokenizer.encode             {tokens / t_ours:>12,.0f} tokens/s   {t_ours / t_ref:.2f}x tiktoken's time"
    )
    print(f"  Tokenizer.encode_batch       {tokens / t_batch:>12,.0f} tokens/s   {t_batch / t_ref:.2f}x")
    print(f"  tokenizers (HF) encode       {tokens / t_hf:>12,.0f} tokens/s   {t_hf / t_ref:.2f}x")


def start_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve_services.tokenizer.server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    match = re.search(r":(\d+)$", proc.stdout.readline().strip())
    assert match, "the tokenizer service did not start"
    return proc, int(match.group(1))


async def bench_service(texts: list[str], batch: int, port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        requests = [tokenizer_pb2.TokenizeRequest(text=t) for t in texts]
        for r in requests[:200]:
            await stub.Tokenize(r)  # warm the connection and the server
        latencies = []
        start = time.perf_counter()
        for r in requests:
            t0 = time.perf_counter()
            await stub.Tokenize(r)
            latencies.append(time.perf_counter() - t0)
        unary_s = time.perf_counter() - start
        latencies.sort()
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]

        async def concurrent_unary(n_clients: int) -> float:
            async def client(part: list) -> None:
                for r in part:
                    await stub.Tokenize(r)

            t0 = time.perf_counter()
            await asyncio.gather(*(client(requests[i::n_clients]) for i in range(n_clients)))
            return len(requests) / (time.perf_counter() - t0)

        unary_concurrent = await concurrent_unary(16)
        batches = [
            tokenizer_pb2.TokenizeBatchRequest(requests=requests[i : i + batch])
            for i in range(0, len(requests), batch)
        ]

        async def batched(in_flight: int) -> float:
            rounds = []
            for _ in range(3):
                t0 = time.perf_counter()
                for i in range(0, len(batches), in_flight):
                    await asyncio.gather(*(stub.TokenizeBatch(b) for b in batches[i : i + in_flight]))
                rounds.append(time.perf_counter() - t0)
            return len(requests) / min(rounds)

        sequential, pipelined = await batched(1), await batched(4)
        count_rounds = []
        count_requests = [
            tokenizer_pb2.CountTokensRequest(texts=texts[i : i + batch]) for i in range(0, len(texts), batch)
        ]
        for _ in range(3):
            t0 = time.perf_counter()
            for c in count_requests:
                await stub.CountTokens(c)
            count_rounds.append(time.perf_counter() - t0)
        counts = len(texts) / min(count_rounds)
    unary_rate = len(requests) / unary_s
    print(f"gRPC service on loopback, {len(texts)} texts")
    print(
        f"  unary Tokenize, one at a time  {unary_rate:>10,.0f} texts/s   p50 {p50 * 1e3:.3f} ms   p99 {p99 * 1e3:.3f} ms"
    )
    print(
        f"  unary Tokenize, 16 in flight   {unary_concurrent:>10,.0f} texts/s   {unary_concurrent / unary_rate:.1f}x one at a time"
    )
    print(
        f"  TokenizeBatch x{batch}, 1 in flight {sequential:>10,.0f} texts/s   {sequential / unary_rate:.1f}x unary"
    )
    print(
        f"  TokenizeBatch x{batch}, 4 in flight {pipelined:>10,.0f} texts/s   {pipelined / unary_rate:.1f}x unary"
    )
    print(f"  CountTokens x{batch}               {counts:>10,.0f} texts/s   {counts / unary_rate:.1f}x unary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    tokenizer = Tokenizer.builtin(BuiltinVocab.QWEN3)
    texts = make_texts(args.texts, random.Random(0), tokenizer)
    bench_in_process(texts, tokenizer)
    proc, port = start_server()
    try:
        asyncio.run(bench_service(texts, args.batch, port))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
