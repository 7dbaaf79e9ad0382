"""The Gated DeltaNet recurrences through flash-linear-attention and causal-conv1d (models/linear_attention_gpu.py).

Here, without a GPU: flash-linear-attention's own kernels run on CPU tensors in Triton's interpreter
(tests/engine/fla_interpreted.py, in a subprocess because the interpreter is chosen when triton loads), through our
glue, against the PyTorch forms and, in a whole engine, against transformers' greedy tokens. On a CUDA machine with
the packages: the chunked kernel, the convolution kernel and an engine's tokens with and without them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.kernels import cuda_ops, model_ops, select_kernels
from qwenserve.engine.precision import Precision
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models import gated_delta
from qwenserve.models import linear_attention_gpu as gpu
from qwenserve.models.gated_delta import PrefillChunks
from qwenserve.models.ops import TORCH_OPS
from tests.support.engine_checkpoints import random_prompts

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("fla_interpreted.py")
# Where scripts/setup.sh installs flash-linear-attention: off the venv's path (transformers would take it up too).
FLA_TARGET = REPO / ".venv" / "fla"
PROMPTS = random_prompts(3, 5, 70, seed=5)  # the longest spans two 48-token prefill chunks

needs_fla_package = pytest.mark.skipif(
    (not (FLA_TARGET / "fla").is_dir() and importlib.util.find_spec("fla") is None)
    or importlib.util.find_spec("triton") is None,
    reason="flash-linear-attention (fla-core; scripts/setup.sh puts it in .venv/fla) or Triton is not installed")
needs_cuda_fla = pytest.mark.skipif(not gpu.fla_available(), reason="needs CUDA and flash-linear-attention")
needs_cuda_conv = pytest.mark.skipif(not gpu.causal_conv1d_available(), reason="needs CUDA and causal-conv1d")


@pytest.fixture(scope="module")
def interpreted(checkpoint) -> dict:
    """tests/engine/fla_interpreted.py's findings on the tiny Qwen3-Next checkpoint and PROMPTS."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(FLA_TARGET), str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HELPER), str(checkpoint("qwen3_next")), json.dumps(PROMPTS)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_fla_package
def test_flash_linear_attention_through_our_glue_equals_the_pytorch_forms(interpreted) -> None:
    found = interpreted["ops"]
    assert found["step"] < 1e-5 and found["prefills"] < 1e-5 and found["states"] < 1e-5, found
    assert found["others_untouched"], "a slot that belongs to no sequence of the step was written"


@needs_fla_package
def test_the_start_up_check_passes_flash_linear_attention(interpreted) -> None:
    assert interpreted["self_check"] is True


@needs_fla_package
def test_an_engine_on_flash_linear_attention_matches_transformers(interpreted, reference) -> None:
    assert interpreted["engine"]["ops"].startswith("torch+fla")
    assert interpreted["engine"]["tokens"] == [reference("qwen3_next", p, 6)[0] for p in PROMPTS]


def test_without_cuda_or_the_packages_pytorch_runs() -> None:
    chosen = select_kernels(EngineConfig(dtype="float32"), torch.device("cpu"))
    assert chosen.ops.gated_delta_prefills is gated_delta.chunk_gated_delta_prefills
    if not torch.cuda.is_available():
        assert not gpu.fla_available() and not gpu.causal_conv1d_available()
        assert cuda_ops(torch.device("cuda"), torch.bfloat16) is TORCH_OPS


def test_the_switch_turns_the_packages_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """With both packages installed and agreeing (stood in for here), --no-linear-attention-kernels
    (QWENSERVE_LINEAR_ATTENTION_KERNELS=0) leaves PyTorch's forms on CUDA."""
    for name in ("fla_available", "causal_conv1d_available"):
        monkeypatch.setattr(gpu, name, lambda: True)
    for name in ("fla_agrees", "causal_conv1d_agrees"):
        monkeypatch.setattr(gpu, name, lambda *device_and_dtype: True)
    cuda = torch.device("cuda")
    bf16 = Precision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert model_ops(EngineConfig(), cuda, bf16, None).name == "torch+fla+causal_conv1d"
    assert model_ops(EngineConfig(linear_attention_kernels=False), cuda, bf16, None) is TORCH_OPS


