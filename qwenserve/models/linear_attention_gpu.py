"""Gated DeltaNet layers on CUDA through maintained kernel packages, each used only where it is installed.

- flash-linear-attention (`fla-core`): the chunked delta rule for every prefill chunk of a step in one varlen call,
  and the fused recurrent step for the step's decode rows. Without it, models/gated_delta.py's PyTorch forms run:
  the same numbers, but a chunk scan of many small launches per sequence.
- causal-conv1d: the decode rows' short convolution in one kernel that updates the kept inputs in place (PyTorch's
  form gathers, concatenates and scatters). A prefill chunk's convolution stays one F.conv1d per sequence: a few
  launches per chunk, small beside the delta rule.

The functions keep models/gated_delta.py's contracts (q, k normalised and q scaled; values and states in fp32; the
states [slots, H, dk, dv] updated in place at the given slots), so ops.select_ops can put them in the ops table
without the layer noticing. They are written against the packages' public calls with keyword arguments only: the
positional order of flash-linear-attention's gates changed between releases.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Set to 0 to run PyTorch's forms on CUDA even where the packages are installed (to compare, or to rule them out).
ENV_SWITCH = "QWENSERVE_LINEAR_ATTENTION_KERNELS"
#: causal-conv1d's kernels take convolutions of 2 to 4 taps (Qwen3-Next and Qwen3.5 use 4).
CAUSAL_CONV1D_WIDTHS = range(2, 5)


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() in ("0", "false", "no", "off")


@functools.cache
def fla_available() -> bool:
    """True where CUDA runs and flash-linear-attention's gated delta rule imports."""
    if _switched_off() or not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as exc:  # a broken install must not stop a server that can run without it
        log.warning("flash-linear-attention is installed but does not import (%s): PyTorch's delta rule runs", exc)
        return False
    return True


@functools.cache
def causal_conv1d_available() -> bool:
    """True where CUDA runs and causal-conv1d imports."""
    if _switched_off() or not torch.cuda.is_available() or importlib.util.find_spec("causal_conv1d") is None:
        return False
    try:
        from causal_conv1d import causal_conv1d_update
    except Exception as exc:
        log.warning("causal-conv1d is installed but does not import (%s): PyTorch's convolution runs", exc)
        return False
    if "conv_state_indices" not in inspect.signature(causal_conv1d_update).parameters:  # before 1.5
        log.warning("causal-conv1d is too old to update state slots in place (1.5 or later): PyTorch's convolution "
                    "runs")
        return False
    return True


def fla_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """gated_delta.recurrent_gated_delta_step through flash-linear-attention's fused recurrent kernel: B sequences
    of one token each, as a batch of B with T = 1."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    out, final = fused_recurrent_gated_delta_rule(
        q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1), g=g.unsqueeze(1), beta=beta.unsqueeze(1), scale=1.0,
        initial_state=states[slots], output_final_state=True)
    states[slots] = final.to(states.dtype)
    return out.squeeze(1)


def fla_gated_delta_prefills(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    prefills: list[tuple[int, int, int]], kernel: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """gated_delta.chunk_gated_delta_prefills through flash-linear-attention: every prefill chunk of the step in one
    varlen call (the chunks are consecutive rows, `prefills` = (first row, rows, slot)), each sequence from its
    slot's state, the final states written back. `kernel` defaults to the chunked kernel; tests pass the fused
    recurrent one, which takes the same arguments, where the chunked one cannot run."""
    if kernel is None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    first, last = prefills[0][0], prefills[-1][0] + prefills[-1][1]
    counts = torch.tensor([count for _, count, _ in prefills], dtype=torch.long)
    cu_seqlens = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(q.device)
    slots = torch.tensor([slot for _, _, slot in prefills], dtype=torch.long, device=states.device)
    rows = slice(first, last)
    out, final = kernel(
        q=q[None, rows], k=k[None, rows], v=v[None, rows], g=g[None, rows], beta=beta[None, rows], scale=1.0,
        initial_state=states[slots], output_final_state=True, cu_seqlens=cu_seqlens)
    states[slots] = final.to(states.dtype)
    return out[0]


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
    """gated_delta.short_conv_step through causal-conv1d: the kept inputs [slots, C, K-1] updated in place at
    `slots`, the silu of the convolution returned."""
    from causal_conv1d import causal_conv1d_update

    return causal_conv1d_update(x, conv_state, weight, activation="silu",
                                conv_state_indices=slots.to(torch.int32))
