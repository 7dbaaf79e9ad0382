"""The C kernels on CPU: equal to the PyTorch paths they replace, built per instruction set ahead of
use, and optional (loudly)."""

from __future__ import annotations

import ctypes
import logging
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PackedWeight, packable
from qwenserve.engine.attention.torch_backend import TorchAttentionBackend
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.kernels import select_kernels
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models.forward_context import AttentionBatch
from qwenserve.models.gated_delta import recurrent_gated_delta_step
from qwenserve.models.ops import TORCH_OPS, cpu_kernel_ops

# Where scripts/setup.sh built the variants (read before any test points $QWENSERVE_CPU_KERNEL_DIR elsewhere).
INSTALLED = builder.kernel_dir()

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the kernels cannot be built here")


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """load() re-run against an empty cache folder and no prebuilt objects, and its cached answer restored
    afterwards."""
    monkeypatch.setenv("QWENSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("QWENSERVE_CPU_KERNEL_DIR", str(tmp_path / "prebuilt"))
    loader.load.cache_clear()
    yield
    monkeypatch.undo()
    loader.load.cache_clear()


@pytest.fixture
def kernels() -> CpuKernels:
    """This process's kernels (built here when no object was built at install time)."""
    loaded = loader.load()
    assert loaded is not None
    return loaded


@needs_compiler
def test_kernels_build_on_this_machine() -> None:
    assert loader.load() is not None


@needs_compiler
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(16, 8, 128, 16), (8, 2, 36, 4), (4, 4, 64, 16),
                                                                      (12, 3, 8, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_equals_gather_and_sdpa(heads: int, kv_heads: int, dim: int, block_size: int,
                                             threads: int, kernels: CpuKernels) -> None:
    """Scattered blocks, lengths that end mid-block (and a context of one), GQA ratios 1-4, head dims with a
    tail that is not a multiple of the vector width; the kernel writes only the decode rows."""
    gen = torch.Generator().manual_seed(heads * dim + block_size)
    num_blocks, lens = 64, [1, block_size, 3 * block_size + 1, 37, 5]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-n // block_size)].tolist() for n in lens]
    q = torch.randn(len(lens), heads, dim, generator=gen)
    outs = []
    for use_kernel in (True, False):
        backend = TorchAttentionBackend(block_size, kernels if use_kernel else None)
        batch = AttentionBatch(query_lens=[1] * len(lens), context_lens=lens, block_tables=tables,
                               slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(lens))
        meta = backend.prepare(batch, torch.device("cpu"))
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(backend.forward(q, q[:0, :kv_heads], q[:0, :kv_heads], k_cache, v_cache, meta))
        finally:
            torch.set_num_threads(previous)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 17, 64, 130])
