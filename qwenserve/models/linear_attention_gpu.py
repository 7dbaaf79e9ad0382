"""Gated DeltaNet layers on CUDA through maintained kernel packages, each used only where it is installed.

- flash-linear-attention (`fla-core`): the chunked delta rule for every prefill chunk of a step in one varlen call,
  and the fused recurrent step for the step's decode rows. Without it, models/gated_delta.py's PyTorch forms run:
  the same numbers, but a chunk scan of many small launches per sequence.
- causal-conv1d: the decode rows' short convolution in one kernel that updates the kept inputs in place (PyTorch's
  form gathers, concatenates and scatters). A prefill chunk's convolution stays one F.conv1d per sequence: a few
  launches per chunk, small beside the delta rule.

The functions keep models/gated_delta.py's contracts (q, k normalised and q scaled; values and states in fp32; the
states [slots, H, dk, dv] updated in place at the given slots), so engine/kernels.py can put them in the ops table
without the layer noticing. They are written against the packages' public calls with keyword arguments only: the
positional order of flash-linear-attention's gates changed between releases. Before a package is chosen, a small
case runs through it and through PyTorch's forms on the device (`fla_agrees`, `causal_conv1d_agrees`): a release
that fails or computes something else is logged and left out, as a CPU kernel that will not load is. Whether
they are used at all is the engine's config (`--no-linear-attention-kernels` turns them off).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable

import torch

from qwenserve.models import gated_delta
from qwenserve.models.gated_delta import PrefillChunks

log = logging.getLogger(__name__)

#: How far a package's start-up case may be from PyTorch's forms (its products may run in TF32 on the GPU).
CHECK_TOLERANCE = 2e-2


@functools.cache
def fla_available() -> bool:
    """True where CUDA runs and flash-linear-attention's gated delta rule imports."""
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
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
    if not torch.cuda.is_available() or importlib.util.find_spec("causal_conv1d") is None:
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
    prefills: PrefillChunks,
) -> torch.Tensor:
    """gated_delta.chunk_gated_delta_prefills through flash-linear-attention's chunked kernel: every prefill chunk of
    the step in one varlen call, each sequence from its slot's state, the final states written back."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rows, slots = prefills.rows, prefills.slots(states.device)
    out, final = chunk_gated_delta_rule(
        q=q[None, rows], k=k[None, rows], v=v[None, rows], g=g[None, rows], beta=beta[None, rows], scale=1.0,
        initial_state=states[slots], output_final_state=True, cu_seqlens=prefills.cu_seqlens(q.device))
    states[slots] = final.to(states.dtype)
    return out[0]


def causal_conv1d_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
    """gated_delta.short_conv_step through causal-conv1d: the kept inputs [slots, C, K-1] updated in place at
    `slots`, the silu of the convolution returned."""
    from causal_conv1d import causal_conv1d_update

    return causal_conv1d_update(x, conv_state, weight, activation="silu",
                                conv_state_indices=slots.to(torch.int32))


def _self_check(name: str, run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """True where `run()` -> (the package's result, PyTorch's) raises nothing and the two agree; else a WARNING."""
    try:
        got, expected = (t.float() for t in run())
        diff = (got - expected).abs().max().item()
        reason = f"differs from PyTorch's forms by up to {diff:.3g}" if not diff <= CHECK_TOLERANCE * max(
            1.0, expected.abs().max().item()) else None
    except Exception as exc:  # whatever a kernel raises, the engine must still start
        reason = f"failed ({type(exc).__name__}: {exc})"
    if reason is not None:
        log.warning("%s %s in a start-up check: PyTorch's forms run instead", name, reason)
    return reason is None


def _delta_rule_case(device: torch.device, heads: int = 2, dk: int = 128, dv: int = 128) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta of 80 rows and states of 4 slots, as a layer hands them over (the released Qwen3-Next and
    Qwen3.5 checkpoints all have 128-wide key and value heads)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, device=device)

    q = gated_delta.l2_normalize(rand(80, heads, dk) - 0.5) * dk**-0.5
    k = gated_delta.l2_normalize(rand(80, heads, dk) - 0.5)
    return q, k, rand(80, heads, dv) - 0.5, -0.5 * rand(80, heads), rand(80, heads), 0.1 * rand(4, heads, dk, dv)


def delta_rule_check(step: Callable[..., torch.Tensor], prefills: Callable[..., torch.Tensor],
                     device: torch.device) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A check case for `_self_check`: two decode rows, then prefill chunks of 70 and 8 tokens (more than one of the
    kernels' 64-token chunks), through `step` and `prefills` and through PyTorch's forms; outputs and states."""

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta, states = _delta_rule_case(device)
        results = []
        for step_fn, prefills_fn in ((step, prefills), (gated_delta.recurrent_gated_delta_step,
                                                        gated_delta.chunk_gated_delta_prefills)):
            s = states.clone()
            decoded = step_fn(q[:2], k[:2], v[:2], g[:2], beta[:2], s, torch.tensor([3, 0], device=device))
            prefilled = prefills_fn(q, k, v, g, beta, s, PrefillChunks([(2, 70, 1), (72, 8, 2)]))
            results.append(torch.cat([decoded.flatten(), prefilled.flatten(), s.flatten()]))
        return results[0], results[1]

    return run


@functools.cache
def fla_agrees(device: torch.device) -> bool:
    """flash-linear-attention's kernels give PyTorch's numbers on `device` (checked once per device)."""
    return _self_check("flash-linear-attention",
                       delta_rule_check(fla_gated_delta_step, fla_gated_delta_prefills, device))


@functools.cache
def causal_conv1d_agrees(device: torch.device, dtype: torch.dtype) -> bool:
    """causal-conv1d's step gives PyTorch's numbers and kept inputs on `device` in `dtype` (checked once)."""

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device=device).manual_seed(0)
        conv = torch.rand(4, 384, 3, generator=gen, device=device).to(dtype)  # [slots, C, K-1]
        weight = torch.rand(384, 4, generator=gen, device=device).to(dtype) - 0.5
        x = torch.rand(2, 384, generator=gen, device=device).to(dtype)
        slots = torch.tensor([3, 1], device=device)
        ours, theirs = conv.clone(), conv.clone()
        expected = gated_delta.short_conv_step(x, ours, weight, slots)
        got = causal_conv1d_step(x, theirs, weight, slots)
        return torch.cat([got.float().flatten(), theirs.float().flatten()]), torch.cat(
            [expected.float().flatten(), ours.float().flatten()])

    return _self_check("causal-conv1d", run)
