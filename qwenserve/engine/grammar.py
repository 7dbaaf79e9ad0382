"""The engine's side of structured output: one model's vocabulary as xgrammar sees it, compiled constraints,
a matcher per request, and the masks applied to the logits rows of constrained requests (structured.py
says what a constraint is and why xgrammar)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.grammar_compile import GrammarCompilePool
from qwenserve.engine.structured import (
    GrammarLimitExceeded,
    GrammarLimits,
    ReasoningFirst,
    StructuredOutput,
    StructuredOutputError,
)

# Bytes to bits, least significant first: how the mask packs 32 tokens into each int32 (the PyTorch path).
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
# A request's mask over its budget on this many steps in a row ends it: one slow step may be a busy machine.
MASK_OVER_BUDGET_STEPS = 3
# ... and one that takes this many times the budget ends it at once, the step not waiting for it.
MASK_HARD_LIMIT_FACTOR = 10
MASK_THREADS = 32


class GrammarBackend:
    """One model's grammar machinery: its vocabulary as xgrammar sees it, compiled constraints (compiled in child
    processes under `limits`, grammar_compile.py, and kept in a cache bounded in bytes), and the masks. `cpu_kernels`
    (the engine's choice) apply the masks to fp32 logits; without them PyTorch's ops do."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int],
                 cpu_kernels: CpuKernels | None = None, limits: GrammarLimits | None = None) -> None:
        self._cpu_kernels = cpu_kernels
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.limits = limits or GrammarLimits()
        self._lock = threading.RLock()  # a compile's done-callback may run inside it, on the submitting thread
        self._info_lock = threading.Lock()  # apart: building the vocabulary takes seconds, a cache look-up must not
        self._info: Any = None
        self._cache = CompiledGrammarCache(self.limits.cache_bytes)
        self._compiling: dict[StructuredOutput, concurrent.futures.Future[Any]] = {}
        self._pool = GrammarCompilePool(lambda: self._tokenizer_info().serialize_json(), self.limits)
        # Many: a fill given up on keeps its thread until it ends (its request is refused, so once per request).
        self._mask_threads = concurrent.futures.ThreadPoolExecutor(MASK_THREADS, thread_name_prefix="qwenserve-mask")

    def _tokenizer_info(self) -> Any:
        with self._info_lock:  # built once, on the first constrained request (a second or two)
            if self._info is None:
                import transformers
                import xgrammar

                if not self._tokenizer_json.is_file():
                    raise StructuredOutputError(f"structured output needs the model's tokenizer.json "
                                                f"({self._tokenizer_json} is missing)")
                hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(self._tokenizer_json))
                self._info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size,
                                                                     stop_token_ids=self._eos)
            return self._info

    def compiled(self, structured: StructuredOutput) -> concurrent.futures.Future[Any]:
        """A future of (the compiled constraint, its bytes): at once from the cache, else from the compile pool (a request
        asking for a constraint already being compiled waits for that compile). Its exception is a
        StructuredOutputError (GrammarLimitExceeded past a bound), a 400 for the client."""
        self.limits.check_size(structured)
        with self._lock:
            hit = self._cache.get(structured)
            if hit is not None:
                done: concurrent.futures.Future[Any] = concurrent.futures.Future()
                done.set_result(hit)
                return done
            future = self._compiling.get(structured)
            if future is None:
                future = self._compiling[structured] = self._pool.submit(structured, self._load)
                future.add_done_callback(lambda f: self._compiled_done(structured, f))
            return future

    async def compile(self, structured: StructuredOutput) -> Any:
        """The compiled constraint, awaited on the caller's event loop (which goes on meanwhile)."""
        compiled, _ = await asyncio.wrap_future(self.compiled(structured))
        return compiled

    def compile_sync(self, structured: StructuredOutput) -> Any:
        """The compiled constraint, waited for on the calling thread."""
        compiled, _ = self.compiled(structured).result()
        return compiled

    def _load(self, compiled_json: str, size: int) -> Any:
        import xgrammar

        compiled = xgrammar.CompiledGrammar.deserialize_json(compiled_json, self._tokenizer_info())
        return compiled, size

    def _compiled_done(self, structured: StructuredOutput, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._compiling.pop(structured, None)
            if not future.cancelled() and future.exception() is None:
                compiled, size = future.result()
                self._cache.put(structured, compiled, size)

    def matcher_for(self, compiled: Any, reasoning_first: ReasoningFirst | None) -> RequestGrammar:
        """A request's matcher for a compiled constraint (from `compile`), behind its reasoning block when the
        model thinks first; it counts what its masks cost."""
        import xgrammar

        matcher: Any = xgrammar.GrammarMatcher(compiled)
        if reasoning_first is not None:
            matcher = AfterReasoning(matcher, reasoning_first, self._vocab_size)
        return RequestGrammar(matcher, self.limits.mask_budget_s)

    def cached_bytes(self) -> int:
        """What the compiled constraints kept for reuse hold."""
        with self._lock:
            return self._cache.bytes

    def close(self) -> None:
        """Stop the compile processes and the mask threads."""
        self._pool.close()
        self._mask_threads.shutdown(wait=False, cancel_futures=True)

    def mask_rows(self, logits: torch.Tensor, rows: list[int], matchers: list[RequestGrammar]) -> None:
        """Set to -inf, in place, every token the matcher of each of `rows` does not allow next. GrammarLimitExceeded
        (or StructuredOutputError for a grammar at a dead end) when a request's grammar can go no further; the
        caller ends that request and samples the others again without it."""
        words = (self._vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        # Each fill on a mask thread, waited for at most the hard limit: a fill that runs on (a grammar that blew
        # up) ends its request, while the step, and every other request in it, goes on.
        fills = [None if m.refusal is not None else self._mask_threads.submit(m.fill_row, words) for m in matchers]
        hard_s = self.limits.mask_budget_s * MASK_HARD_LIMIT_FACTOR
        concurrent.futures.wait([f for f in fills if f is not None], timeout=hard_s)
        refused: StructuredOutputError | None = None
        for j, (matcher, fill) in enumerate(zip(matchers, fills, strict=True)):
            if fill is not None and not fill.done():
                matcher.abandon(hard_s)
            elif fill is not None:
                row, seconds = fill.result()
                bitmask[j] = row[0]
                matcher.charge(row, seconds)
            refused = refused or matcher.refusal
        if refused is not None:
            raise refused
        index = torch.tensor(rows, dtype=torch.int64)
        if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1 and \
                self._cpu_kernels is not None:
            self._cpu_kernels.apply_token_bitmask(logits, index, bitmask)
            return
        allowed = _BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[1]]
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


class CompiledGrammarCache:
    """Compiled constraints by constraint, bounded in bytes (xgrammar's own count of each), least recently used
    dropped first. Not thread-safe: its owner locks."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[StructuredOutput, tuple[Any, int]] = OrderedDict()

    def get(self, structured: StructuredOutput) -> tuple[Any, int] | None:
        entry = self._entries.get(structured)
        if entry is not None:
            self._entries.move_to_end(structured)
        return entry

    def put(self, structured: StructuredOutput, compiled: Any, size: int) -> None:
        if size > self.max_bytes or structured in self._entries:
            return  # larger than the whole cache: used by its requests, never kept
        self._entries[structured] = (compiled, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


class RequestGrammar:
    """A request's matcher and what its masks cost. A mask that takes longer than `budget_s` on
    MASK_OVER_BUDGET_STEPS steps in a row (a grammar that gets slower as the answer grows), one not done within
    MASK_HARD_LIMIT_FACTOR times it, or one that allows no token at all sets `refusal`; the request is then ended,
    the batch goes on."""

    def __init__(self, matcher: Any, budget_s: float) -> None:
        self._matcher = matcher
        self._budget_s = budget_s
        self._slow_steps = 0
        self.refusal: StructuredOutputError | None = None

    def fill_row(self, words: int) -> tuple[torch.Tensor, float]:
        """This request's next mask, into a row of its own (a fill given up on may still be writing it), and the
        seconds it took. Runs on a mask thread (xgrammar releases the GIL while it fills)."""
        row = torch.full((1, words), -1, dtype=torch.int32)
        started = time.perf_counter()
        self._matcher.fill_next_token_bitmask(row, 0)
        return row, time.perf_counter() - started

    def charge(self, row: torch.Tensor, seconds: float) -> None:
        """Count a finished fill against the budget, and refuse a mask with no token in it."""
        self._slow_steps = self._slow_steps + 1 if seconds > self._budget_s else 0
        if self._slow_steps >= MASK_OVER_BUDGET_STEPS:
            self.refusal = GrammarLimitExceeded(
                f"the request's grammar took {seconds * 1000:.0f} ms to compute the allowed tokens, on "
                f"{self._slow_steps} steps in a row, more than this server's limit of {self._budget_s * 1000:g} ms",
                "--grammar-mask-budget-ms")
        elif not bool(row.any()):
            self.refusal = StructuredOutputError("the request's grammar allows no further token (it has no "
                                                 "complete answer from here)")

    def abandon(self, waited_s: float) -> None:
        """A fill still running after `waited_s`: the request is refused, its matcher never used again."""
        self.refusal = GrammarLimitExceeded(
            f"the request's grammar took more than {waited_s * 1000:.0f} ms to compute the allowed tokens, "
            f"{MASK_HARD_LIMIT_FACTOR} times this server's limit of {self._budget_s * 1000:g} ms",
            "--grammar-mask-budget-ms")

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))


class AfterReasoning:
    """A matcher that waits out a thinking model's reasoning block.

    First token: the grammar's tokens or the block's opening tag. Inside the block every token is allowed (the
    end-of-sequence too: an answer may end while thinking, as one cut off by max_tokens does). After the
    closing tag the grammar's matcher sees every token, from its start state.
    """

    def __init__(self, inner: Any, reasoning: ReasoningFirst, vocab_size: int) -> None:
        self._inner, self._ids = inner, reasoning
        self._words = (vocab_size + 31) // 32
        self._state = "reasoning" if reasoning.open_in_prompt else "first"

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == "reasoning":
            bitmask[row, : self._words] = -1
            return
        self._inner.fill_next_token_bitmask(bitmask, row)
        if self._state == "first":
            word, bit = divmod(self._ids.start_id, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # an int32's bits

    def accept_token(self, token: int) -> bool:
        if self._state == "reasoning":
            if token == self._ids.end_id:
                self._state = "answer"
            return True
        if self._state == "first":
            self._state = "answer"
            if token == self._ids.start_id:
                self._state = "reasoning"
                return True
        return bool(self._inner.accept_token(token))
