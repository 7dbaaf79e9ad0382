"""`--dtype auto`'s choice of precision (engine/precision.py) from the probe of this CPU's products, with the probe
stood in where the choice is the subject, and the oneDNN rows of the packed product against PyTorch's forms."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qwenserve.cpu_kernels import amx_weight, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.linear_probe import ROWS, LinearProbe, measure_now, probe_shape
from qwenserve.cpu_kernels.packed_weight import PackedWeight
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.kernels import select_kernels
from qwenserve.engine.precision import Precision, resolve_precision
from qwenserve.models.ops import cpu_kernel_ops

CPU = torch.device("cpu")
FP32, BF16 = torch.float32, torch.bfloat16


def probe_result(bf16_speedup: float, onednn_wins_from: int | None, amx_time: float | None = None) -> LinearProbe:
    """A probe whose bf16 panels decode `bf16_speedup` times fp32's and whose oneDNN product wins from
    `onednn_wins_from` probed rows up; with `amx_time`, our AMX product timed at that multiple of oneDNN's."""
    panels = {rows: float(rows) for rows in ROWS}
    onednn = {rows: rows * (0.5 if onednn_wins_from is not None and rows >= onednn_wins_from else 2.0)
              for rows in ROWS}
    amx = {rows: amx_time * t for rows, t in onednn.items()} if amx_time is not None else {}
    return LinearProbe(64, 32, 1.0, 1.0 / bf16_speedup, panels, onednn, 0.01, amx)


class StandIn:
    """A probe that answers `result` and remembers what it was asked."""

    def __init__(self, result: LinearProbe) -> None:
        self.result = result
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, kernels: CpuKernels, n: int, k: int, threads: int) -> LinearProbe:
        self.calls.append((n, k, threads))
        return self.result


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    loaded = loader.load()
    if loaded is None:
        pytest.skip("no CPU kernels here")
    return loaded


def test_auto_takes_bf16_throughout_where_the_probe_finds_the_bf16_panels_faster(kernels: CpuKernels) -> None:
    probe = StandIn(probe_result(1.8, 16))
    precision = resolve_precision(EngineConfig(), CPU, kernels, (1024, 3072), probe=probe)
    assert (precision.dtype, precision.weight_dtype, precision.kv_dtype) == (BF16, BF16, BF16)
    assert precision.dense_rows == 16
    assert "1.80x" in precision.reason and "16 rows" in precision.reason and "activations bfloat16" in precision.reason
    assert precision.labels() == {"activations": "bfloat16", "weights": "bfloat16", "kv": "bfloat16"}
    assert precision.name == "bfloat16 onednn>=16"
    # The model's MLP input projection is what was measured.
    assert probe.calls == [(6144, 1024, torch.get_num_threads())]


def test_auto_keeps_fp32_weights_where_bf16_is_no_faster_but_the_kv_choice_does_not_follow_the_timing(
        kernels: CpuKernels) -> None:
    """The KV dtype is what a prefill and a decode worker must agree on, so it never depends on a measurement."""
    precision = resolve_precision(EngineConfig(), CPU, kernels, (1024, 3072), probe=StandIn(probe_result(1.02, 4)))
    assert (precision.dtype, precision.weight_dtype, precision.kv_dtype, precision.dense_rows) == (FP32, FP32, BF16,
                                                                                                   None)
    assert "only 1.02x" in precision.reason


def test_dense_rows_are_none_where_it_never_wins(kernels: CpuKernels) -> None:
    precision = resolve_precision(EngineConfig(), CPU, kernels, probe=StandIn(probe_result(2.0, None)))
    assert precision.weight_dtype == BF16 and precision.dense_rows is None
    assert select_kernels(EngineConfig(dtype="float32", cpu_weight_dtype="bfloat16"),
                          CPU).ops.name == "cpu_kernels+bf16_weights"