def test_the_start_up_check_passes_what_agrees_and_refuses_what_raises_or_differs(caplog) -> None:
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger=gpu.__name__):
        assert gpu._self_check("PyTorch", gpu.delta_rule_check(gated_delta.recurrent_gated_delta_step,
                                                              gated_delta.chunk_gated_delta_prefills, cpu))
        assert not caplog.records

        def raising(*args: object) -> torch.Tensor:
            raise RuntimeError("no kernel image is available for execution on the device")

        assert not gpu._self_check("a raising kernel", gpu.delta_rule_check(gated_delta.recurrent_gated_delta_step,
                                                                            raising, cpu))
        assert "a raising kernel failed (RuntimeError: no kernel image" in caplog.text

        def forgetful(q, k, v, g, beta, states, slots) -> torch.Tensor:  # right outputs, states never written
            return gated_delta.recurrent_gated_delta_step(q, k, v, g, beta, states.clone(), slots)

        assert not gpu._self_check("a forgetful kernel", gpu.delta_rule_check(
            forgetful, gated_delta.chunk_gated_delta_prefills, cpu))
        assert "a forgetful kernel differs from PyTorch's forms" in caplog.text


# -- on a CUDA machine with the packages (scripts/gpu_check.sh) ------------------------------------------------------


def _cuda_inputs(n: int, heads: int = 8, dk: int = 128, dv: int = 128) -> tuple[torch.Tensor, ...]:
    q = gated_delta.l2_normalize(torch.randn(n, heads, dk, device="cuda")) * dk**-0.5
    k = gated_delta.l2_normalize(torch.randn(n, heads, dk, device="cuda"))
    return (q, k, torch.randn(n, heads, dv, device="cuda"), -0.5 * torch.rand(n, heads, device="cuda"),
            torch.rand(n, heads, device="cuda"))


@needs_cuda_fla
def test_the_chunked_kernel_equals_the_pytorch_chunks_on_cuda() -> None:
    torch.manual_seed(0)
    states = 0.1 * torch.randn(6, 8, 128, 128, device="cuda")
    ours, theirs = states.clone(), states.clone()
    prefills = PrefillChunks([(0, 1, 3), (1, 63, 1), (64, 300, 5)])
    rows = _cuda_inputs(364)
    expected = gated_delta.chunk_gated_delta_prefills(*rows, ours, prefills)
    got = gpu.fla_gated_delta_prefills(*rows, theirs, prefills)
    # The kernels' products run in TF32 on recent GPUs: equal to a few parts in a thousand.
    assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2), (got - expected).abs().max()
    assert torch.allclose(theirs, ours, atol=2e-2, rtol=2e-2), (theirs - ours).abs().max()
    assert torch.equal(theirs[[0, 2, 4]], states[[0, 2, 4]])
    step_rows = _cuda_inputs(3)
    slots = torch.tensor([2, 0, 4], device="cuda")
    expected = gated_delta.recurrent_gated_delta_step(*step_rows, ours, slots)
    got = gpu.fla_gated_delta_step(*step_rows, theirs, slots)
    assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2), (got - expected).abs().max()


@needs_cuda_conv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_convolution_kernel_equals_the_pytorch_step_on_cuda(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    conv_state = torch.randn(4, 2 * 64 + 128, 3, device="cuda", dtype=dtype)  # a layer's view: [slots, C, K-1]
    weight = torch.randn(conv_state.shape[1], 4, device="cuda", dtype=dtype)
    x = torch.randn(2, conv_state.shape[1], device="cuda", dtype=dtype)
    slots = torch.tensor([3, 1], device="cuda")
    ours, theirs = conv_state.clone(), conv_state.clone()
    expected = gated_delta.short_conv_step(x, ours, weight, slots)
    got = gpu.causal_conv1d_step(x, theirs, weight, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(theirs, ours)  # the kept inputs are copied, not computed


@pytest.mark.skipif(not (gpu.fla_available() or gpu.causal_conv1d_available()),
                    reason="needs CUDA and flash-linear-attention or causal-conv1d")
def test_an_engine_on_the_kernel_packages_gives_pytorchs_tokens_on_cuda(checkpoint) -> None:
    def generate(linear_attention_kernels: bool) -> tuple[str, list[list[int]]]:
        engine = LLMEngine.from_pretrained(checkpoint("qwen3_next"), EngineConfig(
            device="cuda", dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=48,
            linear_attention_kernels=linear_attention_kernels))
        try:
            tokens = engine.generate_sync(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            return engine.runner.model.ops.name, tokens
        finally:
            engine.shutdown()

    with_packages, tokens = generate(linear_attention_kernels=True)
    assert with_packages != TORCH_OPS.name
    assert generate(linear_attention_kernels=False) == (TORCH_OPS.name, tokens)
