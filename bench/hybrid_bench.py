"""Hybrid vs dense: a Qwen3.5-shaped hybrid model (Gated DeltaNet layers, full attention every 4th layer) against a
dense Qwen3 of the same hidden size, depth, heads and MLP, on the same engine in the same run.

Reported per model: decode tokens/s at several batch sizes (every request decoding, context `--context`), each
with the hybrid/dense ratio, and the bytes of one request's handoff from a prefill engine (published through a
KVExporter as a prefill worker does, the length its handle carries): KV for the full-attention layers per prompt
token, plus for the hybrid its linear-attention layers' constant state.

With --prefix, the hybrid's prefix caching (state snapshots every 256 tokens) against the same engine with it off
(--state-snapshot-tokens 0): the time to the first token of a request whose system prompt (`--system` tokens) an
earlier request already computed, what the snapshots cost a cold prompt (its prefill chunks end at every
boundary), and the memory one snapshot takes.

    .venv/bin/python bench/hybrid_bench.py                   # 0.6B-like depth/width (slow on 2 cores)
    .venv/bin/python bench/hybrid_bench.py --small           # a quick shape
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engine_bench import decode_step_seconds  # noqa: E402

from qwenserve.engine.config import EngineConfig  # noqa: E402
from qwenserve.engine.engine import LLMEngine  # noqa: E402
from qwenserve.engine.sampling_params import SamplingParams  # noqa: E402
from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVTransport  # noqa: E402

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, vocab_size=8192, linear_num_key_heads=4,
                  linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32),
}
DENSE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size")


def make_checkpoints(shape: str) -> dict[str, Path]:
    """A random dense Qwen3 and hybrid Qwen3.5 (text) of `shape`, written once under /tmp."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    spec = SHAPES[shape]
    configs = {
        "dense": Qwen3Config(max_position_embeddings=4096, tie_word_embeddings=True,
                             **{k: spec[k] for k in DENSE_KEYS}),
        "hybrid": Qwen3_5TextConfig(max_position_embeddings=4096, tie_word_embeddings=True, full_attention_interval=4,
                                    linear_conv_kernel_dim=4, **spec),
    }
    folders = {}
    for name, config in configs.items():
        folder = Path(f"/tmp/qwenserve-bench/hybrid-{shape}-{name}")
        if not (folder / "config.json").is_file():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        folders[name] = folder
    return folders


def handoff_bytes(engine: LLMEngine, prompt_tokens: int) -> int:
    """The length of the handoff a prefill of `prompt_tokens` tokens publishes (its KV, and state if hybrid)."""
    config = ExporterConfig(transport=KVTransport.KV_TRANSPORT_GRPC, control_endpoint="127.0.0.1:1", use_shm=False,
                            pool_bytes=1 << 20, prefault=False)
    with KVExporter(config) as exporter:
        slots = []

        def sink(layout: object, num_tokens: int) -> object:
            slots.append(exporter.reserve("bench", layout, num_tokens))
            return slots[-1]

        prompt = [(7919 * i) % 8000 + 10 for i in range(prompt_tokens)]
        engine.generate_sync([prompt], SamplingParams(max_tokens=2, ignore_eos=True), kv_export=sink)
        handle = slots[0].publish(lease_s=5)
        exporter.release("bench")
        return handle.length


def prefix_caching(folder: Path, system_tokens: int, questions: int = 4) -> None:
    """TTFT of questions sharing a system prompt, snapshots on vs off, and a cold prompt's cost of them."""
    system = [(7919 * i) % 8000 + 10 for i in range(system_tokens)]
    asks = [system + [(104_729 * q + 31 * i) % 8000 + 10 for i in range(48)] for q in range(questions + 1)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seconds: dict[int, tuple[float, float]] = {}
    for snapshot_tokens in (0, 256):
        engine = LLMEngine.from_pretrained(folder, EngineConfig(dtype="float32", kv_cache_memory_gb=4.0,
                                                                state_snapshot_tokens=snapshot_tokens))
        try:
            engine.generate_sync([[(13 * i) % 8000 + 10 for i in range(system_tokens)]], one)  # warms the engine up
            started = time.perf_counter()
            engine.generate_sync(asks[:1], one)  # cold: computes (and keeps) the system prompt
            cold = time.perf_counter() - started
            warm = []
            for ask in asks[1:]:
                started = time.perf_counter()
                outs = engine.generate_sync_outputs([ask], one)[0]
                warm.append(time.perf_counter() - started)
            seconds[snapshot_tokens] = (cold, statistics.median(warm))
            snapshots = engine.scheduler.snapshots
            kept = "" if snapshots is None else (
                f", {len(snapshots)} snapshots of {snapshots.storage.nbytes / snapshots.capacity / 2**20:.1f} MiB kept")
            print(f"snapshots {'every 256' if snapshot_tokens else 'off':>9}: cold prompt {cold:6.2f} s, warm TTFT "
                  f"{seconds[snapshot_tokens][1]:6.2f} s (cached {outs[-1].usage.cached_prompt_tokens} of "
                  f"{len(asks[1])} tokens){kept}")
        finally:
            engine.shutdown()
    (cold_off, warm_off), (cold_on, warm_on) = seconds[0], seconds[256]
    print(f"a {system_tokens}-token system prompt: warm TTFT off/on {warm_off / warm_on:5.2f}x; the cold prompt "
          f"with snapshots takes {cold_on / cold_off:5.2f}x its time without")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a quick shape instead of the 0.6B-like one")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding request")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prefix", action="store_true", help="measure the hybrid's prefix caching instead")
    parser.add_argument("--system", type=int, default=1024, help="--prefix: tokens of the shared system prompt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folders = make_checkpoints("small" if args.small else "0.6b")
    if args.prefix:
        prefix_caching(folders["hybrid"], args.system)
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[str, dict[int, float]] = {}
    sent: dict[tuple[str, int], int] = {}
    for name, folder in folders.items():
        engine = LLMEngine.from_pretrained(folder, EngineConfig(dtype="float32", max_num_seqs=max(batches),
                                                                kv_cache_memory_gb=4.0))
        try:
            rates[name] = {b: b / decode_step_seconds(engine, b, context=args.context) for b in batches}
            for tokens in (args.context, 4 * args.context):
                sent[name, tokens] = handoff_bytes(engine, tokens)
                layout = engine.kv_layout()
                print(f"{name:>6}: a {tokens}-token prompt's handoff is {sent[name, tokens] / 2**20:8.2f} MiB (KV of "
                      f"{layout.num_layers} full-attention layers"
                      + (f", plus {layout.state_nbytes / 2**20:.2f} MiB of linear-attention state)"
                         if layout.has_linear_state else ")"))
        finally:
            engine.shutdown()
    for b in batches:
        dense, hybrid = rates["dense"][b], rates["hybrid"][b]
        print(f"batch {b:>3}: decode dense {dense:8.1f} tok/s  hybrid {hybrid:8.1f} tok/s  hybrid/dense "
              f"{hybrid / dense:5.2f}")
    for tokens in (args.context, 4 * args.context):
        print(f"handoff of a {tokens}-token prompt: hybrid/dense bytes {sent['hybrid', tokens] / sent['dense', tokens]:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
