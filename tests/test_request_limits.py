"""The one check of a request against the model's limits, as every stage calls it (router, worker, engine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.structured import ReasoningFirst
from qwenserve.request_limits import (
    ContextLengthExceeded,
    EmptyPrompt,
    ModelLimits,
    NothingLeftToGenerate,
    RequestOutOfLimits,
    TokenOutsideVocabulary,
    check_request,
)

LIMITS = ModelLimits(vocab_size=100, max_model_len=64)


def test_the_budget_is_max_tokens_or_what_is_left_of_the_context() -> None:
    assert check_request([1] * 10, SamplingParams(max_tokens=5), LIMITS) == 5
    assert check_request([1] * 10, SamplingParams(max_tokens=None), LIMITS) == 54
    assert check_request([1] * 63, SamplingParams(max_tokens=1), LIMITS) == 1


def test_without_max_tokens_a_worker_gives_what_its_kv_cache_holds() -> None:
    worker = ModelLimits(vocab_size=100, max_model_len=64, kv_capacity_tokens=40)
    assert check_request([1] * 10, SamplingParams(max_tokens=None), worker) == 30


@pytest.mark.parametrize(
    ("prompt", "sampling", "error", "field", "words"),
    [
        ([], SamplingParams(), EmptyPrompt, "prompt_token_ids", "the prompt is empty"),
        ([1, 100], SamplingParams(), TokenOutsideVocabulary, "prompt_token_ids", "token id 100 is outside"),
        ([1, -1], SamplingParams(), TokenOutsideVocabulary, "prompt_token_ids", "token id -1 is outside"),
        ([1], SamplingParams(stop_token_ids=(7, 4294967295)), TokenOutsideVocabulary, "sampling.stop_token_ids",
         "stop_token_ids: token id 4294967295 is outside the vocabulary of 100"),
        ([1], SamplingParams(reasoning_first=ReasoningFirst(5, 100)), TokenOutsideVocabulary,
         "sampling.structured.reasoning_first", "reasoning_first names a token outside"),
        ([1] * 64, SamplingParams(max_tokens=1), ContextLengthExceeded, "prompt_token_ids",
         "the prompt has 64 tokens; this server's max_model_len is 64 tokens, prompt and output together, so a "
         "prompt may have at most 63"),
        ([1] * 60, SamplingParams(max_tokens=5), ContextLengthExceeded, "sampling.max_tokens",
         "lower max_tokens to at most 4"),
    ],
)
def test_what_the_model_cannot_serve_is_refused_with_the_field_and_what_to_change(
    prompt: list[int], sampling: SamplingParams, error: type[RequestOutOfLimits], field: str, words: str
) -> None:
    with pytest.raises(error) as refused:
        check_request(prompt, sampling, LIMITS)
    assert refused.value.field == field and words in refused.value.message, refused.value.message


def test_only_a_context_that_does_not_fit_has_its_own_code() -> None:
    with pytest.raises(RequestOutOfLimits) as too_long:
        check_request([1] * 64, SamplingParams(), LIMITS)
    with pytest.raises(RequestOutOfLimits) as unknown_token:
        check_request([100], SamplingParams(), LIMITS)
    assert (too_long.value.code, unknown_token.value.code) == ("context_length_exceeded", "invalid_request")


def test_the_prompt_field_is_named_as_the_caller_names_it() -> None:
    with pytest.raises(EmptyPrompt) as refused:
        check_request([], SamplingParams(), LIMITS, prompt_field="input")
    assert refused.value.field == "input"


def test_a_worker_refuses_what_its_kv_cache_cannot_hold_and_says_how_much_it_holds() -> None:
    worker = ModelLimits(vocab_size=100, max_model_len=64, kv_capacity_tokens=32)
    with pytest.raises(ContextLengthExceeded, match="KV cache holds 32 tokens"):
        check_request([1] * 32, SamplingParams(max_tokens=1), worker)
    with pytest.raises(ContextLengthExceeded, match=r"KV cache holds \(32 tokens\); lower max_tokens to at most 12"):
        check_request([1] * 20, SamplingParams(max_tokens=13), worker)


def test_resumed_tokens_count_against_max_tokens_and_must_be_in_the_vocabulary() -> None:
    assert check_request([1] * 4, SamplingParams(max_tokens=3), LIMITS, resume_ids=[5, 6]) == 3
    with pytest.raises(NothingLeftToGenerate, match="2 tokens were already generated; max_tokens is 2"):
        check_request([1] * 4, SamplingParams(max_tokens=2), LIMITS, resume_ids=[5, 6])
    with pytest.raises(TokenOutsideVocabulary, match="resume token id 100") as refused:
        check_request([1] * 4, SamplingParams(max_tokens=8), LIMITS, resume_ids=[100])
    assert refused.value.field == "resume_token_ids"


def test_the_check_imports_neither_torch_nor_grpc() -> None:
    code = ("import sys, qwenserve.request_limits; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_cache_salt_past_its_bound_is_refused_naming_the_field_and_an_empty_one_is_none() -> None:
    from qwenserve.request_limits import MAX_CACHE_SALT_CHARS, check_cache_salt

    assert check_cache_salt("") is None
    assert check_cache_salt("s" * MAX_CACHE_SALT_CHARS) == "s" * MAX_CACHE_SALT_CHARS
    with pytest.raises(RequestOutOfLimits) as refused:
        check_cache_salt("s" * (MAX_CACHE_SALT_CHARS + 1))
    assert refused.value.field == "cache_salt" and "at most 1024" in refused.value.message
