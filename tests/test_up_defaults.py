"""`qwen-serve up`'s own default for its router: prompts shorter than UP_LOCAL_PREFILL_TOKENS are prefilled on the
decode worker (the engines share this host's cores), unless a flag or variable says otherwise."""

from __future__ import annotations

from qwenserve.up import UP_LOCAL_PREFILL_TOKENS
from tests.test_presets import _print_config, _value


def test_up_prefills_short_prompts_on_decode_unless_told_otherwise() -> None:
    assert _value(_print_config()["router"], "local_prefill_threshold") == str(UP_LOCAL_PREFILL_TOKENS)
    assert _value(_print_config("--local-prefill-threshold", "0")["router"], "local_prefill_threshold") == "0"
    given = _print_config(env={"QWENSERVE_LOCAL_PREFILL_THRESHOLD": "300"})
    assert _value(given["router"], "local_prefill_threshold") == "300"
    # Without prefill processes there is nothing to choose: every prompt is prefilled on decode anyway.
    assert _value(_print_config("--prefill", "0")["router"], "local_prefill_threshold") == "0"
