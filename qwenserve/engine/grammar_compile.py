"""Structured-output constraints compiled in child processes, each compile under a deadline and a memory budget.

Compiling a constraint against a model's vocabulary can take a minute and gigabytes for a hostile one (20,000
choices, a 50,000-string enum). A thread cannot be stopped, nor its memory bounded; a process can. So each of
`GrammarLimits.compile_processes` pool threads owns one child (`python -m qwenserve.engine.grammar_compile`,
started on first use and again after it was stopped): the child parses and compiles, checks that the language is
not empty, and answers with the compiled grammar as xgrammar's JSON, which the parent loads. The parent watches
the child while it works: past the deadline, or its resident memory past its idle size plus the budget, the
child is killed and the request refused with GrammarLimitExceeded. Nothing here runs on an event loop or the
engine's compute loop, and a slow compile holds up only the requests queued behind it on the same process.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, TypeVar

from qwenserve.engine.structured import (
    GrammarLimitExceeded,
    GrammarLimits,
    StructuredOutput,
    StructuredOutputError,
    check_grammar,
)

log = logging.getLogger("qwenserve.engine")
T = TypeVar("T")

_HEADER = struct.Struct(">Q")
# How often the parent looks at a working child's memory (an allocation spree overshoots by what it adds meanwhile).
_WATCH_INTERVAL_S = 0.02
# A child's start (imports, the vocabulary) is not the request's compile time, but it must end.
_START_TIMEOUT_S = 120.0


# glibc keeps the heap a large grammar's JSON was parsed in: a worker that had loaded a few 120 KB enums (tens of MiB
# compiled, far more as JSON) held most of a GiB more long after, whatever the cache bound (issue 31). After each
# such load the free heap goes back to the system; the trim takes some ms, on a compile thread.
TRIM_AFTER_BYTES = 1 << 20
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere


def give_back_free_heap() -> None:
    """Return the process's free heap memory to the system (glibc's malloc_trim; a no-op without it)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _send(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return None if len(data) < size else pickle.loads(data)


def _rss_bytes(pid: int) -> int:
    """A process's resident memory (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def compile_checked(compiler: Any, structured: StructuredOutput, vocab_size: int) -> Any:
    """The constraint compiled, or StructuredOutputError: unparsable, uncompilable, or a language without a
    single string (no first token is allowed, not even the end), which could only end in an error later."""
    import xgrammar

    grammar = check_grammar(structured)
    try:
        compiled = compiler.compile_grammar(grammar)
    except RuntimeError as e:
        raise StructuredOutputError(f"the {structured.what} cannot be compiled: {e}") from None
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise StructuredOutputError(f"the {structured.what} matches nothing: no answer can satisfy it")
    return compiled


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The child's side: the vocabulary first, then one (kind, spec, max_bytes) after another, each answered
    ("ok", compiled JSON, bytes), ("error", message) or ("too_large", bytes)."""
    import xgrammar

    first = _receive(requests)
    if first is None:
        return
    info = xgrammar.TokenizerInfo.deserialize_json(first)
    # No cache here (the parent keeps one, bounded in bytes) and one thread (its memory is what is watched).
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _send(answers, ("ready",))
    while (job := _receive(requests)) is not None:
        kind, spec, max_bytes = job
        try:
            compiled = compile_checked(compiler, StructuredOutput(kind, spec), info.vocab_size)
            size = int(compiled.memory_size_bytes)
            reply: tuple[Any, ...] = ("too_large", size) if size > max_bytes else ("ok", compiled.serialize_json(), size)
        except StructuredOutputError as e:
            reply = ("error", str(e))
        except MemoryError:
            reply = ("too_large", max_bytes + 1)
        _send(answers, reply)


class CompileProcess:
    """One child process and the watch over it; used by one thread at a time."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info_json = tokenizer_info_json
        self._proc: subprocess.Popen[bytes] | None = None
        self._idle_rss = 0

    def compile(self, structured: StructuredOutput, limits: GrammarLimits) -> tuple[str, int]:
        """(compiled JSON, its bytes); StructuredOutputError / GrammarLimitExceeded for the request."""
        proc = self._started()
        before = _rss_bytes(proc.pid)
        if before > self._idle_rss + limits.compile_memory_bytes:  # what earlier compiles left behind: start afresh
            self.stop()
            proc = self._started()
            before = self._idle_rss
        assert proc.stdin is not None and proc.stdout is not None
        _send(proc.stdin, (structured.kind, structured.spec, limits.compile_memory_bytes))
        deadline = time.monotonic() + limits.compile_timeout_s
        ceiling = before + limits.compile_memory_bytes
        while not select.select([proc.stdout], [], [], _WATCH_INTERVAL_S)[0]:
            if time.monotonic() > deadline:
                self.stop()
                raise GrammarLimitExceeded(
                    f"the {structured.what} was not compiled within {limits.compile_timeout_s:g}s, this server's "
                    f"limit", "--grammar-compile-timeout-s")
            if _rss_bytes(proc.pid) > ceiling:
                self.stop()
                raise self._over_memory(structured, limits)
        reply = _receive(proc.stdout)
        if reply is None:  # it died: the kernel's or the allocator's answer to its memory, or a crash
            log.warning("a grammar compile process exited with %s while compiling a %s", proc.poll(), structured.what)
            self.stop()
            raise self._over_memory(structured, limits)
        if reply[0] == "ok":
            return reply[1], reply[2]
        if reply[0] == "too_large":
            raise self._over_memory(structured, limits)
        raise StructuredOutputError(reply[1])

    @staticmethod
    def _over_memory(structured: StructuredOutput, limits: GrammarLimits) -> GrammarLimitExceeded:
        return GrammarLimitExceeded(
            f"compiling the {structured.what} takes more than {limits.compile_memory_bytes >> 20} MiB, this "
            f"server's limit", "--grammar-compile-memory-mb")

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        proc = subprocess.Popen([sys.executable, "-m", "qwenserve.engine.grammar_compile"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        _send(proc.stdin, self._info_json)
        if not select.select([proc.stdout], [], [], _START_TIMEOUT_S)[0] or _receive(proc.stdout) != ("ready",):
            self.stop()
            raise RuntimeError(f"the grammar compile process did not start within {_START_TIMEOUT_S:g}s")
        self._idle_rss = _rss_bytes(proc.pid)
        return proc

    def stop(self) -> None:
        """Kill the child (a compile in progress is abandoned); the next compile starts a new one."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


class GrammarCompilePool:
    """Compiles on `limits.compile_processes` threads, each with its own child process. `tokenizer_info_json`
    (the vocabulary as xgrammar's JSON) is called once, on the first compile."""

    def __init__(self, tokenizer_info_json: Callable[[], str], limits: GrammarLimits) -> None:
        self._info_json_of = tokenizer_info_json
        self._info_json: str | None = None
        self.limits = limits
        self._lock = threading.Lock()
        self._processes: list[CompileProcess] = []
        self._local = threading.local()
        self._executor = concurrent.futures.ThreadPoolExecutor(limits.compile_processes,
                                                               thread_name_prefix="qwenserve-grammar")

    def submit(self, structured: StructuredOutput, load: Callable[[str, int], T]) -> concurrent.futures.Future[T]:
        """A future of `load(compiled JSON, bytes)`, called on the pool's thread (loading a large grammar takes
        a while too)."""
        return self._executor.submit(self._compile_and_load, structured, load)

    def _compile_and_load(self, structured: StructuredOutput, load: Callable[[str, int], T]) -> T:
        compiled_json, size = self._compile(structured)
        loaded = load(compiled_json, size)
        del compiled_json
        if size >= TRIM_AFTER_BYTES:
            give_back_free_heap()
        return loaded

    def _compile(self, structured: StructuredOutput) -> tuple[str, int]:
        process: CompileProcess | None = getattr(self._local, "process", None)
        if process is None:
            with self._lock:
                if self._info_json is None:
                    self._info_json = self._info_json_of()
                process = self._local.process = CompileProcess(self._info_json)
                self._processes.append(process)
        return process.compile(structured, self.limits)

    def close(self) -> None:
        """Stop every child; compiles waiting in the queue are cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for process in self._processes:
                process.stop()


if __name__ == "__main__":
    # Answers go to a private copy of stdout; anything a library prints lands on stderr instead.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, answers)
