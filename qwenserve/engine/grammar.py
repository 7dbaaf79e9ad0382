"""The engine's side of structured output: one model's vocabulary as xgrammar sees it, compiled constraints,
a matcher per request, and the masks applied to the logits rows of constrained requests (structured.py
says what a constraint is and why xgrammar)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.structured import (
    ReasoningFirst,
    StructuredOutput,
    StructuredOutputError,
    compiled_grammar,
)

# Bytes to bits, least significant first: how the mask packs 32 tokens into each int32 (the PyTorch path).
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


class GrammarBackend:
    """One model's grammar machinery: its vocabulary as xgrammar sees it, and compiled constraints. `cpu_kernels`
    (the engine's choice) apply the masks to fp32 logits; without them PyTorch's ops do."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int],
                 cpu_kernels: CpuKernels | None = None) -> None:
        self._cpu_kernels = cpu_kernels
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._compiled: dict[StructuredOutput, Any] = {}

    def _grammar_compiler(self) -> Any:
        with self._lock:  # built once, on the first constrained request (a second or two)
            if self._compiler is None:
                import transformers
                import xgrammar

                if not self._tokenizer_json.is_file():
                    raise StructuredOutputError(f"structured output needs the model's tokenizer.json "
                                                f"({self._tokenizer_json} is missing)")
                hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(self._tokenizer_json))
                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._eos)
                self._compiler = xgrammar.GrammarCompiler(info)
            return self._compiler

    def matcher(self, structured: StructuredOutput) -> Any:
        """A fresh matcher for one request; StructuredOutputError when the constraint cannot be compiled."""
        import xgrammar

        compiler = self._grammar_compiler()
        compiled = self._compiled.get(structured)
        if compiled is None:
            try:
                compiled = compiler.compile_grammar(compiled_grammar(structured))
            except RuntimeError as e:
                raise StructuredOutputError(f"the {structured.what} cannot be compiled: {e}") from None
            if len(self._compiled) >= 256:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[structured] = compiled
        return xgrammar.GrammarMatcher(compiled)

    def matcher_for(self, structured: StructuredOutput, reasoning_first: ReasoningFirst | None) -> Any:
        """A request's matcher: the constraint's, behind its reasoning block when the model thinks first."""
        matcher = self.matcher(structured)
        return matcher if reasoning_first is None else AfterReasoning(matcher, reasoning_first, self._vocab_size)

    def mask_rows(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set to -inf, in place, every token the matcher of each of `rows` does not allow next."""
        words = (self._vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        for j, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, j)
        index = torch.tensor(rows, dtype=torch.int64)
        if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1 and \
                self._cpu_kernels is not None:
            self._cpu_kernels.apply_token_bitmask(logits, index, bitmask)
            return
        allowed = _BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[1]]
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


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
