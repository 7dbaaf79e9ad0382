"""The C kernels for fp32 on CPU: equal to the PyTorch paths they replace, and optional."""

from __future__ import annotations

import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qwenserve import cpu_kernels
from qwenserve.engine.attention.base import AttentionBatch
from qwenserve.engine.attention.torch_backend import TorchAttentionBackend
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampler import argmax as sampler_argmax
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models.layers import RMSNorm, apply_rotary, linear

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the kernels cannot be built here")


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """load() re-run against an empty cache folder, and its cached answer restored afterwards."""
    monkeypatch.setenv("QWENSERVE_CACHE", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield
    monkeypatch.undo()
    cpu_kernels.load.cache_clear()


@needs_compiler
def test_kernels_build_on_this_machine() -> None:
    assert cpu_kernels.available()


@needs_compiler
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(16, 8, 128, 16), (8, 2, 36, 4), (4, 4, 64, 16),
                                                                      (12, 3, 8, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_equals_gather_and_sdpa(heads: int, kv_heads: int, dim: int, block_size: int,
                                             threads: int) -> None:
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
        backend = TorchAttentionBackend(block_size, cpu_kernel_for_fp32=use_kernel)
        assert backend.cpu_kernel is use_kernel
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
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 32, 63, 130])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (37, 13), (1024, 4099)])
def test_linear_nt_equals_linear(rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * k + n)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    torch.testing.assert_close(cpu_kernels.linear_nt(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 17, 64, 130])
@pytest.mark.parametrize(("k", "n"), [(64, 16), (37, 48), (1000, 80), (1024, 4096)])
def test_linear_packed_equals_linear(rows: int, k: int, n: int) -> None:
    """Row tails of the 6-row tile, panel tails of the 4-panel tile (1, 3, 5 panels), odd k; at k <= 512 and
    up to 16 rows the one-panel tiles of up to 12 rows (one and two passes)."""
    gen = torch.Generator().manual_seed(rows * k + n + 1)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = cpu_kernels.pack_weight(w)
    assert packed.shape == (n // 16, k, 16)
    torch.testing.assert_close(cpu_kernels.linear_packed(x, packed), F.linear(x, w), rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=2e-4)
    # Leading dimensions are flattened and restored, as F.linear does.
    x3 = x.reshape(1, rows, k)
    torch.testing.assert_close(linear(x3, packed), F.linear(x3, w), rtol=1e-4, atol=2e-4)


def test_packing_round_trips_and_refuses_what_it_cannot_pack() -> None:
    experts = torch.randn(3, 32, 24)  # stacked MoE experts: each packs on its own
    packed = cpu_kernels.pack_weight(experts)
    assert packed.shape == (3, 2, 24, 16)
    assert torch.equal(packed[1], cpu_kernels.pack_weight(experts[1]))
    assert torch.equal(cpu_kernels.unpack_weight(packed), experts)
    # Column c of panel q is row 16q + c: what embedding_rows reads for a tied, packed LM head.
    assert torch.equal(packed[2][1][:, 5], experts[2][21])
    for weight in (torch.randn(24, 8), torch.randn(32, 8, dtype=torch.float64)):
        assert not cpu_kernels.packable(weight)
        with pytest.raises(ValueError, match="multiple of 16"):
            cpu_kernels.pack_weight(weight)


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 build target")
def test_the_sixteen_register_build_is_right_too(tmp_path: Path) -> None:
    """This host has 32 vector registers, so load() builds the packed kernel's wide tiles; a CPU with AVX2 only
    (16 registers) gets the narrow one: build that variant explicitly and check both kernels in it."""
    import ctypes

    target = tmp_path / "avx2.so"
    cpu_kernels.build(cpu_kernels.compiler(), ["-O3", "-march=x86-64-v3", "-fopenmp", "-std=gnu11", "-fPIC",
                                               "-shared"], target)
    lib = ctypes.CDLL(str(target))
    lib.linear_nt.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    gen = torch.Generator().manual_seed(16)
    for rows, k, n in [(1, 64, 96), (5, 37, 13), (33, 1024, 4099)]:
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        y = torch.empty(rows, n)
        lib.linear_nt(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, k, n, 2)
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
    lib.linear_packed.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    for rows, k, n in [(1, 64, 16), (7, 37, 48), (33, 1024, 4096)]:
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        y, packed = torch.empty(rows, n), cpu_kernels.pack_weight(w)  # held: a temporary's memory is reused
        lib.linear_packed(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, k, n, 2)
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=2e-4)


@needs_compiler
@pytest.mark.parametrize("shape", [(1, 8), (64, 1024), (7, 3, 33), (512, 96)])
def test_rms_norm_equals_the_pytorch_formula(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x, w = torch.randn(*shape, generator=gen), torch.randn(shape[-1], generator=gen)
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-6), expected, rtol=1e-5, atol=1e-5)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = w
    strided = torch.cat([x, x], dim=-1)[..., : shape[-1]]  # q and k reach their norms as views of qkv
    torch.testing.assert_close(norm(strided), expected, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 1, 2), (5, 2, 24), (64, 16, 128), (300, 8, 64)])
def test_rotary_equals_pytorch_bit_for_bit(tokens: int, heads: int, dim: int) -> None:
    """Products and sums rounded as PyTorch rounds them: equal, not merely close; strided input as a view of qkv."""
    gen = torch.Generator().manual_seed(tokens + heads + dim)
    qkv = torch.randn(tokens, 3 * heads * dim, generator=gen)
    x = qkv[:, heads * dim : 2 * heads * dim].reshape(tokens, heads, dim)
    cos, sin = torch.randn(tokens, 1, dim, generator=gen), torch.randn(tokens, 1, dim, generator=gen)
    half = dim // 2
    expected = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    assert torch.equal(cpu_kernels.rotary(x, cos.squeeze(1), sin.squeeze(1)), expected)
    assert torch.equal(apply_rotary(x, cos, sin), expected)


