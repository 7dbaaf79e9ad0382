"""Operating modes: one flag (`--preset`) that sets the engine's and the stages' knobs together.

The field reports run one model two ways: latency first for chat (short steps, so a decode step never
waits behind a long prefill chunk; short prompts admitted first; every token sent at once; prefill at a
lower CPU priority than decode on shared cores) and throughput first for batch work (long steps that keep
the matrix products large, plain arrival order, tokens coalesced into fewer stream messages, prefill at
decode's priority). A preset only moves defaults: a flag or its QWENSERVE_* variable still wins.
`bench/experiment_presets.py` measures both on one mix.
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
        "max_num_batched_tokens": 256,  # per-step token budget: short steps, low inter-token latency
        "max_num_seqs": 64,
        "admission_policy": "short_first",
        "burst_prefill_steps": 2,
        "stream_interval_ms": 0.0,  # decode: every token as soon as it exists
        "prefill_nice": 10,  # qwen-serve up: prefill yields shared cores to decode
    },
    "throughput": {
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 256,
        "admission_policy": "fcfs",
        "burst_prefill_steps": 0,
        "stream_interval_ms": 25.0,  # fewer, fuller stream messages
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
