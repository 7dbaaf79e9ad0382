"""The LM head screened by 8-bit codes, for steps whose every row reads only its few largest logits (greedy, or top_k
sampling; nothing that moves logits, no logprobs): the same tokens as the full head, from about half of its bytes.

Why: a batch-1 decode step reads the whole head. Qwen3-0.6B's is 151,936 x 1,024, 311 MB in bf16: a quarter of a bf16
step's bytes, more than half of a W4A16 one's (its layers' codes are 234 MB).

How, exactly: the head is also held as 8-bit codes in groups of 128 (quantized_head.quantize_rows), built at load. A
screened step multiplies its rows by the codes (the W8A16 kernel), bounds how far each code logit can lie from the
logit the full head computes, and computes with the full head's own product, on the panels that hold them, only the
vocabulary rows whose upper bound reaches the K-th best lower bound (K: 1 greedy, else the top_k); every other logit
comes back -inf. At least K rows lie at or above that lower bound, so any row that the full head could place among the
K largest (or tie with the K-th) is among those, computed by the same product in the same order: the largest logit,
the first of equal ones, and the top K logits (the ones that tie at the K-th aside, of which either may be taken, as
anywhere in the sampler) are the full head's, and so is every draw from them.

The bound for vocabulary row r and a step's row x of k inputs (|x|_1, max|x|), computed with the candidates in one C
call (cpu_kernels/head_screen.c):
    |code logit - full logit| <= |x|_1 (1 + 2^-10) reach_r + k 2^-14 max|x| span_r, then x 1.01, + 2^-20 max|code logit|
with span_r = 255 x its largest scale (at least its largest |weight| and |code - zero| x scale) and reach_r =
max_i |w_ri - dequantized_ri| (measured at load) + (2^-16 + k 2^-22) span_r. The second term is the W8A16 kernel's
rounding of x to 16-bit integers, blocks of 32 inputs (at most 2^-15 of a block's largest |x| off; 2^-14 taken); the
(2^-16 + k 2^-22) span_r |x|_1 covers both products' fp32 rounding, at worst (k - 1) 2^-24 sum |x w| for the full
head's one running sum a column, and (k / 32 + 128) 2^-24 span_r |x|_1 for the codes' sums of blocks and of x per
group; the last two terms cover the bound's own fp32 arithmetic. tests/models/test_screened_head.py checks that the bound
holds and that the tokens equal the full head's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PANEL, PackedWeight
from qwenserve.cpu_kernels.quant_weight import QuantWeight
from qwenserve.models.ops import Ops
from qwenserve.models.quantized_head import GROUP, ROWS_AT_ONCE, quantized_chunks

BITS = 8
# The most of a row's highest logits a screened step serves (a top_k up to this): Qwen's generation_config samples
# from the top 20.
MOST_LARGEST = 64
# A step whose candidates fill more than this share of the head's panels computes the whole head instead.
MOST_PANELS = 1 / 8

log = logging.getLogger(__name__)


class ScreenedHead:
    """A packed LM head's 8-bit codes with each vocabulary row's `reach` and `span` (above), for steps of up to
    `max_rows` rows (from there the full head runs another product: the screen would not compute its logits)."""

    def __init__(self, head: PackedWeight, kernels: CpuKernels, max_rows: int) -> None:
        n, k = head.shape
        groups = -(-k // GROUP)
        codes = torch.empty(n, k, dtype=torch.uint8)
        scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
        reach, span = torch.empty(n), torch.empty(n)
        per = ROWS_AT_ONCE // PANEL
        for p0 in range(0, n // PANEL, per):
            # The panels' rows unpacked a slice at a time: [panels, k, 16] -> [rows, k].
            plain = head.panels[p0:p0 + per].transpose(1, 2).reshape(-1, k)
            for chunk in quantized_chunks(plain, BITS, GROUP):
                rows = slice(p0 * PANEL + chunk.first, p0 * PANEL + chunk.first + chunk.codes.shape[0])
                codes[rows] = chunk.codes.reshape(chunk.codes.shape[0], -1)[:, :k].to(torch.uint8)
                scales[rows], zeros[rows] = chunk.scales, chunk.zeros
                # (code - zero) x scale is exact in fp32 (an fp16 times an integer below 2^9); the difference from
                # the weight is rounded at most 2^-24 of it (made up for below).
                off = (chunk.values - chunk.scales[..., None] * (chunk.codes - chunk.zeros[..., None])).abs()
                reach[rows] = off.amax(dim=(1, 2))
                span[rows] = chunk.scales.amax(dim=1) * ((1 << BITS) - 1)
        self.codes = QuantWeight.pack(codes, scales, zeros, BITS, GROUP)
        self.reach = (reach + span * (2**-16 + k * 2**-22)) * (1 + 2**-16)
        self.span = span
        self.kernels, self.max_rows = kernels, max_rows
        # head_screen.c's scratch and result: which panels hold candidates.
        self._marks = torch.empty(n // PANEL, dtype=torch.uint8)
        self._panels = torch.empty(n // PANEL, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.reach.nbytes + self.span.nbytes + self._marks.nbytes + self._panels.nbytes

    def logits(self, x: torch.Tensor, head: PackedWeight, out: torch.Tensor | None = None,
               largest: int = 1) -> torch.Tensor | None:
        """fp32 logits [rows, vocab] of x [rows, k] (in `out` where given) that are the full head's (the kernels'
        `linear_packed` on its panels) wherever they may be among a row's `largest` highest, -inf elsewhere; None
        where the screen does not apply (more rows than `max_rows`, `largest` above MOST_LARGEST, a value of x not
        finite, too many candidates): then compute the full head."""
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        m = rows.shape[0]
        if m > self.max_rows or not 1 <= largest <= min(MOST_LARGEST, head.shape[0]):
            return None
        approx = self.kernels.linear_quant(rows, self.codes)
        result = torch.empty_like(approx) if out is None else out
        count = self.kernels.head_screen(rows, approx, self.reach, self.span, result, self._marks, self._panels,
                                         largest)
        total = head.panels.shape[0]
        if count <= 0 or count > total * MOST_PANELS:
            return None  # none: x or the bound is not finite
        panels = self._panels[:count]
        exact = self.kernels.linear_packed(rows, PackedWeight(head.panels.index_select(0, panels)))
        columns = (panels[:, None] * PANEL + torch.arange(PANEL)).flatten()
        return result.index_copy_(1, columns, exact)

def with_screened_head(ops: Ops, kernels: CpuKernels, max_rows: int) -> Ops:
    """`ops` whose weight preparation also builds the model's ScreenedHead (where its LM head is packed), for steps of
    up to `max_rows` rows. The ops' name stays: their products are the same, and the start-up log says so."""
    return dataclasses.replace(ops, prepare=_screening(ops.prepare, kernels, max_rows))


def _screening(prepare: Callable[[nn.Module], int], kernels: CpuKernels,
               max_rows: int) -> Callable[[nn.Module], int]:
    def prepare_then_screen(model: nn.Module) -> int:
        done = prepare(model)
        for module in model.modules():
            head = vars(module).get("lm_head")
            if not isinstance(head, PackedWeight) or head.panels.dim() != 3 or not hasattr(module, "lm_head_screen"):
                continue
            start = time.perf_counter()
            screen = ScreenedHead(head, kernels, max_rows)
            if not bool(torch.isfinite(screen.reach).all()):
                log.warning("LM head not screened: it holds values that are not finite")
                continue
            module.lm_head_screen = screen
            log.info("LM head screened for greedy and top-k steps of up to %d rows by %d-bit codes: %.1f MB beside "
                     "its %.1f MB, in %.1f s (--no-screen-lm-head: not)", max_rows, BITS, screen.nbytes / 1e6, head.nbytes / 1e6,
                     time.perf_counter() - start)
            done += 1
        return done

    return prepare_then_screen
