"""The tokenizer stage's options: one dataclass, from which its flags and `QWENSERVE_<FLAG>` variables come."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qwenserve.flags import StrictParser, option
from qwenserve.stages.common import StageConfig, check_common, stage_parser
from qwenserve.tokenizer.hygiene import InputLimits

DEFAULT_PORT = 50051


@dataclass(frozen=True)
class TokenizerServiceConfig(StageConfig):
    """Everything the tokenizer stage is configured by (flags, else QWENSERVE_* environment)."""

    port: int = option(DEFAULT_PORT, help="gRPC port (0: a free one, printed at start)")
    model: str | None = option(None, positional=True,
                               help="checkpoint folder whose tokenizer to serve (default: the built-in vocabulary)")
    grace_s: float = option(5.0, help="drain time on SIGTERM, in seconds")
    vocab: str = option("qwen3", choices=("qwen3", "qwen3_5"), help="built-in vocabulary when no model is given")
    workers: int = option(2, help="threads encoding large inputs and batches")
    max_input_bytes: int = option(InputLimits.max_text_bytes, help="largest text, in UTF-8 bytes")
    max_batch: int = option(InputLimits.max_batch, help="most texts in one batch call")
    max_message_bytes: int = option(64 << 20, help="largest gRPC message")


def build_parser(prog: str | None = None, argv: Sequence[str] = (),
                 environ: Mapping[str, str] | None = None) -> StrictParser:
    """`qwen-serve serve tokenizer`'s parser (variables from `environ`, default this process's)."""
    return stage_parser("tokenizer", TokenizerServiceConfig, "The Tokenizer stage: tokenize, count, detokenize.",
                        prog, argv, environ)


def parse_config(argv: Sequence[str], prog: str | None = None,
                 environ: Mapping[str, str] | None = None) -> TokenizerServiceConfig:
    """Flags, falling back to QWENSERVE_* environment variables, falling back to defaults."""
    return build_parser(prog, argv, environ).parse_config(TokenizerServiceConfig, argv)


def check(config: TokenizerServiceConfig) -> TokenizerServiceConfig:
    """Before serving: the model folder has a tokenizer, the ports are free."""
    check_common(config, needs_tokenizer=True)
    return config
