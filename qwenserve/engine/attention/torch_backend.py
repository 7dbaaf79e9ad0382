"""Portable attention over the paged KV cache with plain PyTorch ops (CPU and CUDA).

Decode rows (one query token) in fp32 on CPU, over an fp32 or bf16 cache, go to the C kernel of qwenserve.cpu_kernels, which reads each
sequence's blocks where they lie, when the backend is given the kernels (engine/kernels.py chooses, once). Elsewhere, or without the kernels,
they are attended as one padded batch: their blocks are gathered with a single index into
[batch, max_context, kv_heads, head_dim] and masked by length. Prefill chunks are attended one sequence at a time, which costs nothing extra because each chunk is
already a large matrix product. A bf16 model's prefill attention is PyTorch's bf16 attention (on the CPU's bf16 units, 3-4x
faster than fp32's at a 2,000-token prompt, where attention was half of the prefill's time), or on a CPU with AMX our
kernel on AMX tiles (prefill_attention.c; engine/kernels.py chooses), which reads a later chunk's cached keys where
they lie (PyTorch's needs them gathered first: a 2,048-token prompt in 512-token chunks spent 14% of its samples in
PyTorch's attention and 8% in the gathers); an fp32 model's over a bf16 cache widens the keys it reads. On a CPU without
AMX PyTorch's bf16 attention is the slower one (2,000 tokens, 16 heads, an AVX512_BF16 Xeon: 146-159 ms a layer in bf16,
96-105 ms in fp32), so there a bf16 model's prefill chunks are attended in fp32 and rounded back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.models.forward_context import AttentionBatch, DecodeRows


@dataclass(slots=True)
class TorchAttentionMeta:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool: key is real
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64, for the CPU kernel (None: gather + SDPA)
    # (token start, query len, context len, block ids, key slots [context len]) of each prefill chunk; a chunk that
    # starts the sequence has neither (its own keys, is_causal). The slots (key j's row in a layer's flattened cache)
    # are built for the AMX kernel only.
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]


class TorchAttentionBackend:
    """Default backend: SDPA over blocks gathered from the pool."""

    def __init__(self, block_size: int, cpu_kernels: CpuKernels | None = None, amx_prefill: bool = False,
                 widen_prefill: bool = False) -> None:
        """`cpu_kernels`: send fp32 CPU decode rows to their paged-decode kernel (None: gather and SDPA);
        `amx_prefill`: attend a bf16 model's prefill chunks over a bf16 cache on AMX tiles (prefill_attention.c) where
        the kernel runs, PyTorch's flash attention where it declines; `widen_prefill`: a bf16 model's prefill chunks
        attended by PyTorch in fp32 (a CPU without AMX, where its bf16 attention is the slower)."""
        self.block_size = block_size
        self.cpu_kernels = cpu_kernels
        self.amx_prefill = amx_prefill and cpu_kernels is not None
        self.widen_prefill = widen_prefill and not self.amx_prefill
        self.name = ("torch+amx_prefill" if self.amx_prefill else "torch+fp32_prefill" if self.widen_prefill
                     else "torch")
        # Reused buffers for gathered keys and values. A fresh multi-megabyte tensor per layer is
        # mmap'ed by the allocator and page-faulted on first touch, which costs more than the copy itself on CPU.
        self._workspace: list[torch.Tensor | None] = [None, None]

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, which: int) -> torch.Tensor:
        """Whole blocks of one layer's cache [num_blocks, block_size, heads, dim], copied into a workspace."""
        index = blocks.reshape(-1)
        need = index.numel() * cache[0].numel()
        buf = self._workspace[which]
        if buf is None or buf.numel() < need or buf.dtype != cache.dtype or buf.device != cache.device:
            buf = torch.empty(need + need // 4, dtype=cache.dtype, device=cache.device)
            self._workspace[which] = buf
        out = buf[:need].view(index.numel(), *cache.shape[1:])
        return torch.index_select(cache, 0, index, out=out)

    def prepare(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMeta:
        """Pad the decode rows' block tables and build their length mask; list the prefill segments."""
        nd = batch.num_decodes
        table = mask = kernel_lens = None
        if nd:
            max_blocks = max(len(t) for t in batch.block_tables[:nd])
            padded = [t + [0] * (max_blocks - len(t)) for t in batch.block_tables[:nd]]
            table = torch.tensor(padded, dtype=torch.long, device=device)
            lens = torch.tensor(batch.context_lens[:nd], dtype=torch.long, device=device)
            if self.cpu_kernels is not None and device.type == "cpu":
                kernel_lens = lens
            else:
                keys = torch.arange(max_blocks * self.block_size, device=device)
                mask = (keys[None, :] < lens[:, None])[:, None, None, :]
        prefills = []
        start = nd
        for i in range(nd, len(batch.query_lens)):
            qlen, ctx = batch.query_lens[i], batch.context_lens[i]
            # A chunk that starts at position 0 attends only to itself: no gather needed.
            blocks = slots = None
            if ctx != qlen:
                used = batch.block_tables[i][: (ctx + self.block_size - 1) // self.block_size]
                blocks = torch.tensor(used, dtype=torch.long, device=device)
                if self.amx_prefill and device.type == "cpu":  # built once for all layers
                    slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).view(-1)[:ctx]
            prefills.append((start, qlen, ctx, blocks, slots))
            start += qlen
        return TorchAttentionMeta(batch.slot_mapping, nd, table, mask, kernel_lens, prefills)

    def decode_rows(self, meta: TorchAttentionMeta) -> DecodeRows | None:
        """The step as DecodeRows when its rows are all decode tokens for the CPU kernel (see AttentionBackend)."""
        if (meta.prefills or not meta.num_decodes or meta.decode_context_lens is None
                or meta.decode_block_table is None or meta.slot_mapping.numel() != meta.num_decodes):
            return None
        return DecodeRows(meta.slot_mapping, meta.decode_block_table, meta.decode_context_lens)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttentionMeta,
    ) -> torch.Tensor:
        """Store k/v into the cache, then attend (see AttentionBackend.forward)."""
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        flat_k = k_cache.view(-1, kv_heads, head_dim)
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        if k_cache.dtype != k.dtype:
            # A cache in another dtype (bf16 KV for an fp32 model): stored rounded to nearest even, and this step's
            # own keys are attended as stored, so a prompt gives the same KV however it is chunked or cached.
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            flat_k.index_copy_(0, meta.slot_mapping, k)
            flat_v.index_copy_(0, meta.slot_mapping, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            flat_k.index_copy_(0, meta.slot_mapping, k)
            flat_v.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        gqa = num_heads != kv_heads
        nd = meta.num_decodes
        if nd and meta.decode_context_lens is not None and (
                q.dtype == torch.float32 or q.dtype == k_cache.dtype == torch.bfloat16):
            # fp32 queries, or a bf16 model's over its bf16 cache (widened and rounded back in the kernel's call).
            rows = q[:nd]
            if q.dtype == torch.float32 or rows.stride(-1) != 1 or rows.stride(-2) != head_dim:
                rows = rows.contiguous()
            self.cpu_kernels.paged_decode_attention(rows, k_cache, v_cache, meta.decode_block_table,
                                                    meta.decode_context_lens, out[:nd], head_dim**-0.5)
        elif nd:
            table = meta.decode_block_table
            if meta.decode_mask is None:  # fp16/bf16 on CPU: no kernel for it, so build the mask here
                keys = torch.arange(table.shape[1] * self.block_size, device=q.device)
                meta.decode_mask = (keys[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]
            keys = self._gather(k_cache, table, 0).view(nd, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            values = self._gather(v_cache, table, 1).view(nd, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
            out[:nd] = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=gqa
            ).squeeze(2)
        for start, qlen, ctx, blocks, slots in meta.prefills:
            if self.amx_prefill and q.dtype == k_cache.dtype == torch.bfloat16:
                # A first chunk's keys are its own rows; a later one's are read where the cache holds them.
                keys, values = (k[start : start + qlen], v[start : start + qlen]) if blocks is None else (flat_k, flat_v)
                if self.cpu_kernels.prefill_attention_amx(q[start : start + qlen], keys, values, head_dim**-0.5,
                                                          out[start : start + qlen], slots) is not None:
                    continue
            wide = torch.float32 if self.widen_prefill else q.dtype
            qs = q[start : start + qlen].transpose(0, 1).unsqueeze(0).to(wide)
            if blocks is None:
                ks = k[start : start + qlen].transpose(0, 1).unsqueeze(0).to(wide)
                vs = v[start : start + qlen].transpose(0, 1).unsqueeze(0).to(wide)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            else:
                ks = self._gather(k_cache, blocks, 0).view(-1, kv_heads, head_dim)[:ctx].to(wide)
                vs = self._gather(v_cache, blocks, 1).view(-1, kv_heads, head_dim)[:ctx].to(wide)
                ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
                # Query i sits at absolute position ctx - qlen + i and sees keys up to it.
                causal = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal, enable_gqa=gqa)
            out[start : start + qlen] = o.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)
