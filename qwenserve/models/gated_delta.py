"""The recurrences of Gated DeltaNet layers (Qwen3-Next, Qwen3.5) in PyTorch: the gated delta rule's chunked form a
prefill runs and its one-token step a decode runs, and the short convolution's step.

These are the ops table's defaults and the contracts its replacements keep: a C kernel for the step on CPUs
(cpu_kernels/gated_delta.c), flash-linear-attention and causal-conv1d on CUDA (models/linear_attention_gpu.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

#: Tokens per chunk of the chunked delta rule: the triangular solve is C x C, the scan over chunks sequential.
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (eps inside the root, as the reference kernels)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's T tokens, a chunk at a time, in fp32.

    q, k [T, H, dk] (normalised; q scaled), v [T, H, dv], g (log decay, <= 0) and beta [T, H], state [H, dk, dv]
    before the first token. Returns (outputs [T, H, dv], state after the last token). Per token the rule is
    S = exp(g) S;  u = beta (v - k S);  S = S + kᵀ u;  o = q S. Within a chunk the writes u solve one unit lower
    triangular system (each token corrects for the earlier tokens' writes), so a chunk costs a few matrix products
    and only the chunks are scanned in order.
    """
    length = q.shape[0]
    pad = (-length) % chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, chunks, C, ...], zero-padded at the end
        x = x.transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(x.shape[0], -1, chunk_size, *x.shape[2:])

    # Padded tokens have k = v = beta = 0 and g = 0: they write nothing and decay nothing.
    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    gamma = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + A) u = beta v - beta exp(gamma) k S0, with A[t, j] = beta_t (k_t . k_j) exp(gamma_t - gamma_j) for j < t.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u_from_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_per_state = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False,
                                                unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        u = u_from_values[:, i] - u_per_state[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1), state


def recurrent_gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token of the gated delta rule for each of B sequences at once: q, k [B, H, dk], v [B, H, dv], g and beta
    [B, H]; `states` [slots, H, dk, dv] is updated in place at `slots` [B]. Returns the outputs [B, H, dv]."""
    s = states[slots] * g.exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ s).squeeze(-2)
    s = s + k.unsqueeze(-1) * ((v - predicted) * beta[..., None]).unsqueeze(-2)
    states[slots] = s
    return (q.unsqueeze(-2) @ s).squeeze(-2)


@dataclass(slots=True)
class PrefillChunks:
    """A step's prefill chunks as the linear-attention layers take them: (first row, rows, state slot) each, in
    consecutive rows. Every linear layer of the step reads the same chunks, so the tensors a varlen kernel takes
    (the slots, the cumulative lengths) are made once, on first use, not once per layer."""

    spans: list[tuple[int, int, int]]
    _on_device: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def rows(self) -> slice:
        """The rows of all the chunks."""
        return slice(self.spans[0][0], self.spans[-1][0] + self.spans[-1][1])

    def slots(self, device: torch.device) -> torch.Tensor:
        """[chunks] int64: each chunk's state slot."""
        if "slots" not in self._on_device:
            self._on_device["slots"] = torch.tensor([s for _, _, s in self.spans], dtype=torch.long, device=device)
        return self._on_device["slots"]

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """[chunks + 1] int64: where each chunk starts among the chunks' rows, then their total."""
        if "cu_seqlens" not in self._on_device:
            counts = [0, *(count for _, count, _ in self.spans)]
            self._on_device["cu_seqlens"] = torch.tensor(counts, dtype=torch.long).cumsum(0).to(device)
        return self._on_device["cu_seqlens"]


def chunk_gated_delta_prefills(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    prefills: PrefillChunks,
) -> torch.Tensor:
    """The chunked rule for each of a step's prefill chunks, over q, k [n, H, dk], v [n, H, dv], g and beta [n, H];
    each sequence starts from `states` [slots, H, dk, dv] at its slot and leaves its state there. Returns the outputs
    of the chunks' rows, in order."""
    outputs = []
    for start, count, slot in prefills:
        rows = slice(start, start + count)
        out, states[slot] = chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot])
        outputs.append(out)
    return torch.cat(outputs)


def short_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    """One input x [B, C] per sequence through the depthwise causal convolution weight [C, K]: each sequence's last
    K-1 inputs (`conv_state` [slots, C, K-1] at `slots` [B]) are shifted by one in place. Returns silu(conv)."""
    window = torch.cat([conv_state[slots], x[:, :, None]], dim=-1)  # [B, C, K]
    conv_state[slots] = window[:, :, 1:]
    return F.silu((window * weight).sum(dim=-1))