@pytest.mark.parametrize(("k", "n"), [(64, 16), (37, 48), (1000, 80), (1024, 4096)])
def test_linear_packed_equals_linear(rows: int, k: int, n: int, kernels: CpuKernels) -> None:
    """Row tails of the 6-row tile, panel tails of the 4-panel tile (1, 3, 5 panels), odd k; at k <= 512 and
    up to 16 rows the one-panel tiles of up to 12 rows (one and two passes); above it, 7 to 15 rows in the two-panel
    tiles of up to 12 rows (one and two passes)."""
    gen = torch.Generator().manual_seed(rows * k + n + 1)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = PackedWeight.pack(w)
    assert packed.panels.shape == (n // 16, k, 16) and packed.shape == (n, k)
    ops = cpu_kernel_ops(kernels, torch.float32)
    torch.testing.assert_close(kernels.linear_packed(x, packed), F.linear(x, w), rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(ops.linear(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=2e-4)
    # Leading dimensions are flattened and restored, as F.linear does.
    x3 = x.reshape(1, rows, k)
    torch.testing.assert_close(ops.linear(x3, packed), F.linear(x3, w), rtol=1e-4, atol=2e-4)


def test_packed_weights_keep_every_row_and_refuse_what_cannot_be_packed() -> None:
    from qwenserve.models.ops import _packed_embedding

    experts = torch.randn(3, 32, 24)  # stacked MoE experts: each packs on its own
    packed = PackedWeight.pack(experts)
    assert packed.panels.shape == (3, 2, 24, 16) and packed.shape == (3, 32, 24)
    assert torch.equal(packed[1].panels, PackedWeight.pack(experts[1]).panels)
    # Row v is column v % 16 of panel v // 16: the embeddings of a tied, packed LM head.
    ids = torch.tensor([0, 21, 31, 5])
    assert torch.equal(packed[2].rows(ids), experts[2][ids])
    assert torch.equal(_packed_embedding(torch.float32, packed[2], ids), TORCH_OPS.embedding(experts[2], ids))
    for weight in (torch.randn(24, 8), torch.randn(32, 8, dtype=torch.float64)):
        assert not packable(weight)
        with pytest.raises(ValueError, match="multiple of 16"):
            PackedWeight.pack(weight)


@needs_compiler
def test_a_block_id_outside_the_cache_is_an_error_not_a_read(kernels: CpuKernels) -> None:
    """A scheduler bug (a freed or made-up block id, or a table shorter than its context) must raise before
    the kernel reads anything, not read past the cache."""
    k_cache = v_cache = torch.randn(4, 2, 1, 8)
    q, out = torch.randn(1, 2, 8), torch.zeros(1, 2, 8)
    for table, length in (([0, 4], 3), ([-1], 1), ([1, 2**40], 4), ([0], 3)):
        with pytest.raises(IndexError, match="outside"):
            kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor([table]), torch.tensor([length]),
                                           out, 0.5)
        assert not out.any()
    kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor([[3, 0]]), torch.tensor([3]), out, 0.5)
    assert out.any()


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 instruction-set variants")
def test_build_writes_every_variant_and_load_opens_the_best_this_cpu_runs(fresh_load: None, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """What the image build runs: one object per level, whatever this CPU is, so that a pod on any node finds
    one it can run and never compiles. Each level's packed product is checked here, where the CPU runs it
    (AVX2 has 16 vector registers and gets the narrow tiles, AVX-512 32 and the wide ones).

    The build checked is the one scripts/setup.sh ran (`python -m qwenserve.cpu_kernels build`, the objects named by
    these sources' digest) where it wrote every variant; the build is run here only where it did not: building all
    four again took ~90 s of a core in every `make test`."""
    from qwenserve.cpu_kernels.__main__ import main

    wanted = sorted(builder.variant_path(v, INSTALLED).name for v in builder.machine_variants())
    if all((INSTALLED / name).is_file() for name in wanted):
        folder = INSTALLED
        monkeypatch.setenv(builder.ENV_DIR, str(folder))
    else:
        folder = tmp_path / "prebuilt"
        assert main(["build"]) == 0
    built = sorted(path.name for path in folder.iterdir() if path.name.endswith(f"-{builder.source_digest()}.so"))
    assert built == wanted
    assert [v.name for v in builder.machine_variants()] == ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    gen = torch.Generator().manual_seed(16)
    for variant in builder.supported_variants():
        lib = ctypes.CDLL(str(builder.variant_path(variant)))
        lib.linear_packed.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
        for rows, k, n in [(1, 64, 16), (7, 37, 48), (33, 1024, 4096)]:
            x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
            y, packed = torch.empty(rows, n), PackedWeight.pack(w)  # held: its memory is not reused
            lib.linear_packed(x.data_ptr(), packed.panels.data_ptr(), y.data_ptr(), rows, k, n, 2)
            torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=2e-4)
    with caplog.at_level(logging.INFO, logger="qwenserve.cpu_kernels"):
        loaded = loader.load()
    best = builder.supported_variants()[0].name
    assert loaded is not None and loaded.variant == f"{best} (prebuilt)"
    assert "building" not in caplog.text  # nothing compiled at load
    assert not (tmp_path / "cache" / "kernels").exists()


@needs_compiler
def test_without_a_prebuilt_object_load_builds_one_and_says_so(fresh_load: None, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    loaded = loader.load()
    assert loaded is not None and loaded.variant == "-march=native (built at first use)"
    assert any(r.levelname == "WARNING" and "no prebuilt CPU kernels" in r.getMessage() for r in caplog.records)
    assert len(list((tmp_path / "cache" / "kernels").glob("*.so"))) == 1


@needs_compiler
def test_kernels_refuse_what_they_cannot_read(kernels: CpuKernels) -> None:
    with pytest.raises(ValueError, match="columns"):
        kernels.linear_packed(torch.randn(2, 8), PackedWeight.pack(torch.randn(16, 9)))
    with pytest.raises(ValueError, match="contiguous fp32"):
        kernels.linear_packed(torch.randn(8, 2).t(), PackedWeight.pack(torch.randn(16, 8)))
    with pytest.raises(ValueError, match="one packed matrix"):
        kernels.linear_packed(torch.randn(2, 8), PackedWeight.pack(torch.randn(2, 16, 8)))
    with pytest.raises(ValueError, match="inconsistent"):
        kernels.paged_decode_attention(torch.randn(1, 3, 8), torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8),
                                       torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                                       torch.empty(1, 3, 8), 0.5)
    # The kernels' ops take anything F.linear takes where a weight is not packed: transposed, other dtypes.
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    torch.testing.assert_close(cpu_kernel_ops(kernels, torch.float32).linear(x, w.t()), F.linear(x, w.t()))


def test_a_variant_built_from_these_sources_is_kept_and_force_builds_it_again(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """`build` at every `make test` (scripts/setup.sh) compiled all four variants again, ~50 s; `false` as the
    compiler shows that none is compiled where its object is there, and that --force tries."""
    for variant in builder.machine_variants():
        builder.variant_path(variant, tmp_path).write_bytes(b"built before")
    kept = builder.build_variants(tmp_path, cc="false")
    assert kept == [builder.variant_path(v, tmp_path) for v in builder.machine_variants()]
    assert all(path.read_bytes() == b"built before" for path in kept)
    with caplog.at_level(logging.WARNING, logger="qwenserve.cpu_kernels"):
        assert builder.build_variants(tmp_path, cc="false", force=True) == []
    assert "failed" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)  # no work folder left


def test_switched_off_by_the_config_says_so_and_loads_nothing(fresh_load: None, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    kernels = select_kernels(EngineConfig(cpu_kernel=False), cpu)
    assert kernels.cpu is None and kernels.ops is TORCH_OPS and kernels.attention.cpu_kernels is None
    assert [r.levelname for r in caplog.records if r.name == "qwenserve.engine"] == ["WARNING"]
    assert "--no-cpu-kernel" in caplog.text
    assert not (tmp_path / "cache" / "kernels").exists()  # nothing was built to be left unused


def test_the_switch_is_a_flag_with_the_documented_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """QWENSERVE_CPU_KERNEL=0 and QWENSERVE_LINEAR_ATTENTION_KERNELS=0 keep working: they are the flags'
    fallbacks now (--no-cpu-kernel, --no-linear-attention-kernels)."""
    from qwenserve.flags import StrictParser, add_options, config_from_env

    monkeypatch.setenv("QWENSERVE_CPU_KERNEL", "0")
    monkeypatch.setenv("QWENSERVE_LINEAR_ATTENTION_KERNELS", "off")
    config = config_from_env(EngineConfig)
    assert config.cpu_kernel is False and config.linear_attention_kernels is False
    parser = StrictParser(prog="test")
    add_options(parser, EngineConfig)
    assert parser.parse_config(EngineConfig, ["--cpu-kernel"]).cpu_kernel is True
    assert parser.parse_config(EngineConfig, []).linear_attention_kernels is False
    monkeypatch.delenv("QWENSERVE_CPU_KERNEL")
    parser = StrictParser(prog="test")
    add_options(parser, EngineConfig)
    assert parser.parse_config(EngineConfig, ["--no-cpu-kernel"]).cpu_kernel is False
    assert parser.parse_config(EngineConfig, []).cpu_kernel is True


def test_a_failing_compiler_leaves_the_portable_path(fresh_load: None, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: out of order' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    kernels = select_kernels(EngineConfig(), torch.device("cpu"))
    assert kernels.cpu is None and kernels.ops is TORCH_OPS
    assert "out of order" in caplog.text
    assert "CPU kernels unavailable" in caplog.text


@needs_compiler
def test_ops_are_chosen_for_the_device_and_dtype(kernels: CpuKernels) -> None:
    cpu = torch.device("cpu")
    chosen = select_kernels(EngineConfig(dtype="float32"), cpu)
    assert chosen.cpu is kernels and chosen.ops.name == "cpu_kernels" and chosen.attention.cpu_kernels is kernels
    assert chosen.ops.gated_delta_step == kernels.gated_delta_step
    # bf16: the bf16 panels' product (PyTorch's bf16 product from the rows where it wins) and the C kernel's
    # recurrent update (a hybrid model's state is fp32 in every dtype).
    bf16 = select_kernels(EngineConfig(dtype="bfloat16"), cpu).ops
    assert bf16.name.startswith("cpu_kernels+bf16_weights+bf16_activations") and bf16.linear is not TORCH_OPS.linear
    assert bf16.gated_delta_step == kernels.gated_delta_step
    # fp16: PyTorch's products (the panels hold fp32 or bf16).
    fp16 = select_kernels(EngineConfig(dtype="float16"), cpu).ops
    assert fp16.name == "torch+cpu_gated_delta" and fp16.linear is TORCH_OPS.linear
    assert select_kernels(EngineConfig(dtype="float32"), torch.device("meta")).ops is TORCH_OPS


@needs_compiler
@pytest.mark.parametrize(("heads", "dk", "dv"), [(16, 128, 128), (4, 16, 8), (3, 5, 13)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gated_delta_step_equals_the_pytorch_step(heads: int, dk: int, dv: int, threads: int,
                                                  kernels: CpuKernels) -> None:
    """Slots out of order with one left alone, head dims with a tail past the vector width, several steps in a row
    (each from the state the last one left)."""
    gen = torch.Generator().manual_seed(heads * dk + dv)
    batch, num_slots = 5, 8
    states = torch.randn(num_slots, heads, dk, dv, generator=gen) * 0.1
    expected = states.clone()
    slots = torch.tensor([6, 0, 3, 7, 1])
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            q, k = (F.normalize(torch.randn(batch, heads, dk, generator=gen), dim=-1) for _ in range(2))
            v = torch.randn(batch, heads, dv, generator=gen)
            g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
            want = recurrent_gated_delta_step(q, k, v, g, beta, expected, slots)
            got = kernels.gated_delta_step(q, k, v, g, beta, states, slots)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(states, expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(2)
    with pytest.raises(IndexError, match="slot is outside"):
        kernels.gated_delta_step(q, k, v, g, beta, states, torch.tensor([0, 1, 2, 3, num_slots]))
    with pytest.raises(ValueError, match="5 slots for a batch of 4"):
        kernels.gated_delta_step(q[:4], k[:4], v[:4], g[:4], beta[:4], states, slots)


@needs_compiler
def test_engine_tokens_equal_with_and_without_kernels(checkpoint) -> None:
    """Greedy decoding of mixed-length prompts (decode batches of several rows, contexts across blocks) gives
    the same tokens through the kernels and through the portable paths."""
    folder = checkpoint("qwen3_gqa4")
    prompts = [[(7 * i + j) % 900 + 3 for j in range(5 + 11 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = []
    for switch in (True, False):
        engine = LLMEngine.from_pretrained(folder, EngineConfig(block_size=4, num_kv_blocks=256, num_threads=2, cpu_kernel=switch,
                                                                dtype="float32"))
        try:
            assert (engine.runner.backend.cpu_kernels is not None) is switch
            assert engine.stats().cpu_kernels is switch
            # The tied LM head (1024 rows) is packed only where the kernels run; embeddings read it either way.
            assert isinstance(engine.runner.model.lm_head, PackedWeight) is switch
            runs.append(engine.generate_sync(prompts, params))
        finally:
            engine.shutdown()
    assert runs[0] == runs[1]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scatter_rows_equals_index_copy(dtype: torch.dtype, threads: int, monkeypatch: pytest.MonkeyPatch,
                                        kernels: CpuKernels):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    generator = torch.Generator().manual_seed(4)
    planes, slots, tokens = 6, 96, 40
    rows = torch.randperm(slots, generator=generator)[:tokens]
    rows[5:21] = torch.arange(48, 64)  # a whole block of adjacent slots: one piece
    whole = torch.randn(planes, tokens + 9, 3, 5, generator=generator).to(dtype)
    for src in (whole[:, :tokens], whole[:, 9:].contiguous()):  # strided planes, and contiguous ones
        dst = torch.randn(planes, slots, 3, 5, generator=generator).to(dtype)
        expected = dst.clone().index_copy_(1, rows, src)
        kernels.scatter_rows(dst, src, rows)
        assert torch.equal(dst, expected)


@needs_compiler
def test_scatter_rows_refuses_what_does_not_fit(kernels: CpuKernels):
    dst, src = torch.zeros(2, 8, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="outside"):
        kernels.scatter_rows(dst, src, torch.tensor([0, 8, 1]))
    with pytest.raises(ValueError, match="rows for"):
        kernels.scatter_rows(dst, src, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cannot put"):
        kernels.scatter_rows(dst, src.double(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.scatter_rows(dst, torch.zeros(2, 4, 3).transpose(1, 2), torch.tensor([0, 1, 2]))
    kernels.scatter_rows(dst, src[:, :0], torch.tensor([], dtype=torch.int64))  # nothing to move


def test_the_engine_gauge_says_whether_the_engine_runs_the_kernels() -> None:
    from prometheus_client import CollectorRegistry

    from qwenserve.engine.outputs import EngineStats
    from qwenserve.telemetry.metrics import EngineMetrics

    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    for runs in (True, False):
        metrics.update_from_stats(EngineStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_free=4,
                                              kv_blocks_total=4, kv_blocks_cached=0, prefix_cache_hit_tokens=0,
                                              prefix_cache_query_tokens=0, preemptions=0, cpu_kernels=runs))
        assert registry.get_sample_value("qwenserve_cpu_kernels_available") == float(runs)
