"""flash-attn's paged-KV kernels (CUDA only): `flash_attn_with_kvcache` for pure decode steps and
`flash_attn_varlen_func` with `block_table` for steps that contain prefill chunks.

The cache layout [num_blocks, block_size, kv_heads, head_dim] per layer is exactly what both kernels take,
so no copy is needed; flash-attn's paged path requires block_size to be a multiple of 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenserve.models.forward_context import AttentionBatch, DecodeRows

FLASH_BLOCK_MULTIPLE = 256


def flash_attn_available() -> bool:
    """True where the flash_attn package imports and CUDA is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(slots=True)
class FlashAttentionMeta:
    slot_mapping: torch.Tensor
    all_decode: bool
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor
    max_query_len: int
    max_context_len: int


class FlashAttentionBackend:
    """Attention through flash-attn's paged kernels; same interface and results as the torch backend."""

    name = "flash_attn"

    def __init__(self, block_size: int) -> None:
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(
                f"flash-attn's paged KV needs block_size to be a multiple of {FLASH_BLOCK_MULTIPLE}, got {block_size}"
            )
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self.block_size = block_size

    def prepare(self, batch: AttentionBatch, device: torch.device) -> FlashAttentionMeta:
        """Padded int32 block table, cumulative query/key lengths and maxima for the kernels."""
        max_blocks = max(len(t) for t in batch.block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables]
        query_lens = torch.tensor(batch.query_lens, dtype=torch.int32)
        context_lens = torch.tensor(batch.context_lens, dtype=torch.int32)
        zero = torch.zeros(1, dtype=torch.int32)
        return FlashAttentionMeta(
            slot_mapping=batch.slot_mapping,
            all_decode=batch.num_decodes == len(batch.query_lens),
            block_table=torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True),
            context_lens=context_lens.to(device, non_blocking=True),
            cu_seqlens_q=torch.cat([zero, query_lens.cumsum(0, dtype=torch.int32)]).to(device, non_blocking=True),
            cu_seqlens_k=torch.cat([zero, context_lens.cumsum(0, dtype=torch.int32)]).to(device, non_blocking=True),
            max_query_len=max(batch.query_lens),
            max_context_len=max(batch.context_lens),
        )

    def decode_rows(self, meta: FlashAttentionMeta) -> DecodeRows | None:
        """None: the CPU kernels never attend a CUDA cache."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: FlashAttentionMeta,
    ) -> torch.Tensor:
        """Store k/v into the cache, then attend (see AttentionBackend.forward)."""
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        if meta.all_decode:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.context_lens,
                block_table=meta.block_table,
                causal=True,
            ).squeeze(1)
        else:
            # Causal masking in flash-attn aligns the queries to the end of each key range, which is what
            # a chunk continuing a cached prefix needs.
            out = self._varlen(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_k,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_context_len,
                causal=True,
                block_table=meta.block_table,
            )
        return out.reshape(num_tokens, num_heads * head_dim)
