"""Structured output's cost: the grammar libraries' per-token mask, and constrained decoding against free decoding.

Run by hand (not a test):
    .venv/bin/python bench/grammar_mask_bench.py            # both parts
    .venv/bin/python bench/grammar_mask_bench.py --masks    # only the libraries' mask cost

1. Mask cost per token on the Qwen vocabulary (151,936 entries), for the same JSON schema and the same
   answer's tokens: llguidance (what the engine uses) and, when installed, xgrammar, at batch 1 and 32.
2. Our engine on a small random Qwen3 checkpoint (real vocabulary): decode tokens/s of requests constrained
   by a JSON schema against the same requests free, at batch 1 and 32, greedy. Both runs generate the same
   number of tokens per request (the free ones are capped at the constrained answers' lengths), so the
   ratio is the grammar's overhead per token: the mask, its application to the logits row, and feeding
   the matcher.
All figures are measured in this run; ratios compare against them only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from qwenserve.default_model import TINY_CONFIG, ensure_default_model, write_checkpoint
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.structured import StructuredOutput
from qwenserve.tokenizer import Tokenizer

VOCAB = 151936
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 150},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
                   "city": {"enum": ["Paris", "Berlin", "Tokyo"]}},
    "required": ["name", "age", "tags", "city"], "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "notes"], "city": "Paris"}


def _answer_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(json.dumps(ANSWER, separators=(",", ":"))) + [151645]


def _new_schema(n: int) -> dict:
    """SCHEMA under another name: a schema the library has not seen (a new client's), to time its setup."""
    return {**SCHEMA, "title": f"person-{n}-{time.monotonic_ns()}"}


def mask_llguidance(folder: Path, ids: list[int], batch: int) -> tuple[float, float] | None:
    """Seconds from a new schema to its first matcher, and the median seconds to fill `batch` rows' masks per
    token of the answer (None when llguidance is not installed)."""
    try:
        import llguidance
        import llguidance.torch as llg_torch
    except ImportError:
        return None
    tokenizer_json = (folder / "tokenizer.json").read_text()

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=151645)
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(_new_schema(batch), defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(tokenizer, grammar)]
    setup = time.perf_counter() - started
    matchers += [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch - 1)]
    mask = llg_torch.allocate_token_bitmask(batch, VOCAB)
    times = []
    for token in ids:
        started = time.perf_counter()
        for i, matcher in enumerate(matchers):
            llg_torch.fill_next_token_bitmask(matcher, mask, i)
        times.append(time.perf_counter() - started)
        for matcher in matchers:
            assert matcher.consume_token(token), matcher.get_error()
    return setup, statistics.median(times)


def mask_xgrammar(folder: Path, ids: list[int], batch: int) -> tuple[float, float]:
    """As mask_llguidance, for xgrammar (the engine's)."""
    import transformers
    import xgrammar

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[151645])
    compiler = xgrammar.GrammarCompiler(info)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(_new_schema(batch)), any_whitespace=False,
                                            separators=(",", ":"))
    matchers = [xgrammar.GrammarMatcher(compiled)]
    setup = time.perf_counter() - started
    matchers += [xgrammar.GrammarMatcher(compiled) for _ in range(batch - 1)]
    mask = xgrammar.allocate_token_bitmask(batch, VOCAB)
    times = []
    for token in ids:
        started = time.perf_counter()
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, i)
        times.append(time.perf_counter() - started)
        for matcher in matchers:
            assert matcher.accept_token(token)
    return setup, statistics.median(times)


def mask_outlines(folder: Path, ids: list[int], batch: int) -> tuple[float, float] | None:
    """As mask_llguidance, for outlines-core (None when it is not installed)."""
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    tokenizer = Tokenizer.from_dir(folder)
    eos = 151645
    by_bytes: dict[bytes, list[int]] = {}
    for token in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes(token) if token != eos else b""
        if raw:
            by_bytes.setdefault(raw, []).append(token)
    vocabulary = Vocabulary(eos, by_bytes)
    started = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(_new_schema(batch)), None), vocabulary)
    guides = [Guide(index)]
    setup = time.perf_counter() - started
    guides += [Guide(index) for _ in range(batch - 1)]
    mask = torch.zeros(batch, (VOCAB + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids[:-1]:
        started = time.perf_counter()
        for j, guide in enumerate(guides):
            guide.write_mask_into(mask[j].data_ptr(), mask[j].numel(), 4)
        times.append(time.perf_counter() - started)
        for guide in guides:
            guide.advance(token)
    return setup, statistics.median(times)


def masks() -> None:
    folder = ensure_default_model()
    tokenizer = Tokenizer.from_dir(folder)
    ids = _answer_ids(tokenizer)
    print(f"1. mask per token, JSON schema answer of {len(ids)} tokens, vocabulary {VOCAB} (llguidance and "
          "outlines-core when installed: `pip install llguidance outlines-core`)")
    for batch in (1, 32):
        xgr_setup, xgr = mask_xgrammar(folder, ids, batch)
        print(f"   batch {batch:2d}: xgrammar      {xgr * 1e3:7.3f} ms/step ({xgr / batch * 1e6:6.1f} us/row), "
              f"a new schema {xgr_setup * 1e3:8.1f} ms")
        for name, measure in (("llguidance", mask_llguidance), ("outlines-core", mask_outlines)):
            other = measure(folder, ids, batch)
            if other is None:
                print(f"             {name}: not installed")
                continue
            setup, step = other
            print(f"             {name:13s} {step * 1e3:7.3f} ms/step ({step / batch * 1e6:6.1f} us/row), a new "
                  f"schema {setup * 1e3:8.1f} ms; per-row cost {step / xgr:.1f}x xgrammar's")


def engine_overhead(threads: int) -> None:
    folder = write_checkpoint(Path("/tmp/qwenserve-bench/grammar-tiny"),
                              {**TINY_CONFIG, "max_position_embeddings": 1024}, seed=3)
    engine = LLMEngine.from_pretrained(folder, EngineConfig(kv_cache_memory_gb=0.5, num_threads=threads))
    tokenizer = Tokenizer.from_dir(folder)
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    print(f"2. engine, tiny Qwen3 (hidden {TINY_CONFIG['hidden_size']}, real vocabulary), {threads} threads, greedy")
    try:
        for batch in (1, 32):
            prompts = [tokenizer.encode(f"Person number {i}, as JSON:") for i in range(batch)]
            engine.generate_sync(prompts[:1], SamplingParams(temperature=0, max_tokens=4, structured=structured))
            started = time.perf_counter()
            constrained = engine.generate_sync(prompts, [SamplingParams(temperature=0, max_tokens=200,
                                                                        structured=structured)] * batch)
            constrained_s = time.perf_counter() - started
            lengths = [len(ids) for ids in constrained]
            started = time.perf_counter()
            free = engine.generate_sync(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                  for n in lengths])
            free_s = time.perf_counter() - started
            tokens = sum(lengths)
            assert sum(len(ids) for ids in free) == tokens
            print(f"   batch {batch:2d}: {tokens} tokens; constrained {tokens / constrained_s:8.1f} tok/s, free "
                  f"{tokens / free_s:8.1f} tok/s; constrained/free {free_s / constrained_s:.2f} "
                  f"(+{(constrained_s - free_s) / tokens * 1e3:.2f} ms per token)")
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", action="store_true", help="only the libraries' mask cost")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    masks()
    if not args.masks:
        engine_overhead(args.threads)


if __name__ == "__main__":
    main()