def test_explicit_dtypes_are_honoured_and_measure_nothing(kernels: CpuKernels) -> None:
    probe = StandIn(probe_result(2.0, 4))
    exact = resolve_precision(EngineConfig(dtype="float32"), CPU, kernels, probe=probe)
    assert exact == Precision(FP32, FP32, FP32, None, "--dtype float32") and exact.name == "float32"
    mixed = resolve_precision(EngineConfig(dtype="float32", cpu_weight_dtype="bfloat16", kv_cache_dtype="bfloat16"),
                              CPU, kernels, probe=probe)
    assert (mixed.weight_dtype, mixed.kv_dtype, mixed.dense_rows) == (BF16, BF16, None)
    assert "--cpu-weight-dtype" in mixed.reason and "--kv-cache-dtype" in mixed.reason
    # Under auto, one explicit part is kept and the other still chosen.
    kv_fp32 = resolve_precision(EngineConfig(kv_cache_dtype="float32"), CPU, kernels, probe=probe)
    assert (kv_fp32.weight_dtype, kv_fp32.kv_dtype, kv_fp32.dense_rows) == (BF16, FP32, 4)
    assert probe.calls and len(probe.calls) == 1  # only the auto weights were measured
    # --dtype bfloat16 is bf16 throughout; only where PyTorch's product takes over is measured.
    bf16 = resolve_precision(EngineConfig(dtype="bfloat16"), CPU, kernels, probe=probe)
    assert (bf16.dtype, bf16.weight_dtype, bf16.kv_dtype, bf16.dense_rows) == (BF16, BF16, BF16, 4)
    assert bf16.reason.startswith("--dtype bfloat16") and len(probe.calls) == 2


def test_hybrid_models_keep_their_kv_in_the_models_dtype(kernels: CpuKernels) -> None:
    precision = resolve_precision(EngineConfig(), CPU, kernels, hybrid=True, probe=StandIn(probe_result(2.0, 64)))
    assert (precision.dtype, precision.weight_dtype, precision.kv_dtype) == (FP32, BF16, FP32)


def test_without_the_kernels_or_on_cuda_auto_is_one_dtype() -> None:
    probe = StandIn(probe_result(2.0, 4))
    plain = resolve_precision(EngineConfig(), CPU, None, probe=probe)
    assert plain == Precision(FP32, FP32, FP32, None, "auto without the C kernels (PyTorch's ops)")
    cuda = resolve_precision(EngineConfig(device="cuda"), torch.device("cuda"), None, probe=probe)
    assert (cuda.dtype, cuda.weight_dtype, cuda.kv_dtype) == (BF16, BF16, BF16) and cuda.name == "bfloat16"
    assert not probe.calls


def test_the_many_row_product_is_ours_on_amx_tiles_where_the_probe_timed_it_faster(kernels: CpuKernels) -> None:
    """The AMX product serves where it ran and beat PyTorch's (geometric mean over 16 rows and up); the rows it takes
    over from are then counted on its own times."""
    faster = resolve_precision(EngineConfig(), CPU, kernels, probe=StandIn(probe_result(1.8, 16, amx_time=0.8)))
    assert (faster.dense_product, faster.dense_rows, faster.name) == ("amx", 16, "bfloat16 amx>=16")
    assert "AMX tiles from 16 rows" in faster.reason
    slower = resolve_precision(EngineConfig(), CPU, kernels, probe=StandIn(probe_result(1.8, 16, amx_time=1.2)))
    assert (slower.dense_product, slower.name) == ("onednn", "bfloat16 onednn>=16")
    assert "PyTorch's bf16 product from 16 rows" in slower.reason
    absent = probe_result(1.8, 16)  # no AMX here: nothing timed
    assert absent.dense_product() == "onednn" and absent.dense_ms() is absent.onednn_ms
    # Winning at 16 and 64 rows by more than it loses at 256 is winning.
    mixed = LinearProbe(16, 16, 1, 1, dict.fromkeys(ROWS, 10.0), dict.fromkeys(ROWS, 1.0), 0,
                        {**dict.fromkeys(ROWS, 0.5), 256: 1.5})
    assert mixed.dense_product() == "amx" and mixed.dense_from() == min(ROWS)
    # --dtype bfloat16 takes the same choice.
    bf16 = resolve_precision(EngineConfig(dtype="bfloat16"), CPU, kernels, probe=StandIn(probe_result(1.0, 4, 0.5)))
    assert (bf16.dense_product, bf16.dense_rows) == ("amx", 4)


