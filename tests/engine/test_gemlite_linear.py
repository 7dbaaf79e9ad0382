"""W4A16 / W8A16 on CUDA through GemLite (models/gemlite_linear.py).

Here, without a GPU: the act-order reordering the glue packs with is exact; GemLite's own kernels run on CPU tensors in
Triton's interpreter (tests/engine/gemlite_interpreted.py, in a subprocess because the interpreter is chosen when
triton loads) through our glue against PyTorch on the dequantized weight; a CUDA engine without GemLite says it
dequantizes at load. scripts/gpu_check.sh runs the start-up check and the engines on a GPU.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.kernels import kept_quantization
from qwenserve.engine.quantization import quantization_of
from qwenserve.models import ModelConfig
from qwenserve.models.gemlite_linear import sorted_by_group

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("gemlite_interpreted.py")
# Where scripts/setup.sh installs GemLite: off the venv's path, as flash-linear-attention.
GEMLITE_TARGET = REPO / ".venv" / "gemlite"


def test_act_order_codes_sorted_by_group_make_the_same_weight_over_the_permuted_inputs() -> None:
    generator = torch.Generator().manual_seed(1)
    n, k, group_size = 24, 96, 32
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=generator)
    zeros = torch.randint(0, 16, (n, k // group_size), generator=generator).float()
    groups = (torch.arange(k) // group_size)[torch.randperm(k, generator=generator)]
    weight = (codes.float() - zeros[:, groups]) * scales[:, groups]
    sorted_codes, s, z, perm, size = sorted_by_group(codes, scales, zeros, 4, group_size, groups)
    assert perm is not None and size == group_size
    in_order = torch.arange(k) // group_size
    assert torch.equal((sorted_codes.float() - z[:, in_order]) * s[:, in_order], weight[:, perm])
    # In-order groups (AWQ, GPTQ without act order) are left as they are.
    assert sorted_by_group(codes, scales, zeros, 4, group_size, in_order)[3] is None
    with pytest.raises(ValueError, match="not all 32 inputs"):
        sorted_by_group(codes, scales, zeros, 4, group_size, torch.zeros(k, dtype=torch.long))
    with pytest.raises(ValueError, match="groups are whole"):
        sorted_by_group(codes[:, :80], scales[:, :3], zeros[:, :3], 4, group_size, None)


def test_a_cuda_engine_without_gemlite_dequantizes_at_load_and_says_so(tiny_model, caplog) -> None:
    raw = {**json.loads((tiny_model / "config.json").read_text()), "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}}
    model = ModelConfig.from_dict(raw)
    assert quantization_of(model.raw) is not None
    with caplog.at_level(logging.WARNING, logger="qwenserve.engine"):
        kept = kept_quantization(EngineConfig(), torch.device("cuda"), None, model, torch.bfloat16)
    assert kept is None  # no CUDA here, so GemLite is not available
    assert "dequantized to bfloat16 at load" in caplog.text and "gemlite" in caplog.text


@pytest.mark.skipif(not (GEMLITE_TARGET / "gemlite").is_dir(), reason="GemLite is not installed (scripts/setup.sh "
                    "puts it in .venv/gemlite)")
def test_gemlite_kernels_through_our_glue_equal_pytorch_on_the_dequantized_weight() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(GEMLITE_TARGET), str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HELPER)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found["products"]) == 8
    for case, error in found["products"].items():
        assert error < 5e-3, (case, error)  # fp16 products of fp16-rounded weights: ~1e-3 of the largest value
