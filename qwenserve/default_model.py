"""The built-in default model: a small, randomly initialised Qwen3 checkpoint with the real Qwen vocabulary.

Written once into the user's cache folder, with the same bytes every time, so that the whole
serving path runs with nothing downloaded. `write_checkpoint` writes a checkpoint of any Qwen2 /
Qwen3 / Qwen3-MoE shape, which is what tests use to make their own tiny models.

CLI: `qwen-serve model init [--dir DIR]` writes it, `qwen-serve model path` prints where it is;
`qwen-serve model fetch SOURCE --dir DIR` puts another checkpoint into a folder (`model_fetch.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from qwenserve import progress
from qwenserve.cache import cache_root
from qwenserve.flags import StrictParser
from qwenserve.tokenizer import builtin

DEFAULT_MODEL_NAME = "qwen3-tiny-random-v1"
DEFAULT_SEED = 0

# Small enough to run fast on a CPU, shaped like a real Qwen3 (head_dim independent of hidden size).
DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
    "use_cache": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "float32",
}

# The smallest shape that still exercises GQA and the real vocabulary: for tests and benchmarks that need many
# processes or many requests, where the default model would be the bottleneck.
TINY_CONFIG: dict[str, Any] = {
    **DEFAULT_CONFIG,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_window_layers": 2,
}

# Qwen3-0.6B's shape (28 layers, GQA 16/8, head_dim 128): random weights of a realistic size, for tests and
# benchmarks whose behaviour depends on it (a 2k-token prompt's KV is ~470 MB in fp32, larger than a handoff pool).
QWEN3_0_6B_CONFIG: dict[str, Any] = {
    **DEFAULT_CONFIG,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_window_layers": 28,
    "max_position_embeddings": 40960,
}

GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
}


def _tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight a transformers `Qwen2/Qwen3/Qwen3Moe ForCausalLM` checkpoint holds, with its shape."""
    model_type = config.get("model_type", "qwen3")
    if model_type not in ("qwen2", "qwen3", "qwen3_moe"):
        raise ValueError(f"cannot write a {model_type!r} checkpoint; supported: qwen2, qwen3, qwen3_moe")
    hidden = config["hidden_size"]
    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    attention_bias = config.get("attention_bias", model_type == "qwen2")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if attention_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (heads * head_dim,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv_heads * head_dim,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv_heads * head_dim,)
        if model_type in ("qwen3", "qwen3_moe"):
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        if model_type == "qwen3_moe" and _is_sparse_layer(config, i):
            experts, inter = config["num_experts"], config["moe_intermediate_size"]
            shapes[f"{p}.mlp.gate.weight"] = (experts, hidden)
            for e in range(experts):
                shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
                shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
        else:
            inter = config["intermediate_size"]
            shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
            shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
            shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _is_sparse_layer(config: dict[str, Any], layer: int) -> bool:
    step = config.get("decoder_sparse_step", 1)
    return (
        layer not in config.get("mlp_only_layers", [])
        and config.get("num_experts", 0) > 0
        and (layer + 1) % step == 0
    )


def random_weights(
    config: dict[str, Any], seed: int = DEFAULT_SEED, dtype: str = "float32",
    step: progress.ProgressStep | None = None,
) -> dict[str, Any]:
    """Random weights for `config`, the same for the same seed on every machine; each tensor counted on `step`.

    Each tensor draws from its own generator seeded by (seed, name), so adding a layer does not
    change the others. Norm weights are 1 plus noise so that a missing norm shows in a reference test.
    """
    import torch

    std = float(config.get("initializer_range", 0.02))
    weights: dict[str, Any] = {}
    shapes = _tensor_shapes(config)
    if step is not None:
        itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        step.expect(len(shapes), sum(math.prod(shape) for shape in shapes.values()) * itemsize)
    for name, shape in shapes.items():
        generator = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8])
        )
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        tensor = 1.0 + 0.1 * noise if name.endswith("norm.weight") else noise * std
        weights[name] = tensor.to(getattr(torch, dtype)).contiguous()
        if step is not None:
            step.advance(1, weights[name].nbytes)
    return weights


