"""Traffic mixes: what requests look like (prompt and output lengths, bursts, shared prefixes).

A mix is a list of components; a component's `weight` is the fraction of *requests* it contributes
(so the chat mix's "10% bursts of 10" means one request in ten arrives as part of a burst). The
built-in mixes follow the field reports in shared/seeds/ (000 §4.3, 003 §6.1); a custom mix is the
same structure in a YAML or JSON file; a trace is JSONL with one request per line.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml


class WorkloadError(ValueError):
    """A mix or trace file that cannot be used; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution. kind: "fixed" (a), "uniform" (a..b inclusive), "normal" (mean a, sd b),
    "lognormal" (median a, sigma b). Samples are clamped to [lo, hi]."""

    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        """One length, rounded and clamped."""
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        elif self.kind == "lognormal":
            x = self.a * math.exp(rng.gauss(0.0, self.b))
        else:
            raise WorkloadError(f"length kind {self.kind!r}: use fixed, uniform, normal or lognormal")
        return int(min(max(round(x), self.lo), self.hi))

    def scaled(self, factor: float) -> LengthDist:
        """The same shape with every length multiplied by `factor` (sigma of a lognormal is a ratio: kept)."""
        b = self.b if self.kind == "lognormal" else self.b * factor
        return LengthDist(self.kind, self.a * factor, b, max(1, round(self.lo * factor)),
                          max(1, round(self.hi * factor)))


def uniform(lo: int, hi: int) -> LengthDist:
    return LengthDist("uniform", lo, hi, lo, hi)


@dataclass(frozen=True, slots=True)
class Component:
    """One kind of request in a mix.

    burst_size > 1: requests of this component arrive in groups of that size, spread uniformly over
    burst_window_s. prefix_fraction > 0: that fraction of each prompt is a system prompt shared by all
    requests of the same prefix group (prefix_groups groups, chosen uniformly)."""

    name: str
    weight: float
    prompt: LengthDist
    output: LengthDist
    burst_size: int = 1
    burst_window_s: float = 0.0
    prefix_fraction: float = 0.0
    prefix_groups: int = 1


@dataclass(frozen=True, slots=True)
class PeriodicBurst:
    """Every period_s seconds, `size` extra requests of `component` within window_s (on top of the mix)."""

    period_s: float
    size: int
    window_s: float
    component: Component


@dataclass(frozen=True, slots=True)
class Mix:
    name: str
    components: tuple[Component, ...]
    spikes: PeriodicBurst | None = None

    def scaled(self, factor: float) -> Mix:
        """Every token length multiplied by `factor` (to fit a small machine; arrivals are unchanged)."""
        def sc(c: Component) -> Component:
            return replace(c, prompt=c.prompt.scaled(factor), output=c.output.scaled(factor))

        spikes = replace(self.spikes, component=sc(self.spikes.component)) if self.spikes else None
        return Mix(self.name, tuple(sc(c) for c in self.components), spikes)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send. arrival_s is None in closed-loop runs (sent when a slot frees)."""

    index: int
    prompt_len: int
    output_len: int
    group: str
    arrival_s: float | None = None
    prefix_len: int = 0  # leading tokens shared with every request of the same prefix_id
    prefix_id: int = 0


def _short() -> LengthDist:
    return uniform(50, 100)


