"""The screened LM head (models/screened_head.py, cpu_kernels/head_screen.c): every logit the full head could make a
row's largest (or one of its top K) comes back exactly as the full head computes it, the others -inf; the bound it
screens by holds; the first of equal largest logits stays the token; an engine's greedy tokens are transformers' with
the screen on and its seeded top-k draws those of the full head, while steps that read more than a row's top K
(sampling without top_k, logprobs, penalties) get the full head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.packed_weight import PackedWeight
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.models.screened_head import ScreenedHead
from tests.support.checkpoints import tiny_checkpoint
from tests.support.engine_checkpoints import load_reference, random_prompts, reference_greedy

KERNELS = loader.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the C kernels do not build here")


def _head(n: int, k: int, dtype: torch.dtype, seed: int, skewed: bool = True) -> tuple[torch.Tensor, PackedWeight]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    if skewed:  # rows and groups of very different ranges
        w[7] *= 40
        w[:, : k // 3] *= 3
    return w, PackedWeight.pack(w)


def _rows(m: int, k: int, seed: int, bf16: bool, skewed: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if skewed:
        x *= torch.linspace(0.01, 4.0, k)  # inputs of many magnitudes
    return x.to(torch.bfloat16).float() if bf16 else x


# Skewed: weights and inputs of very different sizes (a looser bound); plain: normal ones, as a model's hidden row.
@pytest.mark.parametrize(("dtype", "k", "m", "bf16_x", "skewed"), [
    (torch.bfloat16, 256, 1, True, True), (torch.bfloat16, 200, 2, False, True), (torch.float32, 96, 2, False, True),
    (torch.bfloat16, 1024, 1, True, False), (torch.bfloat16, 1024, 4, True, False)])
def test_candidates_are_the_full_heads_logits_and_the_bound_holds(dtype: torch.dtype, k: int, m: int, bf16_x: bool,
                                                                  skewed: bool) -> None:
    _, head = _head(4096 if skewed else 16384, k, dtype, seed=k + m, skewed=skewed)
    screen = ScreenedHead(head, KERNELS, max_rows=8)
    for trial in range(6):
        x = _rows(m, k, seed=trial, bf16=bf16_x, skewed=skewed)
        full = KERNELS.linear_packed(x, head)
        screened = screen.logits(x, head)
        assert screened is not None
        kept = torch.isfinite(screened)
        assert torch.equal(screened[kept], full[kept])  # the same product, bit for bit
        assert bool((screened[~kept] == float("-inf")).all())
        assert torch.equal(screened.argmax(dim=1), full.argmax(dim=1))
        assert int(kept.sum()) < full.numel() // 4  # it screened something out
        # The bound head_screen.c screens by (before its 1% and 2^-20 margins) holds for every logit.
        approx = KERNELS.linear_quant(x, screen.codes)
        size = x.abs()
        bound = screen.reach * size.sum(1, keepdim=True) + screen.span * size.amax(1, keepdim=True) * k * 2**-14
        assert bool(((approx - full).abs() <= bound).all())


@pytest.mark.parametrize(("largest", "m", "skewed"), [(2, 3, True), (5, 1, True), (20, 3, False), (64, 1, False)])
def test_a_rows_top_k_logits_are_the_full_heads(largest: int, m: int, skewed: bool) -> None:
    _, head = _head(32768, 128, torch.bfloat16, seed=largest + m, skewed=skewed)
    screen = ScreenedHead(head, KERNELS, max_rows=4)
    greedy_kept = 0
    for trial in range(4):
        x = _rows(m, 128, seed=100 + trial, bf16=True, skewed=skewed)
        full = KERNELS.linear_packed(x, head)
        screened = screen.logits(x, head, largest=largest)
        assert screened is not None
        kept = torch.isfinite(screened)
        assert torch.equal(screened[kept], full[kept])
        top = full.topk(largest, dim=1)
        assert torch.equal(screened.topk(largest, dim=1).values, top.values)
        assert bool(kept.gather(1, top.indices).all())  # every one of them is there, exact
        # Past the K-th, nothing the full head ranks lower stands above it.
        assert bool((screened[~kept] == float("-inf")).all())
        greedy = screen.logits(x, head)
        assert greedy is not None
        greedy_kept += int(torch.isfinite(greedy).sum())
        assert int(kept.sum()) >= int(torch.isfinite(greedy).sum())
    assert greedy_kept < 4 * m * 32768 // 4  # the greedy screen kept a fraction


def test_the_first_of_equal_largest_logits_stays_the_token() -> None:
    w, _ = _head(2048, 128, torch.bfloat16, seed=5)
    x = _rows(1, 128, seed=9, bf16=True)
    best = int(KERNELS.linear_packed(x, PackedWeight.pack(w)).argmax())
    for twin in (3, 1500, 2047):  # before it: the twin is the token; after it: it stays
        tied = w.clone()
        tied[twin] = w[best]
        head = PackedWeight.pack(tied)
        full = KERNELS.linear_packed(x, head)
        screened = ScreenedHead(head, KERNELS, max_rows=1).logits(x, head)
        assert screened is not None and int(screened.argmax()) == int(full.argmax()) == min(twin, best)


def test_it_declines_what_it_cannot_screen() -> None:
    _, head = _head(1024, 64, torch.bfloat16, seed=1)
    screen = ScreenedHead(head, KERNELS, max_rows=2)
    x = _rows(3, 64, seed=2, bf16=True)
    assert screen.logits(x, head) is None  # more rows than it was built for
    bad = x[:1].clone()
    bad[0, 5] = float("nan")
    assert screen.logits(bad, head) is None
    same = PackedWeight.pack(torch.full((1024, 64), 0.01, dtype=torch.bfloat16))  # every logit a candidate
    assert ScreenedHead(same, KERNELS, max_rows=1).logits(x[:1], same) is None
    assert screen.logits(x[:1], head, largest=65) is None  # a top_k beyond MOST_LARGEST
    assert screen.logits(x[:1], head, largest=0) is None


def test_greedy_tokens_equal_transformers_with_the_screen_and_other_steps_read_the_full_head(tmp_path: Path) -> None:
    folder = tiny_checkpoint(tmp_path / "model", seed=23)
    prompts = random_prompts(3, 5, 30, seed=8)
    hf = load_reference(folder)
    expected = [reference_greedy(hf, p, 10)[0] for p in prompts]
    engine = LLMEngine.from_pretrained(folder, EngineConfig(num_kv_blocks=64, block_size=8, num_threads=2))
    try:
        model = engine.runner.model
        assert model.lm_head_screen is not None
        screened_steps = []
        original = model.lm_head_screen.logits

        def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
            result = original(*args, **kwargs)
            screened_steps.append(result is not None)
            return result

        model.lm_head_screen.logits = counted  # type: ignore[method-assign]
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        assert engine.generate_sync(prompts, greedy) == expected
        assert screened_steps and all(screened_steps)
        screened_steps.clear()
        # Logprobs read the whole row: the full head, and log-probabilities of a distribution over every token.
        outputs = engine.generate_sync_outputs(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4,
                                                                           ignore_eos=True, logprobs=True,
                                                                           top_logprobs=3))
        assert not screened_steps
        logprobs = [lp for out in outputs[0] for lp in (out.logprobs or [])]
        assert len(logprobs) == 4 and all(-1e9 < lp.logprob <= 0 and len(lp.top) == 3 for lp in logprobs)
        assert [lp.token_id for lp in logprobs] == expected[0][:4]
        engine.generate_sync(prompts[:1], SamplingParams(temperature=0.8, max_tokens=3, seed=1))
        engine.generate_sync(prompts[:1], SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=3))
        assert not screened_steps
        engine.generate_sync(prompts[:1], SamplingParams(temperature=0.8, top_k=65, max_tokens=3, seed=1))
        assert screened_steps and not any(screened_steps)  # asked, and declined: more than MOST_LARGEST
        screened_steps.clear()
        # Qwen's own sampling settings (generation_config: the top 20, top_p 0.95) read a row's top 20: screened.
        top_k = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, max_tokens=12, seed=s, ignore_eos=True)
                 for t, k, p, mp, s in ((0.6, 20, 0.95, 0.0, 1), (1.5, 64, 1.0, 0.0, 2), (1.0, 5, 0.9, 0.05, 3))]
        drawn = [engine.generate_sync(prompts, params) for params in top_k]
        assert screened_steps and all(screened_steps)
    finally:
        engine.shutdown()
    off = LLMEngine.from_pretrained(folder, EngineConfig(num_kv_blocks=64, block_size=8, num_threads=2,
                                                         screen_lm_head=False))
    try:
        assert off.runner.model.lm_head_screen is None
        assert off.generate_sync(prompts, greedy) == expected
        assert [off.generate_sync(prompts, params) for params in top_k] == drawn
    finally:
        off.shutdown()
