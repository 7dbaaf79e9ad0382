"""The whole-vocabulary draw in C (categorical_draw.c) at every instruction-set level this CPU runs: where the exact
cumulative weights of the tempered row say, never a removed or masked entry, and through the sampler the same
distribution as the reference."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from qwenserve.cpu_kernels import builder, loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.sampler import Sampler, SamplingRow
from qwenserve.engine.sampling_params import SamplingParams
from tests.engine.test_sampler_draw import reference_probabilities


def tempered_weights(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """The weights the kernel draws from in PyTorch's ops, in fp64: scaled by the fp32 reciprocal of the
    temperature, as the kernel does."""
    reciprocal = torch.tensor(1.0) / torch.tensor(temperature)
    w = ((logits - logits.max()) * reciprocal).exp()
    return torch.where(w < min_p, 0.0, w).to(torch.float64)


@pytest.mark.parametrize("variant", [v.name for v in builder.machine_variants()])
def test_every_variant_draws_where_the_exact_cumulative_weights_of_the_tempered_row_say(
        variant: str, variant_kernels: dict[str, CpuKernels]) -> None:
    if variant not in variant_kernels:
        pytest.skip(f"this CPU cannot run {variant}")
    kernels = variant_kernels[variant]
    gen = torch.Generator().manual_seed(11)
    for n in (151_936, 1_037, 5):  # whole blocks; a partial block and a partial vector; less than a vector
        for temperature, min_p in ((1.0, 0.0), (0.6, 0.0), (1.7, 0.05), (0.05, 0.0)):
            rows = 400
            logits = torch.randn(n, generator=gen) * 3
            logits[torch.randint(0, n, (n // 8 + 1,), generator=gen)] = float("-inf")  # masked: weigh nothing
            uniforms = torch.rand(rows, dtype=torch.float64, generator=gen)
            uniforms[:3] = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5])
            chosen = kernels.draw_tempered(logits.expand(rows, n), torch.full((rows,), temperature),
                                           torch.full((rows,), min_p), uniforms)
            weights = tempered_weights(logits, temperature, min_p)
            assert bool((weights[chosen] > 0).all()), (variant, n, temperature, "drew a weightless entry")
            ends = weights.cumsum(0) / weights.sum()
            start = ends - weights / weights.sum()
            # Our exp and PyTorch's differ by about an ulp: the boundaries by ~1e-7 of the row's mass.
            assert bool(((start[chosen] - 1e-6 <= uniforms) & (uniforms <= ends[chosen] + 1e-6)).all()), \
                (variant, n, temperature)


def test_a_row_with_one_finite_logit_draws_it_and_one_with_none_says_so() -> None:
    kernels = loader.load()
    if kernels is None:
        pytest.skip("the C kernels do not load here")
    logits = torch.full((3, 300), float("-inf"))
    logits[0, 299] = 2.0
    logits[1, 0] = -50.0
    uniforms = torch.tensor([0.999, 0.0, 0.5], dtype=torch.float64)
    chosen = kernels.draw_tempered(logits, torch.tensor([1.0, 0.3, 1.0]), torch.zeros(3), uniforms)
    assert chosen.tolist() == [299, 0, -1]
    with pytest.raises(ValueError, match="positive"):
        kernels.draw_tempered(logits, torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3), uniforms)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.draw_tempered(logits.t(), torch.ones(300), torch.zeros(300), torch.zeros(300, dtype=torch.float64))


def test_the_sampler_with_the_kernel_follows_the_reference_distribution() -> None:
    kernels = loader.load()
    if kernels is None:
        pytest.skip("the C kernels do not load here")
    spy = mock.patch.object(kernels, "draw_tempered", wraps=kernels.draw_tempered)
    sampler = Sampler(seed=4, cpu_kernels=kernels)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(400, generator=gen) * 3
    logits[:50] = float("-inf")
    rows = 20_000
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, min_p=0.05),
                   SamplingParams(temperature=1.5)):
        with spy as drawn:
            tokens = torch.tensor(sampler(logits.expand(rows, -1).contiguous(),
                                          [SamplingRow(params, [], []) for _ in range(rows)])[0])
        assert drawn.call_count == 1, "the sampler did not draw in the kernel"
        expected = reference_probabilities(logits, params)
        seen = torch.bincount(tokens, minlength=len(logits)).to(torch.float64) / rows
        assert bool((expected[tokens] > 0).all()), f"{params}: drew a token the filters remove"
        bound = 5 * (expected * (1 - expected) / rows).sqrt() + 1e-3
        assert bool(((seen - expected).abs() <= bound).all()), f"{params}: frequencies off the reference"


@pytest.mark.parametrize("variant", [v.name for v in builder.machine_variants()])
def test_every_variant_picks_the_first_largest_entry_as_torch_argmax(
        variant: str, variant_kernels: dict[str, CpuKernels]) -> None:
    if variant not in variant_kernels:
        pytest.skip(f"this CPU cannot run {variant}")
    kernels = variant_kernels[variant]
    gen = torch.Generator().manual_seed(12)
    for n in (151_936, 1_037, 17, 16, 5, 1):  # whole vectors, a partial one, less than one
        rows = torch.randn(12, n + 3, generator=gen)[:, :n]  # strided rows
        rows[1] = rows[1].round()  # ties everywhere: the first of the largest
        rows[2] = float("-inf")
        rows[3, -1] = 100.0  # in the tail
        rows[4, 0] = 100.0
        rows[5, n // 2] = float("nan")  # NaN counts as the largest, as in torch.argmax
        rows[6, n - 1] = float("nan")
        rows[6, 0] = float("inf")
        rows[7] = 0.0
        rows[8, n // 3] = rows[8, (2 * n) // 3] = 50.0
        got = kernels.argmax(rows)
        assert torch.equal(got, rows.argmax(dim=-1)), f"{variant} n={n}: {got.tolist()}"
    with pytest.raises(ValueError):
        kernels.argmax(torch.zeros(3, 0))


def test_the_sampler_takes_greedy_rows_argmax_in_the_kernel() -> None:
    kernels = loader.load()
    if kernels is None:
        pytest.skip("the C kernels do not load here")
    logits = torch.randn(6, 1_000, generator=torch.Generator().manual_seed(5))
    rows = [SamplingRow(SamplingParams(temperature=0.0 if i % 2 else 0.8), [], []) for i in range(6)]
    with mock.patch.object(kernels, "argmax", wraps=kernels.argmax) as picked:
        tokens = Sampler(seed=1, cpu_kernels=kernels)(logits, rows)[0]
    assert picked.call_count == 1
    assert [tokens[i] for i in (1, 3, 5)] == logits[1::2].argmax(dim=-1).tolist()
