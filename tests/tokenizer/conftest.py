"""Fixtures of the tokenizer tests: one cache folder per session, built tokenizers, a multilingual corpus."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from qwenserve.tokenizer import BuiltinVocab, Tokenizer


@pytest.fixture(scope="session", autouse=True)
def qwenserve_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every conversion and checkpoint of the session goes to a fresh cache (child processes inherit it)."""
    cache = tmp_path_factory.mktemp("qwenserve-cache")
    previous = os.environ.get("QWENSERVE_CACHE")
    os.environ["QWENSERVE_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("QWENSERVE_CACHE", None)
    else:
        os.environ["QWENSERVE_CACHE"] = previous


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Tokenizer:
    return Tokenizer.builtin(BuiltinVocab.QWEN3)


@pytest.fixture(scope="session")
def qwen3_5_tokenizer() -> Tokenizer:
    return Tokenizer.builtin(BuiltinVocab.QWEN3_5)


_FRAGMENTS = {
    "english": [
        "The quick brown fox",
        "don't",
        "I'LL",
        "they've",
        "it's",
        "Hello, world!",
        "e-mail",
        "U.S.A.",
    ],
    "chinese": ["你好，世界！", "今天天气很好。", "机器学习模型", "分布式推理服务", "中华人民共和国"],
    "japanese": ["こんにちは", "カタカナ", "東京都", "ありがとうございます。", "ｶﾀｶﾅ"],
    "arabic": ["مرحبا بالعالم", "السلام عليكم", "اللغة العربية", "١٢٣"],
    "emoji": ["👨‍👩‍👧‍👦", "🇯🇵", "🇺🇸🇫🇷", "👍🏽", "🏳️‍🌈", "❤️", "🧑🏿‍💻", "😀😃"],
    "code": [
        "def f(x):\r\n\treturn x * 2\r\n",
        "\tif (a && b) {\n\t\tcall();\n\t}",
        "x+=1;//note",
        "<div class='a'>",
    ],
    "digits": ["0", "12", "123456789012345", "3.14159", "1,000,000", "2024-11-30"],
    "space": [" ", "  ", "    ", "\t\t", "\n", "\n\n\n", "\r\n", " \n ", "        x"],
    "marks": ["e\u0301", "नमस्ते", "ก่อน", "한국어", "Ελληνικά", "Привет", "ﬁ", "Å"],
}


def make_corpus(seed: int, count: int) -> list[str]:
    """Random texts mixing every fragment family, joined with varied whitespace."""
    rng = random.Random(seed)
    families = list(_FRAGMENTS)
    texts = [fragment for family in families for fragment in _FRAGMENTS[family]]
    for _ in range(count):
        parts = [rng.choice(_FRAGMENTS[rng.choice(families)]) for _ in range(rng.randint(1, 12))]
        texts.append("".join(p + rng.choice(["", " ", "  ", "\n", "\t", "\r\n"]) for p in parts))
    return texts


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return make_corpus(seed=1234, count=400)
