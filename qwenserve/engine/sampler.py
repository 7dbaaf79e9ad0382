"""Choose the next token of every sampling row at once.

Order of operations (as in vLLM): penalties (repetition over prompt + output, presence and frequency over
output), min_tokens (EOS and stop ids masked), temperature, then top-k / top-p / min-p filtering, then a
Gumbel-style draw: argmax(probs / E) with E ~ Exp(1). Greedy rows take argmax of the penalised logits.

Reproducibility: a seeded row draws E from a generator seeded by hash(seed, output position), so its
token at position i depends only on (seed, i) and the logits - not on what else is in the batch, and a
request resumed from its already-generated tokens continues exactly as it would have.
Logprobs are reported from the raw model distribution (log_softmax of the logits before any transform).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from qwenserve.engine.grammar import GrammarBackend
from qwenserve.engine.outputs import TokenLogprob
from qwenserve.engine.sampling_params import SamplingParams


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

    def __init__(self, seed: int = 0, grammar: GrammarBackend | None = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator()
        self.grammar = grammar

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample one token per row of `logits` [num_rows, vocab] (fp32, CPU); logprobs where asked for."""
        tokens = self._choose(logits, rows)
        return tokens, self._logprobs(logits, rows, tokens)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        params = [r.params for r in rows]
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if all(p.greedy and not _has_penalty(p) for p in params) and not any(_in_min_tokens(r) for r in rows) \
                and not constrained:
            return logits.argmax(dim=-1).tolist()
        logits = logits.clone()
        self._apply_penalties(logits, rows)
        for i, r in enumerate(rows):
            if _in_min_tokens(r) and r.banned_token_ids:
                logits[i, list(r.banned_token_ids)] = float("-inf")
        if constrained:
            assert self.grammar is not None, "a constrained row needs the engine's grammar backend"
            self.grammar.mask_rows(logits, constrained, [rows[i].grammar for i in constrained])
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            sub = logits[sampled]
            temps = torch.tensor([params[i].temperature for i in sampled], dtype=sub.dtype)
            sub = self._filter(sub / temps[:, None], [params[i] for i in sampled])
            probs = torch.softmax(sub, dim=-1)
            noise = self._exponential_noise([rows[i] for i in sampled], probs.shape[1])
            tokens[sampled] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()

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

    def _exponential_noise(self, rows: list[SamplingRow], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(rows), vocab)
        for i, r in enumerate(rows):
            if r.params.seed is None:
                noise[i].exponential_(generator=self.generator)
            else:
                self._row_generator.manual_seed(position_seed(r.params.seed, len(r.output_token_ids)))
                noise[i].exponential_(generator=self._row_generator)
        return noise

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
