"""Price lists: the arithmetic of billed units and the file's checks."""

from __future__ import annotations

import pytest

from qwenserve.tenancy.pricing import PriceListError, Prices, parse_price_list


def test_cached_and_reasoning_tokens_are_priced_inside_prompt_and_completion() -> None:
    counts = {"prompt_tokens": 100, "cached_prompt_tokens": 30, "completion_tokens": 40, "reasoning_tokens": 10}
    assert Prices().billed(counts) == 140  # one unit a token, no discounts
    assert Prices(prompt=2, completion=5).billed(counts) == 100 * 2 + 40 * 5
    assert Prices(prompt=2, cached_prompt=0.5, completion=5, reasoning=1).billed(counts) == \
        70 * 2 + 30 * 0.5 + 30 * 5 + 10 * 1


def test_a_models_entry_falls_back_to_the_default_field_by_field() -> None:
    prices = parse_price_list({"default": {"prompt": 1, "cached_prompt": 0.1, "completion": 4},
                               "models": {"big": {"completion": 8}}}, "prices.yaml")
    assert prices.for_model("big") == Prices(prompt=1, cached_prompt=0.1, completion=8)
    assert prices.for_model("other") == prices.default
    usage = {"big": {"prompt_tokens": 10, "completion_tokens": 1}, "other": {"prompt_tokens": 10}}
    assert prices.billed(usage) == 10 + 8 + 10


@pytest.mark.parametrize(("data", "where"), [
    ({"default": {"prompt": -1}}, "default.prompt"),
    ({"default": {"promt": 1}}, "default"),
    ({"models": {"big": {"completion": "4"}}}, "models.big.completion"),
    ({"models": ["big"]}, "models"),
    ({"currency": "EUR"}, "expected"),
])
def test_a_malformed_price_list_names_the_place(data: dict, where: str) -> None:
    with pytest.raises(PriceListError, match=where.replace(".", r"\.")):
        parse_price_list(data, "prices.yaml")
