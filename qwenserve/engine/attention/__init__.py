"""Attention backends over the paged KV cache; `select_backend` picks flash-attn where it can run."""

from __future__ import annotations

import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.attention.flash_backend import (
    FLASH_BLOCK_MULTIPLE,
    FlashAttentionBackend,
    flash_attn_available,
)
from qwenserve.engine.attention.torch_backend import TorchAttentionBackend
from qwenserve.models.forward_context import AttentionBackend, AttentionBatch, ForwardContext

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "ForwardContext",
    "FlashAttentionBackend",
    "TorchAttentionBackend",
    "default_block_size",
    "select_backend",
]


def _flash_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available()


def default_block_size(device: torch.device, dtype: torch.dtype) -> int:
    """256 tokens where flash-attn's paged kernels will run (their minimum page), else 16: small blocks
    make prefix caching share more of a prompt and waste less of the pool on partial blocks."""
    return FLASH_BLOCK_MULTIPLE if _flash_usable(device, dtype) else 16


def select_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int,
                   cpu_kernels: CpuKernels | None = None, amx_prefill: bool = False,
                   widen_prefill: bool = False) -> AttentionBackend:
    """"auto" picks flash-attn on CUDA with fp16/bf16 and a compatible block size, the torch backend
    otherwise; "torch" and "flash_attn" force one (the latter fails loudly when it cannot run). The torch backend
    runs CPU decode rows in `cpu_kernels` when given, and with `amx_prefill` a bf16 model's first prefill chunks on
    AMX tiles, or with `widen_prefill` in fp32 (engine/kernels.py decides)."""
    if name == "torch":
        return TorchAttentionBackend(block_size, cpu_kernels, amx_prefill, widen_prefill)
    if name == "flash_attn":
        if not flash_attn_available():
            raise RuntimeError("attention backend 'flash_attn' requested but flash_attn or CUDA is unavailable")
        return FlashAttentionBackend(block_size)
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flash_attn")
    if _flash_usable(device, dtype) and block_size % FLASH_BLOCK_MULTIPLE == 0:
        return FlashAttentionBackend(block_size)
    return TorchAttentionBackend(block_size, cpu_kernels, amx_prefill, widen_prefill)
