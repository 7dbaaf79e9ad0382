"""Turns a scheduled step into one forward pass over the flattened tokens, and owns the KV cache tensor.

The cache is one tensor [num_kv_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]; a block id
indexes the same slot range in every layer. Only the rows that are sampled reach the LM head. A hybrid model keeps
KV for its full-attention layers only; its linear-attention layers' per-sequence states live in a
LinearStateCache of `num_state_slots` slots (state_pool.py).
"""

from __future__ import annotations

import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.host_memory import zeroed
from qwenserve.engine.kv_handoff import KVExportTarget
from qwenserve.engine.outputs import TokenLogprob
from qwenserve.engine.scheduler import ScheduledSequence
from qwenserve.engine.sequence import Sequence
from qwenserve.kv_layout import LinearState
from qwenserve.models import QwenForCausalLM
from qwenserve.models.forward_context import AttentionBackend, AttentionBatch, ForwardContext
from qwenserve.models.gated_delta import PrefillChunks
from qwenserve.models.linear_state import LinearAttentionBatch, LinearStateCache

#: Prompt positions whose logits are computed at once for prompt logprobs (~80 MB of fp32 logits at a 152k vocabulary).
PROMPT_LOGPROB_ROWS = 128


class ModelRunner:
    """Runs the model on the engine thread; everything here assumes torch.inference_mode."""

    def __init__(
        self,
        model: QwenForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        num_state_slots: int = 0,
        cpu_kernels: CpuKernels | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`kv_dtype`: the KV cache's dtype (None: `dtype`, the model's)."""
        cfg = model.cfg
        self.model = model
        self.backend = backend
        self._logits = torch.empty(0)
        self.block_size = block_size
        self.device = device
        # An import into a CPU cache scatters its rows with the C kernel, when the engine chose the kernels.
        self._scatter_kernels = cpu_kernels if device.type == "cpu" else None
        self.kv_cache = zeroed((len(cfg.kv_layers), 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
                               kv_dtype or dtype, device)
        self.linear_state = (
            LinearStateCache.for_model(cfg, num_state_slots, dtype, device) if cfg.is_hybrid else None
        )

    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[ScheduledSequence]]:
        """Forward the step; returns fp32 CPU logits [num_sampling_rows, vocab] and the rows' sequences
        in the same order."""
        items = sorted(scheduled, key=lambda s: s.num_tokens != 1)  # one-token rows first (stable)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        sampling: list[ScheduledSequence] = []
        scored: list[tuple[Sequence, int, int]] = []  # (sequence, first row, rows) to score for prompt logprobs
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            if seq.needs_prompt_logprobs:
                first = max(start, len(seq.prompt_logprobs))  # a recomputed position keeps its first entry
                last = min(end, seq.prompt_len - 1)  # position p's logits predict the prompt's token p + 1
                if first < last:
                    scored.append((seq, len(input_ids) + first - start, last - first))
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if item.samples:
                sample_index.append(len(input_ids) - 1)
                sampling.append(item)
        batch = AttentionBatch(
            query_lens=[s.num_tokens for s in items],
            context_lens=[s.seq.num_computed_tokens + s.num_tokens for s in items],
            block_tables=[s.seq.block_table for s in items],
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True),
            num_decodes=sum(1 for s in items if s.num_tokens == 1),
        )
        ctx = ForwardContext(self.backend, self.backend.prepare(batch, self.device), self.kv_cache,
                             self._linear_batch(items, batch.num_decodes))
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True),
            ctx,
        )
        for seq, row, count in scored:
            self._score_prompt(seq, hidden[row : row + count])
        if not sampling:
            return torch.empty(0), sampling
        rows = hidden[torch.tensor(sample_index, device=self.device)]
        # A grammar is the sequence's (a reasoning block lets it start later), not only its request's.
        read = [0 if item.seq.grammar is not None else item.seq.sampling.logits_read for item in sampling]
        largest = 0 if 0 in read else max(read)
        return self.model.compute_logits(rows, self._logits_buffer(len(sampling)), largest).cpu(), sampling

    def _linear_batch(self, items: list[ScheduledSequence], num_decodes: int) -> LinearAttentionBatch | None:
        """The step's sequences by state slot (hybrid models); the slots of sequences at their first token are
        zeroed first."""
        if self.linear_state is None:
            return None
        fresh = [s.seq.state_slot for s in items if s.seq.num_computed_tokens == 0]
        if fresh:
            self.linear_state.reset(fresh)
        decode_slots = torch.tensor([s.seq.state_slot for s in items[:num_decodes]], dtype=torch.long,
                                    device=self.device)
        prefills, row = [], num_decodes
        for item in items[num_decodes:]:
            prefills.append((row, item.num_tokens, item.seq.state_slot))
            row += item.num_tokens
        return LinearAttentionBatch(self.linear_state, num_decodes, decode_slots, PrefillChunks(prefills))

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Append the logprobs of the prompt tokens these rows predict (the model's raw distribution), each with its
        rank and the `prompt_logprobs` most likely alternatives. In slices: a 4k-token prompt's logits over a 152k
        vocabulary would be 2.5 GB at once."""
        top = seq.sampling.prompt_logprobs or 0
        for lo in range(0, hidden.shape[0], PROMPT_LOGPROB_ROWS):
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[lo : lo + PROMPT_LOGPROB_ROWS]), dim=-1)
            first = len(seq.prompt_logprobs) + 1
            targets = torch.tensor(seq.token_ids[first : first + logprobs.shape[0]], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=1) + 1
            best = logprobs.topk(top, dim=1) if top else None
            for i, token in enumerate(targets.tolist()):
                alternatives = () if best is None else tuple(
                    zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True))
                seq.prompt_logprobs.append(TokenLogprob(token, chosen[i, 0].item(), alternatives, int(ranks[i])))

    def _logits_buffer(self, rows: int) -> torch.Tensor | None:
        """A reused [rows, vocab] buffer for the CPU's logits, or None elsewhere: at 64 rows of a 152k vocabulary
        they are 39 MB, past malloc's mmap threshold, so a fresh tensor would be faulted in page by page at every
        step. The sampler is done with one step's logits before the next step computes."""
        if self.device.type != "cpu":
            return None
        vocab = self.model.cfg.vocab_size
        if self._logits.numel() < rows * vocab:
            self._logits = torch.empty(rows * vocab, dtype=torch.float32)
        return self._logits[: rows * vocab].view(rows, vocab)

    def _token_slots(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        bs, table = self.block_size, seq.block_table
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(num_tokens)], device=self.device)

    def _flat_cache(self) -> torch.Tensor:
        layers, _, blocks, bs, heads, dim = self.kv_cache.shape
        return self.kv_cache.view(layers, 2, blocks * bs, heads, dim)

    def import_kv(self, seq: Sequence, kv: torch.Tensor, num_tokens: int) -> None:
        """Scatter the first `num_tokens` tokens of token-major `kv` [L, 2, T, H, D] into the sequence's blocks."""
        src = kv[:, :, :num_tokens].to(self.device, self.kv_cache.dtype, non_blocking=True)
        flat, slots = self._flat_cache(), self._token_slots(seq, num_tokens)
        if self._scatter_kernels is not None:
            # Runs on the engine's thread, between decode steps: every millisecond here stalls the batch.
            layers, kv_planes, _, heads, dim = flat.shape
            self._scatter_kernels.scatter_rows(flat.view(layers * kv_planes, -1, heads * dim),
                                               src.reshape(layers * kv_planes, num_tokens, heads * dim), slots)
            return
        flat.index_copy_(2, slots, src)

    def import_state(self, seq: Sequence, state: LinearState) -> None:
        """Put a hybrid model's imported linear-attention state in the sequence's state slot."""
        self.linear_state.load(seq.state_slot, state)

    def export_kv(self, seq: Sequence, num_tokens: int, out: torch.Tensor | KVExportTarget) -> None:
        """Gather the sequence's first `num_tokens` tokens of KV into `out` [L, 2, T, H, D] with one copy; a hybrid
        model's linear-attention state (after those tokens: the sequence's last computed) goes with it."""
        slots = self._token_slots(seq, num_tokens)
        if self.linear_state is not None:
            if isinstance(out, torch.Tensor):
                raise TypeError("a hybrid model's KV export needs a KVExportTarget, which takes the "
                                "linear-attention state with the KV, not a bare tensor")
            out.write_state(self.linear_state.slot(seq.state_slot))
        if not isinstance(out, torch.Tensor):
            if self.kv_cache.device.type == "cpu" and out.tensor.dtype == self.kv_cache.dtype:
                out.gather(self._flat_cache(), slots)
                return
            out = out.tensor
        if out.is_contiguous() and out.device == self.kv_cache.device and out.dtype == self.kv_cache.dtype:
            torch.index_select(self._flat_cache(), 2, slots, out=out)
        else:
            out.copy_(torch.index_select(self._flat_cache(), 2, slots))
