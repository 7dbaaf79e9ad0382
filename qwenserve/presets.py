"""Operating modes: one flag (`--preset`) that sets the engine's and the stages' knobs together.

The field reports run one model two ways: latency first for chat (short prompts admitted first and given
prefill-only steps in a burst, at most 32 streams per decode worker, the rest waiting at the router before
their prompt is prefilled so no answer stalls mid-stream, every token sent the moment it exists) and
throughput first for batch work (plain arrival order, no prefill-only steps, up to 256 streams a batch, tokens
coalesced into fewer stream messages). Both keep the step budget large and prefill at decode's CPU priority: on
shared cores a small budget or a reniced prefill costs prefill capacity that time to first token pays for
(bench/experiment_presets.py measures the two presets). A preset only moves defaults: a flag or its QWENSERVE_*
variable still wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

#: "none" keeps every default as it is.
PRESET_NAMES = ("none", "latency", "throughput")

#: Field name -> value, for the fields of the stages' and `qwen-serve up`'s configs that have them.
PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "latency": {
        "max_num_batched_tokens": 2048,  # prefill capacity: on shared cores small steps queue prompts longer
        "max_num_seqs": 32,  # smaller decode batches: shorter steps, so a shorter time between tokens
        "max_streams_per_decode_worker": 32,  # router: the rest wait before prefill, never mid-stream
        "admission_policy": "short_first",  # short prompts first, prefill-only steps in a burst
        "burst_prefill_steps": 2,
        "stream_interval_ms": 0.0,  # decode: every token as soon as it exists
        "prefill_nice": 0,  # a reniced prefill makes prompts wait behind decode steps
    },
    "throughput": {
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 256,  # the largest batches the KV pool holds: most tokens per step
        "max_streams_per_decode_worker": 0,
        "admission_policy": "fcfs",
        "burst_prefill_steps": 0,
        "stream_interval_ms": 25.0,  # fewer, fuller stream messages: less relay work per token
        "prefill_nice": 0,
    },
}

FLAG = "--preset"
VARIABLE = "QWENSERVE_PRESET"


def preset_named(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The preset a command line (else its environment) asks for; "none" when it asks for none. The last one
    given counts, as for any flag; a name that is no preset is returned as it is, for the parser to refuse."""
    named = None
    for i, token in enumerate(argv):
        if token == FLAG and i + 1 < len(argv):
            named = argv[i + 1]
        elif token.startswith(FLAG + "="):
            named = token.split("=", 1)[1]
    if named is not None:
        return named
    return (os.environ if env is None else env).get(VARIABLE, "none") or "none"


def preset_defaults(name: str) -> dict[str, Any]:
    """The defaults a preset sets (none for an unknown name: the parser refuses it)."""
    return dict(PRESETS.get(name, {}))
