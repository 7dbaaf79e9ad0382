"""Choose the next token of every sampling row at once.

Order of operations (as in vLLM): penalties (repetition over prompt + output, presence and frequency over
output), min_tokens (EOS and stop ids masked), temperature, then top-k / top-p / min-p filtering, then one
uniform number a row picks the token by inverse CDF (categorical.py). Greedy rows take argmax of the penalised
logits. Filters work on each row's highest logits (topk) rather than a sort of the vocabulary where that is exact.

Reproducibility: a seeded row draws its uniform from a generator seeded by hash(seed, output position), so its
token at position i depends only on (seed, i) and the logits - not on what else is in the batch, and a
request resumed from its already-generated tokens continues exactly as it would have.
Logprobs are reported from the raw model distribution (log_softmax of the logits before any transform).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qwenserve.engine import categorical
from qwenserve.engine.grammar import GrammarBackend
from qwenserve.engine.outputs import TokenLogprob
from qwenserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qwenserve.cpu_kernels.library import CpuKernels

# How many of a row's highest logits a top-p filter without top_k looks at before it sorts the whole row.
CANDIDATES = 1024


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs about one row: its settings and its tokens so far."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()  # masked while output is shorter than min_tokens
    grammar: Any = None  # a structured-output matcher: only the tokens it allows next may be drawn


def position_seed(seed: int, position: int) -> int:
    """The generator seed for output position `position` of a request seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Sampler:
    """Vectorised sampling over a batch of logits rows."""

    def __init__(self, seed: int = 0, grammar: GrammarBackend | None = None,
                 cpu_kernels: CpuKernels | None = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator()
        self.grammar = grammar
        self._cpu_kernels = cpu_kernels  # the whole-vocabulary draw in one C call where they loaded

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample one token per row of `logits` [num_rows, vocab] (fp32, CPU); logprobs where asked for."""
        tokens = self._choose(logits, rows)
        return tokens, self._logprobs(logits, rows, tokens)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        params = [r.params for r in rows]
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        banned = [i for i, r in enumerate(rows) if _in_min_tokens(r) and r.banned_token_ids]
        if any(_has_penalty(p) for p in params) or banned or constrained:
            logits = logits.clone()  # edited in place below; the caller's logits also feed the logprobs
            self._apply_penalties(logits, rows)
            for i in banned:
                logits[i, list(rows[i].banned_token_ids)] = float("-inf")
            if constrained:
                assert self.grammar is not None, "a constrained row needs the engine's grammar backend"
                self.grammar.mask_rows(logits, constrained, [rows[i].grammar for i in constrained])
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return self._argmax(logits).tolist()
        tokens = [0] * len(rows)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            for i, token in zip(greedy, self._argmax(logits[greedy]).tolist(), strict=True):
                tokens[i] = token
        sub = logits[sampled] if greedy else logits
        drawn = self._draw(sub, [rows[i] for i in sampled])
        for i, token in zip(sampled, drawn, strict=True):
            tokens[i] = token
        return tokens

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: one C pass where the kernels loaded (PyTorch's two-level form took ~0.24 ms of a
        batch-1 step's 152k row), else categorical.argmax."""
        if (self._cpu_kernels is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1
                and logits.shape[-1] > 0):
            return self._cpu_kernels.argmax(logits)
        return categorical.argmax(logits)

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """One token per row of `logits` (not modified) at its temperature, after its top-k / top-p / min-p
        filters. Temperature scales only what each path reads (a 152k row copied costs more than its draw)."""
        uniforms = self._uniforms(rows)
        vocab = logits.shape[1]
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)[:, None]
        chosen = torch.empty(len(rows), dtype=torch.long)
        top_k = [r.params.top_k if r.params.top_k < vocab else 0 for r in rows]  # k >= vocab keeps every token
        whole = [i for i, r in enumerate(rows) if top_k[i] == 0 and r.params.top_p >= 1.0]
        narrow = sorted(set(range(len(rows))) - set(whole))
        if whole:
            sub = logits if len(whole) == len(rows) else logits[whole]
            chosen[whole] = self._draw_whole(sub, temps[whole], torch.tensor([rows[i].params.min_p for i in whole],
                                                                              dtype=logits.dtype), uniforms[whole])
        if narrow:
            sub = logits if len(narrow) == len(rows) else logits[narrow]
            picked, incomplete = self._draw_among_candidates(sub, temps[narrow], [top_k[i] for i in narrow],
                                                             [rows[i].params for i in narrow], uniforms[narrow])
            if incomplete:  # their top-p nucleus reaches past the candidates: filter the whole vocabulary
                again = [narrow[j] for j in incomplete]
                filtered = self._filter(sub[incomplete] / temps[again], [rows[i].params for i in again])
                picked[incomplete] = categorical.draw(torch.softmax(filtered, dim=-1), uniforms[again])
            chosen[narrow] = picked
        return chosen.tolist()

    def _draw_whole(self, logits: torch.Tensor, temps: torch.Tensor, min_p: torch.Tensor,
                    uniforms: torch.Tensor) -> torch.Tensor:
        """Rows drawn over the whole vocabulary: weights exp((logit - max) / T) (the draw needs no normalised
        probabilities, and min_p compares with the best token's weight, which is 1), in one C call where the kernels
        loaded (rows with no finite logit take PyTorch's form, as everywhere else)."""
        if self._cpu_kernels is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            chosen = self._cpu_kernels.draw_tempered(logits, temps[:, 0], min_p, uniforms)
            if bool((chosen >= 0).all()):
                return chosen
        weights = logits.sub(logits.max(dim=-1, keepdim=True).values).div_(temps).exp_()
        if bool((min_p > 0).any()):
            weights.masked_fill_(weights < min_p[:, None], 0.0)
        return categorical.draw(weights, uniforms)

    @staticmethod
    def _draw_among_candidates(
        logits: torch.Tensor, temps: torch.Tensor, top_k: list[int], params: list[SamplingParams],
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, list[int]]:
        """Draw among each row's highest CANDIDATES logits (its top_k where it has one) rather than sorting the
        vocabulary (18 ms a 152k row here against 0.07 for its top 20, categorical.topk). A row without top_k whose top_p nucleus
        is not complete inside the candidates is listed as incomplete (its token here is not to be used)."""
        width = min(max(k if k > 0 else CANDIDATES for k in top_k), logits.shape[1])
        values, ids = categorical.topk(logits, width)  # a positive temperature keeps the order
        values = values / temps
        ranks = torch.arange(width)[None, :]
        remove = ranks >= torch.tensor([k if k > 0 else width for k in top_k])[:, None]
        masked = values.masked_fill(remove, float("-inf"))
        # A row's probabilities are over its top_k, or, without one, over the whole vocabulary.
        whole = torch.tensor([k == 0 for k in top_k])
        norm = torch.logsumexp(masked, dim=-1)
        if bool(whole.any()):
            norm[whole] = torch.logsumexp(logits[whole] / temps[whole], dim=-1)
        probs = torch.exp(masked - norm[:, None])
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept).
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)[:, None]
        remove |= mass_before >= top_p
        remove |= probs < torch.tensor([p.min_p for p in params], dtype=probs.dtype)[:, None] * probs[:, :1]
        remove[:, 0] = False
        incomplete = (whole & (probs.sum(dim=-1) < top_p[:, 0])).nonzero().flatten().tolist()
        picked = categorical.draw(probs.masked_fill(remove, 0.0), uniforms)
        return ids.gather(1, picked[:, None]).squeeze(1), incomplete

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One uniform number a row: a seeded row's from its (seed, output position) alone."""
        uniforms = torch.empty(len(rows), dtype=torch.float64)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self._row_generator.manual_seed(position_seed(r.params.seed, len(r.output_token_ids)))
                uniforms[i] = torch.rand(1, dtype=torch.float64, generator=self._row_generator)[0]
        return uniforms

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        idx = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if not idx:
            return
        vocab = logits.shape[1]
        sub = logits[idx]
        out_counts = _token_counts([rows[i].output_token_ids for i in idx], vocab)
        prompt_seen = _token_counts([rows[i].prompt_token_ids for i in idx], vocab) > 0
        rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], dtype=sub.dtype)[:, None]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in idx], dtype=sub.dtype)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in idx], dtype=sub.dtype)[:, None]
        seen = prompt_seen | (out_counts > 0)
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
        logits[idx] = sub

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask tokens outside top-k, outside the top-p nucleus, or below min_p x the best probability."""
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m == 0 for m in min_p):
            return logits
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        k = torch.tensor([k if k > 0 else vocab for k in top_k])[:, None]
        remove = ranks >= k
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove |= mass_before >= torch.tensor(top_p)[:, None]
        remove |= sorted_probs < torch.tensor(min_p)[:, None] * sorted_probs[:, :1]
        remove[:, 0] = False
        mask = torch.zeros_like(remove).scatter_(1, order, remove)
        return logits.masked_fill(mask, float("-inf"))

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int]) -> list[TokenLogprob | None]:
        result: list[TokenLogprob | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs or r.params.top_logprobs]
        if not wanted:
            return result
        lp = torch.log_softmax(logits[wanted], dim=-1)
        for j, i in enumerate(wanted):
            top: tuple[tuple[int, float], ...] = ()
            if rows[i].params.top_logprobs:
                values, ids = lp[j].topk(rows[i].params.top_logprobs)
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            result[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), top)
        return result


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _in_min_tokens(r: SamplingRow) -> bool:
    return len(r.output_token_ids) < r.params.min_tokens


def _token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """[rows, vocab] occurrence counts, built with one scatter (padding goes to an extra column)."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.long)
    for i, t in enumerate(token_lists):
        if t:
            ids[i, : len(t)] = torch.tensor(t)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]
