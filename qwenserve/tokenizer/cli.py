"""`qwen-serve tokens`: count or show the tokens of files, with the built-in vocabulary or a checkpoint's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qwenserve.flags import StrictParser
from qwenserve.tokenizer.builtin import BuiltinVocab
from qwenserve.tokenizer.errors import TokenizerError
from qwenserve.tokenizer.tokenizer import Tokenizer


def _load(args: argparse.Namespace) -> Tokenizer:
    return (
        Tokenizer.from_dir(args.model)
        if args.model
        else Tokenizer.builtin(BuiltinVocab.from_name(args.vocab))
    )


def main(argv: list[str] | None = None) -> int:
    """`qwen-serve tokens count FILE...` prints counts per file and a total; `show FILE` prints each token."""
    parser = StrictParser(prog="qwen-serve tokens", description=__doc__)
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the built-in vocabulary)")
    parser.add_argument(
        "--vocab", default="qwen3", help="built-in vocabulary: qwen3 (Qwen2/2.5/3) or qwen3_5"
    )
    sub = parser.add_subparsers(dest="action", required=True)
    count = sub.add_parser("count", help="count the tokens of each file ('-' reads stdin)")
    count.add_argument("files", nargs="+")
    show = sub.add_parser("show", help="print id and text of every token of a file ('-' reads stdin)")
    show.add_argument("file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tokenizer = _load(args)
        if args.action == "count":
            total = 0
            for name in args.files:
                n = tokenizer.count(_read(name))
                total += n
                print(f"{n:>10}  {name}")
            if len(args.files) > 1:
                print(f"{total:>10}  total")
        else:
            for token_id in tokenizer.encode(_read(args.file)):
                print(f"{token_id:>8}  {tokenizer.token_bytes(token_id)!r}")
    except (OSError, UnicodeDecodeError, TokenizerError, ValueError) as err:
        print(f"qwen-serve tokens: {err}", file=sys.stderr)
        return 1
    return 0


def _read(name: str) -> str:
    return sys.stdin.read() if name == "-" else Path(name).read_text(encoding="utf-8")
