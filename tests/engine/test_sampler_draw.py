"""The sampler's draw: inverse CDF over a whole vocabulary without drift, and the filtered distributions it
samples from against a sort-based reference."""

from __future__ import annotations

import torch

from qwenserve.engine import categorical
from qwenserve.engine.sampler import CANDIDATES, Sampler, SamplingRow
from qwenserve.engine.sampling_params import SamplingParams


def cdf_bounds(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each index's [start, end) of the exact cumulative distribution (fp64 over the fp32 weights)."""
    ends = weights.to(torch.float64).cumsum(0)
    ends /= ends[-1].clone()
    return ends - weights.to(torch.float64) / weights.to(torch.float64).sum(), ends


def test_inverse_cdf_lands_where_the_exact_cumulative_weights_say_across_a_whole_vocabulary() -> None:
    # The draw must land on the index whose exact cumulative interval holds u, to within 1e-7 (the fp32 block sums'
    # rounding moves the boundaries by ~1e-8 here): across blocks, past a padded last block, over weightless
    # entries and blocks, at u = 0 and u just below 1.
    gen = torch.Generator().manual_seed(5)
    for n, rows in ((151_936, 3000), (1_000 + 37, 20_000)):  # a whole number of blocks, and a padded row
        weights = torch.rand(n, generator=gen) ** 4
        weights[torch.randint(0, n, (n // 8,), generator=gen)] = 0.0
        weights[-categorical.BLOCK - 5:] = 0.0  # the end weighs nothing: never chosen, even at u near 1
        uniforms = torch.rand(rows, dtype=torch.float64, generator=gen)
        uniforms[:4] = torch.tensor([0.0, 1.0 - 2.0**-53, 0.9999999, 0.5])
        chosen = categorical.draw(weights.expand(rows, n), uniforms)
        assert bool((weights[chosen] > 0).all())
        start, end = cdf_bounds(weights)
        assert bool(((start[chosen] - 1e-7 <= uniforms) & (uniforms <= end[chosen] + 1e-7)).all())


def reference_probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row is drawn from, by a full sort: temperature, top-k, top-p (the crossing token
    kept), min-p relative to the best token."""
    scaled = logits / p.temperature
    values, order = scaled.sort(descending=True)
    k = p.top_k if p.top_k > 0 else len(values)
    probs = torch.softmax(values[:k].to(torch.float64), dim=0)
    keep = (probs.cumsum(0) - probs) < p.top_p
    keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    kept = torch.where(keep, probs, 0.0)
    out = torch.zeros(len(values), dtype=torch.float64)
    out[order[:k]] = kept / kept.sum()
    return out


def test_filtered_draws_follow_the_reference_distribution() -> None:
    sampler = Sampler(seed=3)
    gen = torch.Generator().manual_seed(8)
    peaked = torch.randn(400, generator=gen) * 3  # small nuclei: the candidates hold them
    flat = torch.randn(3 * CANDIDATES, generator=gen) * 0.05  # a top-p nucleus wider than the candidates
    cases = [
        (peaked, SamplingParams(temperature=0.7)),
        (peaked, SamplingParams(temperature=0.6, top_k=20, top_p=0.95)),
        (peaked, SamplingParams(temperature=1.3, top_p=0.8)),
        (peaked, SamplingParams(temperature=1.0, min_p=0.05)),
        (peaked, SamplingParams(temperature=0.9, top_k=7, min_p=0.2)),
        (flat, SamplingParams(temperature=1.0, top_p=0.9)),
    ]
    for logits, params in cases:
        rows = 20_000 if logits is peaked else 4_000  # the flat row's fallback sorts every row
        tokens = torch.tensor(sampler(logits.expand(rows, -1).contiguous(),
                                      [SamplingRow(params, [], []) for _ in range(rows)])[0])
        expected = reference_probabilities(logits, params)
        seen = torch.bincount(tokens, minlength=len(logits)).to(torch.float64) / rows
        assert bool((expected[tokens] > 0).all()), f"{params}: drew a token the filters remove"
        # Five binomial standard deviations a token, plus a little for the filters' fp32 edges.
        bound = 5 * (expected * (1 - expected) / rows).sqrt() + 1e-3
        assert bool(((seen - expected).abs() <= bound).all()), f"{params}: frequencies off the reference"


def test_mixed_batch_rows_each_keep_their_own_filters_and_greedy_rows_their_argmax() -> None:
    sampler = Sampler(seed=0)
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]).repeat(6, 1)
    logits[0, 6] = 9.0  # a greedy row whose argmax differs from the others'
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.9),
              SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=2.0)]
    for _ in range(30):
        tokens, _ = sampler(logits, [SamplingRow(p, [], []) for p in params])
        assert tokens[:4] == [6, 0, 0, 0] and tokens[4] in (0, 1) and 0 <= tokens[5] < 7


def test_argmax_equals_torch_argmax_first_of_ties_and_past_the_last_whole_block() -> None:
    gen = torch.Generator().manual_seed(2)
    for n in (151_936, 1_000 + 37, 100):
        values = torch.randn(9, n, generator=gen).round(decimals=1)  # many ties of the largest value
        values[1, -1] = 99.0  # the largest past the last whole block
        values[2, -3:] = values[2].max()  # tied past it: the earlier one wins
        values[3, :] = 0.0
        values[4, 5] = values[4, n - 1] = 50.0
        assert torch.equal(categorical.argmax(values), values.argmax(dim=-1)), n


def test_topk_takes_the_largest_values_as_torch_topk_across_blocks_ties_and_a_partial_block() -> None:
    gen = torch.Generator().manual_seed(4)
    for n in (151_936, 5_000 + 37, 300):  # whole blocks; a partial last block; too few blocks (torch.topk)
        values = torch.randn(6, n, generator=gen) * 3
        values[1] = values[1].round()  # many ties, the k-th value among them
        values[2, -2:] = 50.0  # the largest past the last whole block
        values[3, : n // 2] = float("-inf")
        values[4, 7 * categorical.BLOCK : 8 * categorical.BLOCK] = 40.0  # one block holds all of the top
        for k in (1, 20, 50):
            top, ids = categorical.topk(values, k)
            expected = values.topk(k, dim=-1).values
            assert torch.equal(top, expected), (n, k)
            assert torch.equal(values.gather(1, ids), expected), (n, k)  # indices of those values
            assert all(len(set(row)) == k for row in ids.tolist()), (n, k)  # k distinct entries