BUILTIN_MIXES: dict[str, Mix] = {
    # 000 §4.3: 65% short chats, 25% long documents, 10% bursts of 10 short chats within 100 ms.
    "chat": Mix("chat", (
        Component("short", 0.65, _short(), uniform(100, 200)),
        Component("long", 0.25, uniform(1500, 3000), uniform(300, 500)),
        Component("burst", 0.10, _short(), uniform(100, 200), burst_size=10, burst_window_s=0.1),
    )),
    # 003 §6.1 "normal": prompt lengths around a mean of 2000 tokens.
    "normal": Mix("normal", (
        Component("normal", 1.0, LengthDist("normal", 2000, 500, 16, 8000), LengthDist("normal", 256, 64, 8, 1024)),
    )),
    # 003 §6.1 "long_tail": 95% <= 1000 tokens, 5% >= 10000 (capped by the model's context).
    "long-tail": Mix("long-tail", (
        Component("body", 0.95, uniform(50, 1000), uniform(50, 300)),
        Component("tail", 0.05, uniform(10000, 32000), uniform(50, 300)),
    )),
    # 003 §6.1 "burst": light steady traffic plus a periodic spike of heavy prompts.
    "burst": Mix("burst", (Component("steady", 1.0, uniform(100, 500), uniform(50, 200)),),
                 spikes=PeriodicBurst(20.0, 20, 1.0, Component("spike", 0.0, uniform(500, 8000), uniform(50, 200)))),
    # Many users behind one long system prompt (90% of each prompt), e.g. one app's assistant.
    "shared-prefix": Mix("shared-prefix", (
        Component("shared", 1.0, LengthDist("fixed", 1000, 0, 1000, 1000), uniform(50, 100), prefix_fraction=0.9),
    )),
}


def builtin_mix(name: str) -> Mix:
    """A built-in mix by name; WorkloadError lists the names otherwise."""
    try:
        return BUILTIN_MIXES[name]
    except KeyError:
        raise WorkloadError(f"unknown mix {name!r}; built-in mixes: {', '.join(BUILTIN_MIXES)}") from None


def _length(raw: Any, where: str) -> LengthDist:
    """`80`, `[50, 100]` (uniform) or `{kind: normal, mean: .., sd: .., min: .., max: ..}`."""
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return LengthDist("fixed", raw, 0, int(raw), int(raw))
    if isinstance(raw, list) and len(raw) == 2:
        return uniform(int(raw[0]), int(raw[1]))
    if isinstance(raw, Mapping) and "kind" in raw:
        kind = raw["kind"]
        a = raw.get("mean", raw.get("median", raw.get("min", raw.get("value"))))
        b = raw.get("sd", raw.get("sigma", raw.get("max", 0)))
        if a is None:
            raise WorkloadError(f"{where}: a {kind} length needs mean/median/min/value")
        return LengthDist(kind, float(a), float(b), int(raw.get("min", 1)), int(raw.get("max", 1 << 20)))
    raise WorkloadError(f"{where}: a length is a number, [min, max], or {{kind, mean, sd, min, max}}; got {raw!r}")


def _component(raw: Any, where: str) -> Component:
    if not isinstance(raw, Mapping):
        raise WorkloadError(f"{where}: a component is a mapping with name, weight, prompt, output")
    for key in ("prompt", "output"):
        if key not in raw:
            raise WorkloadError(f"{where}.{key} is required")
    return Component(
        name=str(raw.get("name", where)), weight=float(raw.get("weight", 1.0)),
        prompt=_length(raw["prompt"], f"{where}.prompt"), output=_length(raw["output"], f"{where}.output"),
        burst_size=int(raw.get("burst_size", 1)), burst_window_s=float(raw.get("burst_window_s", 0.0)),
        prefix_fraction=float(raw.get("prefix_fraction", 0.0)), prefix_groups=int(raw.get("prefix_groups", 1)),
    )