def test_the_probe_times_the_amx_product_only_where_it_runs(kernels: CpuKernels,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX in the CPU's flags (stood in) nothing is tiled; with it, only a shape that tiles is, and only
    where the loaded object's kernel takes the tile state."""
    from qwenserve.cpu_kernels import linear_probe
    x = torch.randn(4, 64)
    monkeypatch.setattr(linear_probe, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert linear_probe._amx_tiles(kernels, torch.randn(32, 64), x) is None
    monkeypatch.setattr(linear_probe, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert linear_probe._amx_tiles(kernels, torch.randn(32, 48), x[:, :48]) is None  # 48 inputs: no tiles
    tiles = linear_probe._amx_tiles(kernels, torch.randn(32, 64), x)
    runs = kernels.linear_bf16_amx(x.to(BF16), amx_weight.pack(torch.randn(32, 64))) is not None
    assert (tiles is not None) == runs


def test_dense_from_needs_every_larger_probed_count_to_win() -> None:
    panels = dict.fromkeys(ROWS, 1.0)
    assert LinearProbe(16, 16, 1, 1, panels, dict.fromkeys(ROWS, 0.5), 0).dense_from() == min(ROWS)
    assert LinearProbe(16, 16, 1, 1, panels, dict.fromkeys(ROWS, 0.95), 0).dense_from() is None  # within margin
    uneven = {4: 0.5, 16: 0.5, 64: 2.0, 256: 0.5}
    assert LinearProbe(16, 16, 1, 1, panels, uneven, 0).dense_from() == 256


def test_the_probe_measures_the_models_shape_capped(kernels: CpuKernels) -> None:
    assert probe_shape(1024, 3072) == (6144, 1024)
    assert probe_shape(5120, 25600) == (6144, 2048)
    assert probe_shape(40, 24) == (80, 40)
    result = measure_now(kernels, 64, 48, 1)  # measured, whatever the cache holds
    assert set(result.panels_ms) == set(result.onednn_ms) == set(ROWS)
    assert min(result.fp32_ms, result.bf16_ms, *result.panels_ms.values(), *result.onednn_ms.values()) > 0
    assert "64x48" in result.summary()


@pytest.mark.parametrize(("n", "k"), [(48, 37), (16, 5), (80, 130)])
def test_the_packed_product_hands_many_rows_to_pytorchs_bf16(kernels: CpuKernels, n: int, k: int) -> None:
    """Below the oneDNN rows the bf16 panels' fp32 product, from them up PyTorch's bf16 product of x rounded to
    bf16 (what the probe timed), bias added after either; 3-D inputs count their rows."""
    gen = torch.Generator().manual_seed(n * k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    ops = cpu_kernel_ops(kernels, FP32, BF16, dense_rows=4)
    model = torch.nn.Module()
    model.down_proj = torch.nn.Parameter(weight.clone(), requires_grad=False)
    assert ops.prepare(model) == 1
    packed = model.down_proj
    assert isinstance(packed, PackedWeight) and packed.dense is not None and packed.dense.dtype == BF16
    # Held in oneDNN's layout, reordered once (onednn_weight.py), where this PyTorch's oneDNN has bf16 on this CPU.
    assert packed.dense.is_mkldnn == (torch.backends.mkldnn.is_available()
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert torch.equal(packed.dense.to_dense() if packed.dense.is_mkldnn else packed.dense, weight.to(BF16))
    rounded = weight.to(BF16).float()
    few = torch.randn(3, k, generator=gen)
    torch.testing.assert_close(ops.linear(few, packed, bias), few @ rounded.t() + bias, rtol=1e-5, atol=1e-4)
    many = torch.randn(2, 3, k, generator=gen)  # six rows
    torch.testing.assert_close(ops.linear(many, packed, bias), F.linear(many.to(BF16), weight.to(BF16)).float() + bias)
    assert ops.name == "cpu_kernels+bf16_weights+onednn>=4"
    # Stacked weights (MoE experts) index their dense copy with their panels.
    stacked = PackedWeight.pack(torch.randn(2, 16, 8, generator=gen), BF16, dense="onednn")
    assert stacked[1].dense is not None and stacked[1].dense.shape == (16, 8) and stacked[1].shape == (16, 8)
    # fp32 weights never take that path: nothing is kept twice.
    assert cpu_kernel_ops(kernels, FP32, FP32, dense_rows=4).name == "cpu_kernels"


def test_bf16_activations_run_the_panels_widened_and_keep_the_logits_fp32(kernels: CpuKernels) -> None:
    """A bf16 model's few rows: widened to fp32 for the panels' product, the result rounded to bf16; its many rows:
    PyTorch's bf16 product as it is; its logits (any row count): fp32, from its rows widened, never rounded."""
    n, k = 48, 40
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(n, k, generator=gen).to(BF16)
    ops = cpu_kernel_ops(kernels, BF16, BF16, dense_rows=4)
    assert ops.name == "cpu_kernels+bf16_weights+bf16_activations+onednn>=4+bf16_layer"
    model = torch.nn.Module()
    model.lm_head = torch.nn.Parameter(weight.clone(), requires_grad=False)
    assert ops.prepare(model) == 1
    packed = model.lm_head
    few = torch.randn(3, k, generator=gen).to(BF16)
    exact = few.float() @ weight.float().t()
    y = ops.linear(few, packed)
    assert y.dtype == BF16
    torch.testing.assert_close(y.float(), exact.to(BF16).float(), rtol=0, atol=0.02)
    many = torch.randn(6, k, generator=gen).to(BF16)
    assert torch.equal(ops.linear(many, packed), F.linear(many, weight))
    logits = ops.logits(few, packed, torch.empty(3, n))
    assert logits.dtype == FP32
    torch.testing.assert_close(logits, exact, rtol=1e-5, atol=1e-4)
    assert ops.logits(many, packed).dtype == FP32
    # A tied head's rows are the embeddings, in the model's dtype.
    ids = torch.tensor([0, 17, 47])
    assert torch.equal(ops.embedding(packed, ids), weight[ids])


def test_a_probe_is_measured_once_per_machine_and_shape_and_read_back_from_disk(
        kernels: CpuKernels, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from qwenserve.cpu_kernels import linear_probe
    monkeypatch.setenv("QWENSERVE_CACHE", str(tmp_path))
    taken = StandIn(probe_result(1.7, 64, amx_time=0.7))
    monkeypatch.setattr(linear_probe, "measure_now", taken)
    monkeypatch.setattr(linear_probe, "machine_busy", lambda: False)
    first = linear_probe.measure.__wrapped__(kernels, 64, 32, 2)
    again = linear_probe.measure.__wrapped__(kernels, 64, 32, 2)  # another process on this machine
    assert taken.calls == [(64, 32, 2)]
    assert (again.fp32_ms, again.bf16_ms, again.panels_ms, again.onednn_ms, again.amx_ms) == \
        (first.fp32_ms, first.bf16_ms, first.panels_ms, first.onednn_ms, first.amx_ms)
    assert again.amx_ms and again.dense_product() == "amx"
    assert again.seconds == 0 and "measured before" in again.summary()
    # Another thread count or shape is another measurement; a torn file is measured again and rewritten.
    linear_probe.measure.__wrapped__(kernels, 64, 32, 1)
    linear_probe.measure.__wrapped__(kernels, 128, 32, 2)
    assert taken.calls[1:] == [(64, 32, 1), (128, 32, 2)]
    path = linear_probe.cache_path(kernels, 64, 32, 2)
    path.write_text('{"fp32_ms": 1.0')
    with caplog.at_level("WARNING", "qwenserve.cpu_kernels"):
        linear_probe.measure.__wrapped__(kernels, 64, 32, 2)
    assert len(taken.calls) == 4 and "unreadable" in caplog.text
    assert linear_probe.measure.__wrapped__(kernels, 64, 32, 2).seconds == 0


def test_stages_starting_together_measure_once_and_the_later_reads_the_earlier(
        kernels: CpuKernels, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two measurements at once (two stages of one `qwen-serve up`; threads here, each with its own lock handle, as
    processes have) take turns: the second waits for the first's figure and reads it, instead of both timing the
    products while the other's run, and choosing apart."""
    import threading
    import time as clock

    from qwenserve.cpu_kernels import linear_probe
    monkeypatch.setenv("QWENSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(linear_probe, "machine_busy", lambda: False)
    running, overlapped = [0], [False]
    result = probe_result(1.7, 16, amx_time=0.8)

    def slow_probe(*args: object) -> LinearProbe:
        running[0] += 1
        overlapped[0] |= running[0] > 1
        clock.sleep(0.3)
        running[0] -= 1
        return result

    monkeypatch.setattr(linear_probe, "measure_now", slow_probe)
    seen: list[LinearProbe] = []
    threads = [threading.Thread(target=lambda: seen.append(linear_probe.measure.__wrapped__(kernels, 64, 32, 2)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not overlapped[0]
    assert sorted(probe.seconds for probe in seen) == [0.0, result.seconds]  # one measured, one read it
    assert {(probe.dense_product(), probe.dense_from()) for probe in seen} == {("amx", 16)}


def test_a_probe_measured_on_a_busy_machine_is_used_while_it_stays_busy_and_measured_again_once_quiet(
        kernels: CpuKernels, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qwenserve.cpu_kernels import linear_probe
    monkeypatch.setenv("QWENSERVE_CACHE", str(tmp_path))
    taken = StandIn(probe_result(1.7, 64))
    monkeypatch.setattr(linear_probe, "measure_now", taken)
    busy = [True]
    monkeypatch.setattr(linear_probe, "machine_busy", lambda: busy[0])
    linear_probe.measure.__wrapped__(kernels, 64, 32, 2)
    assert json.loads(linear_probe.cache_path(kernels, 64, 32, 2).read_text())["quiet"] is False
    linear_probe.measure.__wrapped__(kernels, 64, 32, 2)  # still busy: the busy figure serves
    assert len(taken.calls) == 1
    busy[0] = False
    linear_probe.measure.__wrapped__(kernels, 64, 32, 2)  # quiet now: measured again, and kept as quiet
    assert len(taken.calls) == 2
    assert json.loads(linear_probe.cache_path(kernels, 64, 32, 2).read_text())["quiet"] is True
    busy[0] = True
    linear_probe.measure.__wrapped__(kernels, 64, 32, 2)
    linear_probe.measure.__wrapped__(kernels, 64, 32, 2)
    assert len(taken.calls) == 2  # a quiet figure serves, busy or not


def test_a_prepacked_weight_multiplies_as_pytorchs_bf16_product_bit_for_bit() -> None:
    """onednn_weight.prepack reorders a matrix once; its product is F.linear's, the same bits, at any row count and
    with leading dimensions; stacked matrices stay plain tensors (each expert is indexed out of them)."""
    from qwenserve.cpu_kernels import onednn_weight

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(80, 56, generator=gen).to(BF16)
    prepacked = onednn_weight.prepack(weight)
    assert prepacked.is_mkldnn == onednn_weight.reorders()  # not on an AVX2-only CPU: the plain weight then
    assert onednn_weight.nbytes(prepacked) == weight.nbytes
    for shape in ((1, 56), (7, 56), (600, 56), (2, 3, 56)):
        x = torch.randn(*shape, generator=gen).to(BF16)
        assert torch.equal(onednn_weight.linear(x, prepacked), F.linear(x, weight)), shape
    stacked = torch.randn(2, 16, 8, generator=gen).to(BF16)
    assert onednn_weight.prepack(stacked) is stacked


@pytest.mark.parametrize(("flags", "amx_time", "on_tiles"), [
    ({"avx512f", "avx512_bf16", "amx_bf16"}, 0.5, True),   # AMX tiles beat oneDNN: prompts run on them
    ({"avx512f", "avx512_bf16", "amx_bf16"}, 2.0, False),  # oneDNN's product won the probe
    ({"avx512f", "avx512_bf16"}, 0.5, False),              # no AMX for the prompts' attention
])
def test_the_token_budget_is_2048_where_prompts_run_on_amx_tiles(
        kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, flags: set[str], amx_time: float, on_tiles: bool) -> None:
    """A CPU engine's steps take 512 tokens unless its prompt chunks run on AMX tiles, products and attention
    (flags and probe stood in); --max-num-batched-tokens overrides either."""
    from qwenserve.cpu_kernels import linear_probe
    from qwenserve.engine import kernels as engine_kernels

    monkeypatch.setattr(engine_kernels, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(linear_probe, "measure", StandIn(probe_result(1.8, 16, amx_time)))
    config = EngineConfig(device="cpu")
    chosen = select_kernels(config, CPU)
    assert chosen.prefill_on_tiles is on_tiles
    assert config.token_budget(chosen.prefill_on_tiles) == (2048 if on_tiles else 512)
    assert config.prefill_only_budget(chosen.prefill_on_tiles) == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=700).token_budget(chosen.prefill_on_tiles) == 700
