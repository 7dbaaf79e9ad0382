"""When requests are sent: open-loop schedules (Poisson, bursts, periodic spikes, traces) and closed-loop
request lists. Pure: a seeded random.Random in, a list of RequestSpec out.

Open loop means the arrival times do not depend on how fast the server answers, so a slow server
sees a queue build up, as in production; closed loop keeps `concurrency` requests in flight.
"""

from __future__ import annotations

import random
from dataclasses import replace

from qwenserve.loadgen.workload import Component, Mix, RequestSpec, draw_request, fit_to_context


def event_probabilities(components: tuple[Component, ...]) -> list[float]:
    """Probability that an arrival *event* is of each component, given weights that are fractions of
    *requests*: a component arriving in groups of k needs k times fewer events for the same share."""
    raw = [c.weight / max(c.burst_size, 1) for c in components]
    total = sum(raw)
    if total <= 0:
        raise ValueError("a mix needs at least one component with a positive weight")
    return [r / total for r in raw]


def mean_requests_per_event(components: tuple[Component, ...]) -> float:
    """Average number of requests one arrival event brings (1 with no bursts)."""
    return sum(p * max(c.burst_size, 1) for p, c in zip(event_probabilities(components), components, strict=True))


def open_loop(mix: Mix, rate: float, rng: random.Random, *, num_requests: int | None = None,
              duration_s: float | None = None, max_model_len: int | None = None) -> list[RequestSpec]:
    """A Poisson schedule whose mean *request* rate is `rate` per second (bursts included; periodic
    spikes come on top). Ends at num_requests or at duration_s, whichever comes first (one is required)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if num_requests is None and duration_s is None:
        raise ValueError("an open-loop schedule needs num_requests or duration_s")
    probs = event_probabilities(mix.components)
    event_rate = rate / mean_requests_per_event(mix.components)
    limit_t = duration_s if duration_s is not None else float("inf")
    limit_n = num_requests if num_requests is not None else 1 << 62
    timed: list[tuple[float, Component]] = []
    t = 0.0
    while len(timed) < limit_n:
        t += rng.expovariate(event_rate)
        if t >= limit_t:
            break
        comp = rng.choices(mix.components, probs)[0]
        for _ in range(max(comp.burst_size, 1)):
            timed.append((t + rng.uniform(0.0, comp.burst_window_s), comp))
    if mix.spikes is not None:
        last = timed[-1][0] if num_requests is not None and timed else limit_t
        s = mix.spikes
        k = 1
        while k * s.period_s < last:
            timed += [(k * s.period_s + rng.uniform(0.0, s.window_s), s.component) for _ in range(s.size)]
            k += 1
    timed.sort(key=lambda x: x[0])
    timed = [x for x in timed if x[0] < limit_t][:limit_n]
    return [draw_request(c, i, rng, max_model_len, at) for i, (at, c) in enumerate(timed)]


def closed_loop(mix: Mix, num_requests: int, rng: random.Random, max_model_len: int | None = None) -> list[RequestSpec]:
    """`num_requests` requests drawn by weight, without arrival times (bursts do not apply)."""
    weights = [c.weight for c in mix.components]
    return [draw_request(rng.choices(mix.components, weights)[0], i, rng, max_model_len) for i in range(num_requests)]


def scale_trace(specs: list[RequestSpec], factor: float, max_model_len: int | None = None,
                time_factor: float = 1.0) -> list[RequestSpec]:
    """A trace with lengths multiplied by `factor` and arrival times by `time_factor` (to replay a
    recorded day faster or a big machine's traffic on a small one)."""
    out = []
    for s in specs:
        p, o = max(1, round(s.prompt_len * factor)), max(1, round(s.output_len * factor))
        if max_model_len:
            p, o = fit_to_context(p, o, max_model_len)
        at = None if s.arrival_s is None else s.arrival_s * time_factor
        out.append(replace(s, prompt_len=p, output_len=o, arrival_s=at, prefix_len=min(s.prefix_len, p - 1)))
    return out


def parse_rates(text: str) -> list[float]:
    """`"1,2,4"` or `"0.5:4:0.5"` (start:stop:step, inclusive) to a list of rates."""
    text = text.strip()
    if ":" in text:
        start, stop, step = (float(x) for x in text.split(":"))
        if step <= 0 or stop < start:
            raise ValueError(f"rate range {text!r}: need start <= stop and step > 0")
        n = int(round((stop - start) / step)) + 1
        return [round(start + i * step, 9) for i in range(n)]
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates {text!r}: need positive numbers")
    return rates