def _json_bytes(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_checkpoint(
    path: str | Path,
    config: dict[str, Any],
    seed: int = DEFAULT_SEED,
    dtype: str = "float32",
    vocab: builtin.BuiltinVocab | None = None,
    generation_config: dict[str, Any] | None = None,
    step: progress.ProgressStep | None = None,
) -> Path:
    """Write a complete checkpoint folder: config, random safetensors weights and the real Qwen tokenizer.

    `config` is a transformers config dict (`model_type` qwen2, qwen3 or qwen3_moe); `dtype` is
    "float32", "bfloat16" or "float16". The vocabulary defaults to the one `vocab_size` fits.
    Same arguments, same bytes. Returns `path`. The tensors drawn are counted on `step`.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = vocab or vocab_for(config)
    tokens = vocab.value.num_ranks + len(vocab.value.added_tokens)
    if config["vocab_size"] < tokens:
        raise ValueError(
            f"vocab_size {config['vocab_size']} is smaller than the {tokens} tokens of {vocab.value.name}"
        )
    full_config = {**config, "torch_dtype": dtype}
    save_file(
        random_weights(full_config, seed, dtype, step), str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_bytes(_json_bytes(full_config))
    (path / "generation_config.json").write_bytes(_json_bytes(generation_config or GENERATION_CONFIG))
    shutil.copyfile(builtin.builtin_tokenizer_json(vocab), path / "tokenizer.json")
    (path / "tokenizer_config.json").write_bytes(_json_bytes(builtin.tokenizer_config(vocab)))
    return path


def vocab_for(config: dict[str, Any]) -> builtin.BuiltinVocab:
    """The built-in vocabulary a checkpoint of `config` gets: the larger one where `vocab_size` holds it."""
    big = builtin.BuiltinVocab.QWEN3_5
    return big if config["vocab_size"] >= big.value.num_ranks else builtin.BuiltinVocab.QWEN3


def write_default_model(path: Path, where: str) -> Path:
    """Write the default checkpoint into `path`, reporting progress as "writing the default model `where`"."""
    vocab = vocab_for(DEFAULT_CONFIG)
    builtin.builtin_tokenizer_json(vocab)  # converted first, as a step of its own rather than inside this one
    with progress.step(f"writing the default model {where}", unit="tensors") as step:
        return write_checkpoint(path, DEFAULT_CONFIG, DEFAULT_SEED, vocab=vocab, step=step)


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the default model lives (written or not)."""
    return (cache_dir or cache_root()) / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The default model's folder, writing it first if it is not there yet. Safe to race."""
    target = default_model_dir(cache_dir)
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place: readers never see half a checkpoint.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        write_default_model(staging, f"{DEFAULT_MODEL_NAME} (once per machine)")
        os.rename(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_parser() -> StrictParser:
    """`qwen-serve model`'s parser (the operator's fetch-model init container runs `model fetch`)."""
    parser = StrictParser(prog="qwen-serve model", description="the built-in default checkpoint")
    sub = parser.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="write the default checkpoint (once) and print its folder")
    init.add_argument(
        "--dir", type=Path, help="write into this folder instead of the cache (always rewrites)"
    )
    sub.add_parser("path", help="print the default checkpoint's folder (written or not)")
    fetch_parser = sub.add_parser("fetch", help="put a checkpoint (hf://org/name, file:///path) into a folder")
    fetch_parser.add_argument("source", help="hf://org/name (token: HF_TOKEN), file:///path or a folder")
    fetch_parser.add_argument("--dir", type=Path, required=True, help="the folder to fill")
    fetch_parser.add_argument("--revision", default=None, help="branch, tag or commit (hf:// only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`qwen-serve model init [--dir DIR]`, `qwen-serve model path` and `qwen-serve model fetch SOURCE --dir DIR`."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.action == "path":
        print(default_model_dir())
        return 0
    if args.action == "fetch":
        from qwenserve.model_fetch import FetchError, fetch
        from qwenserve.preflight import one_line

        try:
            print(fetch(args.source, args.dir, args.revision))
        except FetchError as e:
            print(f"qwen-serve model fetch: {one_line(e)}", file=sys.stderr)
            return 1
        return 0
    folder = write_default_model(args.dir, f"into {args.dir}") if args.dir else ensure_default_model()
    print(folder)
    return 0
