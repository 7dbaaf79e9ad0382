"""Fixtures for engine tests: tiny checkpoints on disk, cached transformers references, and engines that
are checked for leaked KV blocks after every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from tests.support.engine_checkpoints import SPECS, load_reference, reference_greedy, write_checkpoint

# Hand-written transformers-4.x style configs (as found on the hub) for the same weights.
CONFIG_4X: dict[str, dict] = {
    "qwen2_linear_4x": {
        "spec": "qwen2_bias",
        "config": {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0}, "tie_word_embeddings": False,
            "use_sliding_window": False, "hidden_act": "silu", "torch_dtype": "float32",
            "transformers_version": "4.43.1",
        },
    },
    "qwen3_yarn_4x": {
        "spec": "qwen3_gqa4",
        "config": {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
            "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
            "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        },
    },
    "qwen3_moe_4x": {
        "spec": "qwen3_moe",
        "config": {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
            "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
            "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [1], "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "rope_scaling": None, "tie_word_embeddings": False, "hidden_act": "silu",
            "transformers_version": "4.51.0",
        },
    },
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """checkpoint(name) -> folder of a tiny random checkpoint (names: SPECS and CONFIG_4X keys)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name in CONFIG_4X:
                entry = CONFIG_4X[name]
                write_checkpoint(folder, SPECS[entry["spec"]], config_override=entry["config"])
            else:
                write_checkpoint(folder, SPECS[name])
            made[name] = folder
        return made[name]

    return get


@pytest.fixture(scope="session")
def reference(checkpoint: Callable[[str], Path]) -> Callable[[str, list[int], int], tuple[list[int], object]]:
    """reference(name, prompt, n) -> transformers' greedy tokens and logits, computed once per session."""
    models: dict[str, object] = {}
    results: dict[tuple, tuple] = {}

    def get(name: str, prompt: list[int], n: int) -> tuple[list[int], object]:
        key = (name, tuple(prompt), n)
        if key not in results:
            if name not in models:
                models[name] = load_reference(checkpoint(name))
            results[key] = reference_greedy(models[name], prompt, n)
        return results[key]

    return get


@pytest.fixture
def make_engine(checkpoint: Callable[[str], Path]) -> Iterator[Callable[..., LLMEngine]]:
    """make_engine(name, **EngineConfig fields) -> a running engine; after the test every engine must be
    idle with zero KV blocks in use, then it is shut down. fp32 throughout unless a test asks otherwise: the
    exactness tests compare with transformers in fp32 (`--dtype auto` has tests of its own)."""
    engines: list[LLMEngine] = []

    def make(name: str, **overrides: object) -> LLMEngine:
        settings = dict(num_kv_blocks=128, block_size=8, max_num_batched_tokens=256, num_threads=2, dtype="float32")
        settings.update(overrides)
        engine = LLMEngine.from_pretrained(checkpoint(name), EngineConfig(**settings))
        engines.append(engine)
        return engine

    yield make
    try:
        for engine in engines:
            assert engine.wait_until_idle(timeout=30), "engine still busy after the test"
            stats = engine.stats()
            assert stats.kv_blocks_used == 0, f"{stats.kv_blocks_used} KV blocks leaked"
            assert stats.running == 0 and stats.waiting == 0
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.fixture(scope="session")
def variant_kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CpuKernels]:
    """Every C-kernel variant this CPU runs (AVX-512, AVX2, baseline x86-64), each opened by name, so a kernel is
    tested at every instruction-set level here, not only the one loaded: the prebuilt objects where every one of
    them is there (named by the sources' digest, so built from these sources: scripts/setup.sh builds them), else
    built into a folder of their own. Building them took ~60 s of the two cores on each pytest-xdist worker that
    used them; the build itself is test_cpu_kernels.py's."""
    supported = builder.supported_variants()
    if all(builder.variant_path(variant).is_file() for variant in supported):
        folder, built = builder.kernel_dir(), {builder.variant_path(variant) for variant in supported}
    else:
        folder = tmp_path_factory.mktemp("variants")
        built = set(builder.build_variants(folder))
    opened = {}
    for variant in supported:
        path = builder.variant_path(variant, folder)
        assert path in built, f"{variant.name} did not build"
        lib = loader._open(path, "test")
        assert lib is not None, f"{variant.name} did not load"
        opened[variant.name] = CpuKernels(lib, variant.name)
    return opened
