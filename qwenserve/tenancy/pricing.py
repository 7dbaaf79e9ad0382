"""Prices: what a metered token costs, per model, in billing units.

A price list is a YAML (or JSON) file:

    default: {prompt: 1.0, cached_prompt: 0.1, completion: 4.0}
    models:
      qwen3-8b: {prompt: 2.0, cached_prompt: 0.2, completion: 8.0, reasoning: 6.0}

Each price is units per token. Prompt tokens served from the prefix cache cost `cached_prompt` instead of
`prompt` (a discount when lower); reasoning tokens are completion tokens and cost `reasoning` instead of
`completion` where it is given. A model without its own entry is billed at `default`; a field left out of
an entry takes the default's. Usage is stored as counts, so a changed price list reprices what it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from qwenserve.config_file import read_yaml

PRICE_FIELDS = ("prompt", "cached_prompt", "completion", "reasoning")


class PriceListError(ValueError):
    """The price list is malformed; the message says where."""


@dataclass(frozen=True, slots=True)
class Prices:
    """Units per token. None for cached_prompt / reasoning: as prompt / completion."""

    prompt: float = 1.0
    completion: float = 1.0
    cached_prompt: float | None = None
    reasoning: float | None = None

    def billed(self, counts: Mapping[str, int]) -> float:
        """Units for usage counts as the meter stores them (prompt_tokens includes cached_prompt_tokens,
        completion_tokens includes reasoning_tokens)."""
        cached = counts.get("cached_prompt_tokens", 0)
        reasoning = counts.get("reasoning_tokens", 0)
        cached_price = self.prompt if self.cached_prompt is None else self.cached_prompt
        reasoning_price = self.completion if self.reasoning is None else self.reasoning
        return ((counts.get("prompt_tokens", 0) - cached) * self.prompt + cached * cached_price
                + (counts.get("completion_tokens", 0) - reasoning) * self.completion + reasoning * reasoning_price)


@dataclass(frozen=True, slots=True)
class PriceList:
    """The default prices and each model's own."""

    default: Prices = field(default_factory=Prices)
    models: Mapping[str, Prices] = field(default_factory=dict)

    def for_model(self, model: str) -> Prices:
        return self.models.get(model, self.default)

    def billed(self, by_model: Mapping[str, Mapping[str, int]]) -> float:
        """Units for one tenant's usage split by model ({model: counts})."""
        return sum(self.for_model(model).billed(counts) for model, counts in by_model.items())


def _prices(raw: object, where: str, base: Prices) -> Prices:
    if not isinstance(raw, Mapping) or set(raw) - set(PRICE_FIELDS):
        raise PriceListError(f"{where}: expected a mapping of {', '.join(PRICE_FIELDS)}")
    values: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(Prices)}
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise PriceListError(f"{where}.{name}: expected a price >= 0 (units per token), got {value!r}")
        values[name] = float(value)
    return Prices(**values)


def parse_price_list(data: object, where: str) -> PriceList:
    """A decoded price list, checked."""
    if not isinstance(data, Mapping) or set(data) - {"default", "models"}:
        raise PriceListError(f"{where}: expected {{default: {{...}}, models: {{NAME: {{...}}}}}}")
    default = _prices(data.get("default") or {}, f"{where}: default", Prices())
    models = data.get("models") or {}
    if not isinstance(models, Mapping) or not all(isinstance(name, str) and name for name in models):
        raise PriceListError(f"{where}: models: expected a mapping of model names to prices")
    return PriceList(default, {name: _prices(raw, f"{where}: models.{name}", default) for name, raw in models.items()})


def load_price_list(path: str | Path) -> PriceList:
    return parse_price_list(read_yaml(path, "price list", PriceListError), str(path))