@needs_compiler
@pytest.mark.parametrize("cols", [1, 7, 64, 65, 1000, 151936])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_equals_torch_argmax(cols: int, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random rows, a row of ties (first index wins), a max in a block's tail, all -inf, NaNs (the first NaN
    wins, as in torch), signed zeros; rows of a wider tensor (strided), and an empty batch."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the wrapper hands the kernel
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(12, cols + 3, generator=gen)
    x = wide[:, :cols]
    x[1] = 0.5  # all tied
    x[2, -1] = 1e30  # the last column
    x[3] = float("-inf")
    x[4, cols // 2 :] = float("nan")
    x[5, -1] = float("nan")
    x[5, 0] = float("inf")
    x[6] = 0.0
    x[6, cols // 3] = -0.0
    x[7, : max(1, cols // 2)] = float("-inf")
    x[8, cols // 2] = x[8, -1] = 50.0  # two equal maxima: the first
    expected = torch.argmax(x, dim=-1)
    assert torch.equal(cpu_kernels.argmax_rows(x), expected)
    assert torch.equal(sampler_argmax(x), expected)
    assert cpu_kernels.argmax_rows(torch.empty(0, cols)).shape == (0,)


@needs_compiler
def test_kernels_refuse_what_they_cannot_read() -> None:
    with pytest.raises(ValueError, match="contiguous fp32"):
        cpu_kernels.linear_nt(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.linear_nt(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.linear_packed(torch.randn(2, 8), cpu_kernels.pack_weight(torch.randn(16, 9)))
    with pytest.raises(ValueError, match="packed weight"):
        cpu_kernels.linear_packed(torch.randn(2, 8), torch.randn(1, 8, 8))
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.rms_norm(torch.randn(8, 2).t(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="cos and sin"):
        cpu_kernels.rotary(torch.randn(2, 1, 8), torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_kernels.argmax_rows(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="empty"):
        cpu_kernels.argmax_rows(torch.empty(3, 0))
    with pytest.raises(ValueError, match="even"):
        cpu_kernels.rotary(torch.randn(2, 1, 7), torch.randn(2, 7), torch.randn(2, 7))
    # linear() itself takes anything F.linear takes: transposed weights and other dtypes use the BLAS.
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    torch.testing.assert_close(linear(x, w.t()), F.linear(x, w.t()))


def test_switched_off_by_environment(fresh_load: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWENSERVE_CPU_KERNEL", "0")
    assert cpu_kernels.load() is None
    assert TorchAttentionBackend(16).cpu_kernel is False


def test_a_failing_compiler_leaves_the_portable_path(fresh_load: None, monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: out of order' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert cpu_kernels.load() is None
    assert "out of order" in caplog.text
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))


@needs_compiler
def test_engine_tokens_equal_with_and_without_kernels(fresh_load: None, monkeypatch: pytest.MonkeyPatch,
                                                      checkpoint) -> None:
    """Greedy decoding of mixed-length prompts (decode batches of several rows, contexts across blocks) gives
    the same tokens through the kernels and through the portable paths."""
    folder = checkpoint("qwen3_gqa4")
    prompts = [[(7 * i + j) % 900 + 3 for j in range(5 + 11 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("QWENSERVE_CPU_KERNEL", switch)
        cpu_kernels.load.cache_clear()
        engine = LLMEngine.from_pretrained(folder, EngineConfig(block_size=4, num_threads=2))
        try:
            assert engine.runner.backend.cpu_kernel is (switch == "1")
            # The tied LM head (1024 rows) is packed only where the kernels run; embeddings read it either way.
            assert engine.runner.model.lm_head.dim() == (3 if switch == "1" else 2)
            runs.append(engine.generate_sync(prompts, params))
        finally:
            engine.shutdown()
    assert runs[0] == runs[1]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scatter_rows_equals_index_copy(dtype: torch.dtype, threads: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    generator = torch.Generator().manual_seed(4)
    planes, slots, tokens = 6, 96, 40
    rows = torch.randperm(slots, generator=generator)[:tokens]
    rows[5:21] = torch.arange(48, 64)  # a whole block of adjacent slots: one piece
    whole = torch.randn(planes, tokens + 9, 3, 5, generator=generator).to(dtype)
    for src in (whole[:, :tokens], whole[:, 9:].contiguous()):  # strided planes, and contiguous ones
        dst = torch.randn(planes, slots, 3, 5, generator=generator).to(dtype)
        expected = dst.clone().index_copy_(1, rows, src)
        cpu_kernels.scatter_rows(dst, src, rows)
        assert torch.equal(dst, expected)


@needs_compiler
def test_scatter_rows_refuses_what_does_not_fit():
    dst, src = torch.zeros(2, 8, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="outside"):
        cpu_kernels.scatter_rows(dst, src, torch.tensor([0, 8, 1]))
    with pytest.raises(ValueError, match="rows for"):
        cpu_kernels.scatter_rows(dst, src, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cannot put"):
        cpu_kernels.scatter_rows(dst, src.double(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.scatter_rows(dst, torch.zeros(2, 4, 3).transpose(1, 2), torch.tensor([0, 1, 2]))
    cpu_kernels.scatter_rows(dst, src[:, :0], torch.tensor([], dtype=torch.int64))  # nothing to move