def mix_from_dict(raw: Any, name: str = "custom") -> Mix:
    """A mix from parsed YAML/JSON: {name, components: [...], spikes: {period_s, size, window_s, component}}."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("components"), list) or not raw["components"]:
        raise WorkloadError("a mix file needs a non-empty `components` list")
    comps = tuple(_component(c, f"components[{i}]") for i, c in enumerate(raw["components"]))
    if any(c.weight < 0 for c in comps) or sum(c.weight for c in comps) <= 0:
        raise WorkloadError("component weights must be >= 0 and not all zero")
    spikes = None
    if raw.get("spikes"):
        s = raw["spikes"]
        spikes = PeriodicBurst(float(s["period_s"]), int(s["size"]), float(s.get("window_s", 0.0)),
                               _component({"weight": 0, **s["component"]}, "spikes.component"))
    return Mix(str(raw.get("name", name)), comps, spikes)


def load_mix(path: Path) -> Mix:
    """A custom mix from a .yaml/.yml or .json file."""
    text = path.read_text()
    raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    return mix_from_dict(raw, path.stem)


def load_trace(path: Path) -> list[RequestSpec]:
    """Replay a recorded trace: JSONL, one request per line with an arrival time (`arrival_s`, or
    `timestamp` in milliseconds), a prompt length (`prompt_len` / `input_length`) and an output length
    (`output_len` / `output_length`). Arrivals are shifted so the first is at 0."""
    specs: list[RequestSpec] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            t = float(row["arrival_s"]) if "arrival_s" in row else float(row["timestamp"]) / 1000.0
            p = int(row.get("prompt_len", row.get("input_length")))
            o = int(row.get("output_len", row.get("output_length")))
        except (KeyError, TypeError, ValueError) as e:
            raise WorkloadError(f"{path}:{lineno}: need arrival_s|timestamp, prompt_len, output_len ({e})") from e
        specs.append(RequestSpec(len(specs), max(p, 1), max(o, 1), str(row.get("group", "trace")), t))
    if not specs:
        raise WorkloadError(f"{path}: the trace is empty")
    t0 = min(s.arrival_s or 0.0 for s in specs)
    specs.sort(key=lambda s: s.arrival_s or 0.0)
    return [replace(s, index=i, arrival_s=(s.arrival_s or 0.0) - t0) for i, s in enumerate(specs)]


def fit_to_context(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """Cap a request to the model's context: the output length is kept (up to max_model_len - 1) and the
    prompt trimmed to what remains (a 32k "long-tail" prompt on a 4k model becomes the longest that fits)."""
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len {max_model_len} is too small")
    output_len = max(1, min(output_len, max_model_len - 1))
    prompt_len = max(1, min(prompt_len, max_model_len - output_len))
    return prompt_len, output_len


def draw_request(comp: Component, index: int, rng: random.Random, max_model_len: int | None,
                 arrival_s: float | None = None) -> RequestSpec:
    """One request of `comp`: lengths drawn, fitted to the context, shared prefix placed."""
    p, o = comp.prompt.sample(rng), comp.output.sample(rng)
    if max_model_len:
        p, o = fit_to_context(p, o, max_model_len)
    prefix_len = min(int(p * comp.prefix_fraction), p - 1) if comp.prefix_fraction > 0 else 0
    prefix_id = rng.randrange(comp.prefix_groups) if comp.prefix_groups > 1 else 0
    return RequestSpec(index, p, o, comp.name, arrival_s, prefix_len, prefix_id)


def mix_spec_fields(mix: Mix) -> dict[str, Any]:
    """A mix as plain data for the JSON report."""
    def comp(c: Component) -> dict[str, Any]:
        return {"name": c.name, "weight": c.weight, "prompt": _dist(c.prompt), "output": _dist(c.output),
                "burst_size": c.burst_size, "burst_window_s": c.burst_window_s,
                "prefix_fraction": c.prefix_fraction, "prefix_groups": c.prefix_groups}

    out: dict[str, Any] = {"name": mix.name, "components": [comp(c) for c in mix.components]}
    if mix.spikes:
        out["spikes"] = {"period_s": mix.spikes.period_s, "size": mix.spikes.size,
                         "window_s": mix.spikes.window_s, "component": comp(mix.spikes.component)}
    return out


def _dist(d: LengthDist) -> dict[str, Any]:
    return {"kind": d.kind, "a": d.a, "b": d.b, "min": d.lo, "max": d.hi}
