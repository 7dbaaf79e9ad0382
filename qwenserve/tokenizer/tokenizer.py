"""`Tokenizer`: a Hugging Face checkpoint's tokenizer, encoded with tiktoken's speed where that is exact.

Reads `tokenizer.json` + `tokenizer_config.json` (special tokens, eos, chat template) from a
checkpoint folder, as written by transformers 4.x (template inside `tokenizer_config.json`) or 5.x
(template in `chat_template.jinja`, class `TokenizersBackend`), plus `generation_config.json` and
`config.json` when present (more eos ids; the model's padded vocabulary size).

Two encoders give identical ids: a byte-level BPE `tokenizer.json` whose merges are the ones
byte-pair encoding itself would take (every Qwen vocabulary) is run by tiktoken, several times
faster per call; anything else runs on the `tokenizers` library.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwenserve.cache import cache_root
from qwenserve.checkpoint_config import checkpoint_limits
from qwenserve.tokenizer import builtin
from qwenserve.tokenizer.chat_template import render_chat
from qwenserve.tokenizer.errors import ChatTemplateError, CheckpointError, InvalidInput

# Named special tokens a chat template can read, as in transformers' `special_tokens_map`.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class AddedToken:
    """A token matched in text before BPE (`<|im_start|>`, `<think>`, ...)."""

    id: int
    content: str
    special: bool  # left out of decoded text when skip_special_tokens is asked


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


class Tokenizer:
    """Encode, decode and apply chat templates for one vocabulary.

    Thread-safe: encoding holds no mutable state, so one instance serves many threads.
    """

    def __init__(
        self,
        tokenizer_json: dict[str, Any],
        config: dict[str, Any] | None = None,
        chat_template: str | dict[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
        model_vocab_size: int | None = None,
        fast_path_cache: Path | None = None,
    ) -> None:
        """Build from the parsed `tokenizer.json` and `tokenizer_config.json`.

        `model_vocab_size` is the model's (padded) embedding size: ids between the tokenizer's own
        size and it decode to nothing instead of being rejected. Most callers want `from_dir`.
        """
        self.config = dict(config or {})
        self._json = tokenizer_json
        self.added_tokens = tuple(
            AddedToken(int(t["id"]), t["content"], bool(t.get("special", False)))
            for t in tokenizer_json.get("added_tokens", [])
        )
        self.special_tokens: dict[str, int] = {t.content: t.id for t in self.added_tokens}
        self.special_ids = frozenset(t.id for t in self.added_tokens if t.special)
        vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
        self.vocab_size = max([*vocab.values(), *self.special_tokens.values()]) + 1
        self.id_limit = max(self.vocab_size, model_vocab_size or 0)
        self._byte_level = _is_byte_level(tokenizer_json)
        self._token_bytes = self._build_token_bytes(vocab)
        self._tiktoken = _tiktoken_encoder(tokenizer_json, self._token_bytes, fast_path_cache)
        self._hf = None if self._tiktoken is not None else _hf_tokenizer(tokenizer_json)
        self._hf_plain = None
        if self._hf is not None:
            # A second instance that reads added tokens written in text as plain text.
            self._hf_plain = _hf_tokenizer(tokenizer_json)
            self._hf_plain.encode_special_tokens = True
        self._nfc = (tokenizer_json.get("normalizer") or {}).get("type") == "NFC"
        self._special_set = frozenset(self.special_tokens)
        # Longest first, so that a token that is a prefix of another never wins over it.
        ordered = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.chat_template = chat_template if chat_template is not None else self.config.get("chat_template")
        self.special_tokens_map = {
            name: content
            for name in NAMED_SPECIAL_TOKENS
            if (content := _token_content(self.config.get(name))) is not None
        }
        eos = self.special_tokens_map.get("eos_token")
        eos_ids = [self.token_to_id(eos)] if eos is not None and self.token_to_id(eos) is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys([*eos_ids, *extra_eos_ids]))

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, folder: str | Path) -> Tokenizer:
        """Load a checkpoint folder's tokenizer (transformers 4.x or 5.x layout)."""
        folder = Path(folder)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json; qwen-serve needs the fast-tokenizer file")
        tokenizer_json = _read_json(tokenizer_path)
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        template: str | dict[str, str] | None = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif (folder / "chat_template.json").is_file():
            template = _read_json(folder / "chat_template.json").get("chat_template")
        else:
            template = _named_templates(config.get("chat_template"))
        extra_eos: list[int] = []
        if (folder / "generation_config.json").is_file():
            eos = _read_json(folder / "generation_config.json").get("eos_token_id")
            extra_eos = [eos] if isinstance(eos, int) else list(eos or [])
        model_vocab = checkpoint_limits(folder).vocab_size if (folder / "config.json").is_file() else None
        return cls(tokenizer_json, config, template, extra_eos, model_vocab)

    @classmethod
    def builtin(cls, vocab: builtin.BuiltinVocab = builtin.BuiltinVocab.QWEN3) -> Tokenizer:
        """A built-in Qwen vocabulary with qwen-serve's own Qwen3-style chat template."""
        path = builtin.builtin_tokenizer_json(vocab)
        config = builtin.tokenizer_config(vocab)
        # The default model's generation_config ends on <|im_end|> and <|endoftext|>.
        end_ids = [vocab.value.num_ranks + 2, vocab.value.num_ranks]
        return cls(_read_json(path), config, None, end_ids, vocab.value.model_vocab_size)

    # ---- encoding -----------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """Which encoder runs: "tiktoken" (exact fast path) or "tokenizers"."""
        return "tiktoken" if self._tiktoken is not None else "tokenizers"

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. With `allow_special`, added tokens written in the text become their ids."""
        if self._tiktoken is None:
            hf = self._hf if allow_special else self._hf_plain
            return hf.encode(text, add_special_tokens=False).ids
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            return self._encode_normalizing(text, allow_special)
        if allow_special:
            return self._tiktoken.encode(text, allowed_special=self._special_set, disallowed_special=())
        return self._tiktoken.encode_ordinary(text)

    def _encode_normalizing(self, text: str, allow_special: bool) -> list[int]:
        # As tokenizers does: added tokens are matched in the raw text, only the rest is normalised.
        if not allow_special or self._special_re is None:
            return self._tiktoken.encode_ordinary(unicodedata.normalize("NFC", text))
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            ids += self._tiktoken.encode_ordinary(unicodedata.normalize("NFC", text[start : match.start()]))
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        ids += self._tiktoken.encode_ordinary(unicodedata.normalize("NFC", text[start:]))
        return ids

    def encode_batch(self, texts: Sequence[str], allow_special: bool = True) -> list[list[int]]:
        """Token ids of many texts (the tokenizers backend spreads them over its threads)."""
        if self._tiktoken is None:
            hf = self._hf if allow_special else self._hf_plain
            encodings = hf.encode_batch_fast(list(texts), add_special_tokens=False)
            return [e.ids for e in encodings]
        return [self.encode(t, allow_special) for t in texts]

    def count(self, text: str) -> int:
        """How many tokens `text` encodes to."""
        return len(self.encode(text))

    # ---- decoding -----------------------------------------------------------------------

    def check_ids(self, ids: Iterable[int], field: str = "ids") -> None:
        """Raise InvalidInput when an id is negative or beyond the model's vocabulary."""
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < self.id_limit:
                raise InvalidInput(
                    f"{field}[{i}]", f"token id {token_id} is outside the vocabulary (0..{self.id_limit - 1})"
                )

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (empty for padding ids past the tokenizer's own size)."""
        return self._token_bytes[token_id] if token_id < self.vocab_size else b""

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The bytes `ids` stand for; special tokens left out when asked."""
        table, size = self._token_bytes, self.vocab_size
        if skip_special_tokens:
            skip = self.special_ids
            return b"".join(table[i] for i in ids if i < size and i not in skip)
        return b"".join(table[i] for i in ids if i < size)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; byte sequences that are not UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """The id of an added token or vocabulary entry (vocabulary spelling), or None."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._json["model"]["vocab"].get(token)

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to text as transformers' `apply_chat_template(..., tokenize=False)` does.

        Extra keywords (`enable_thinking=False`, ...) become template variables.
        """
        template = chat_template or self.chat_template
        if isinstance(template, dict):
            template = (
                template.get("tool_use") if tools and "tool_use" in template else template.get("default")
            )
        if not template:
            raise ChatTemplateError("this tokenizer has no chat template; send plain text instead")
        return render_chat(
            template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens_map,
            **kwargs,
        )

    # ---- internals ----------------------------------------------------------------------

    def _build_token_bytes(self, vocab: dict[str, int]) -> list[bytes]:
        table = [b""] * self.vocab_size
        if self._byte_level:
            char_to_byte = {c: b for b, c in enumerate(builtin._byte_to_char())}
            for piece, token_id in vocab.items():
                try:
                    table[token_id] = bytes(char_to_byte[c] for c in piece)
                except KeyError:
                    table[token_id] = piece.encode("utf-8")
        else:
            hf = _hf_tokenizer(self._json)
            for token_id in vocab.values():
                table[token_id] = hf.decode([token_id], skip_special_tokens=False).encode("utf-8")
        for token in self.added_tokens:
            table[token.id] = token.content.encode("utf-8")
        return table


def _named_templates(value: Any) -> str | dict[str, str] | None:
    # tokenizer_config.json may hold several named templates: [{"name": "default", "template": ...}].
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value}
    return value


def _is_byte_level(tokenizer_json: dict[str, Any]) -> bool:
    decoder = tokenizer_json.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


def _hf_tokenizer(tokenizer_json: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_str(json.dumps(tokenizer_json))


def _split_regex(tokenizer_json: dict[str, Any]) -> str | None:
    """The regex of a `Split -> ByteLevel(use_regex=false)` pre-tokenizer, the shape tiktoken can run."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return None
    return split.get("pattern", {}).get("Regex")


def _tiktoken_encoder(tokenizer_json: dict[str, Any], token_bytes: list[bytes], cache: Path | None) -> Any:
    """A tiktoken Encoding giving exactly the ids `tokenizer.json` gives, or None when none can."""
    model = tokenizer_json.get("model", {})
    pattern = _split_regex(tokenizer_json)
    normalizer = (tokenizer_json.get("normalizer") or {}).get("type")
    if (
        pattern is None
        or model.get("type") != "BPE"
        or model.get("byte_fallback")
        or model.get("dropout")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or normalizer not in (None, "NFC")
        or not _is_byte_level(tokenizer_json)
    ):
        return None
    added = tokenizer_json.get("added_tokens", [])
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    vocab: dict[str, int] = model["vocab"]
    ranks = {token_bytes[i]: i for i in vocab.values()}
    if len(ranks) != len(vocab) or sorted(vocab.values()) != list(range(len(vocab))):
        return None
    if not _merges_are_bpe_order(model, vocab, ranks, cache):
        return None
    import tiktoken

    specials = {t["content"]: int(t["id"]) for t in added}
    try:
        return tiktoken.Encoding(
            "checkpoint", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
    except ValueError:
        return None


def _merges_are_bpe_order(
    model: dict[str, Any], vocab: dict[str, int], ranks: dict[bytes, int], cache: Path | None
) -> bool:
    """True when each token's merge is the last one byte-pair encoding by rank takes to spell it.

    Then the tokenizers library and tiktoken agree on every input. The check takes a second or two
    for a large vocabulary, so its verdict is cached by the content of the merges.
    """
    merges = model.get("merges", [])
    digest = hashlib.sha256(json.dumps([merges, model.get("ignore_merges", False)]).encode()).hexdigest()
    verdict_path = (cache or cache_root()) / "bpe-order" / f"{digest}.json"
    if verdict_path.is_file():
        return bool(json.loads(verdict_path.read_text()))
    char_to_byte = {c: b for b, c in enumerate(builtin._byte_to_char())}

    def to_bytes(piece: str) -> bytes:
        return bytes(char_to_byte[c] for c in piece)

    given: dict[int, tuple[bytes, bytes]] = {}
    last_rank = -1
    try:
        for merge in merges:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            rank = vocab[left + right]
            # tokenizers ranks merges by position, tiktoken by the id they make: the orders must agree.
            if rank <= last_rank:
                return False
            last_rank = rank
            given[rank] = (to_bytes(left), to_bytes(right))
    except (KeyError, ValueError):
        return False
    ok = True
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        expected = builtin._last_merge(token, ranks)
        # An unreachable token is still produced whole by tiktoken; tokenizers does so with ignore_merges.
        if given.get(rank) != expected or (expected is None and not model.get("ignore_merges")):
            ok = False
            break
    builtin.write_atomically(verdict_path, json.dumps(ok).encode())
    return ok
