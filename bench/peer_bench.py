"""Ours against vLLM's CPU build: the same checkpoint, the same token-id workloads, one server at a time.

    .venv/bin/python bench/peer_bench.py --vllm-venv /work/vllm-cpu-venv [--rounds 3] [--json out.json]
    .venv/bin/python bench/peer_bench.py --vllm-venv /work/vllm-cpu-venv --quick     # smoke run, one round

Servers: `qwen-serve up DIR --dtype float32`, `qwen-serve up DIR --dtype auto` (the default) and vLLM's
`python -m vllm.entrypoints.openai.api_server --dtype bfloat16` from --vllm-venv (README: "Benchmark against
vLLM's CPU build"), every one with the same KV-cache memory (--kv-cache-gb; VLLM_CPU_KVCACHE_SPACE for vLLM) and
--max-model-len. Each round starts each server in turn (alternating order: A B C, C B A, ...), waits for its first
successful completion (start to ready), warms it up, then runs over the OpenAI streaming API
(`/v1/completions`, prompt as token ids, ignore_eos, stream_options.include_usage), with the same seeded prompts
for every server:
  - burst: 32 requests at once, prompts 64-512 tokens, outputs 32-256: output tokens/s and ITL p50;
  - stream: one request at a time, 128 in / 128 out: ITL p50 and TTFT p50;
  - long: a 2,000-token prompt at a time: TTFT p50.
Prompts are random token ids, all different, so no request hits another's prefix cache.

Printed: each measure's median over the rounds with its min-max, the ratio ours/vLLM per round (median and
min-max), the CPU's model and flags, each server's dtype (ours: the precision its engines logged), and the CPU
time other processes took while each server ran: /proc/stat's busy time (user+nice+system+irq+softirq) over the
server's window (spawn to stop) minus the server's processes' own time (utime+stime+cutime+cstime of every
process in its session, read just before it is stopped) minus this script's; good to about a core-second (the
kernel keeps the two tallies apart, so a quiet window can read slightly negative). A Markdown table at the end; --json
writes everything. Where vLLM cannot run, the table compares ours at auto against ours at fp32 and says why.
Traffic goes to 127.0.0.1 only; every server's whole session is killed at the end, on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from qwenserve.cache import cache_root
from qwenserve.default_model import QWEN3_0_6B_CONFIG, write_checkpoint
from qwenserve.launcher import free_port
from qwenserve.loadgen.prompts import Prompt
from qwenserve.loadgen.report import write_json
from qwenserve.loadgen.runner import Bounds, LiveCounters, run_closed_loop, run_open_loop
from qwenserve.loadgen.stats import RequestRecord, percentile, summarize
from qwenserve.loadgen.targets import HttpTarget, LoadRequest
from qwenserve.loadgen.workload import RequestSpec

CHECKPOINT_NAME = "qwen3-0.6b-random-bf16-v1"
# Token ids drawn for prompts: the ordinary tokens of the Qwen vocabulary (the special ones start here).
FIRST_SPECIAL_TOKEN = 151643
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
TCMALLOC = "libtcmalloc_minimal.so.4"


@dataclass(frozen=True, slots=True)
class Plan:
    """The workloads' sizes; `quick` shrinks them for a smoke run."""

    burst_requests: int = 32
    burst_prompt: tuple[int, int] = (64, 512)
    burst_output: tuple[int, int] = (32, 256)
    stream_requests: int = 3
    stream_prompt: int = 128
    stream_output: int = 128
    long_requests: int = 3
    long_prompt: int = 2000
    long_output: int = 4
    warmup_requests: int = 4
    max_model_len: int = 4096


QUICK = Plan(burst_requests=8, burst_prompt=(64, 256), burst_output=(16, 64), stream_requests=2, stream_output=32,
             long_requests=1, warmup_requests=2)

# (key, label, unit, better): the figures each server gets per round, in the table's order.
MEASURES = (
    ("burst_tok_s", "{p.burst_requests} at once ({p.burst_prompt[0]}-{p.burst_prompt[1]} in, {p.burst_output[0]}-"
     "{p.burst_output[1]} out): output tok/s", "tok/s", "higher"),
    ("burst_itl_p50_ms", "{p.burst_requests} at once: ITL p50", "ms", "lower"),
    ("stream_itl_p50_ms", "one stream, {p.stream_prompt} in / {p.stream_output} out: ITL p50", "ms", "lower"),
    ("stream_ttft_p50_ms", "one stream: TTFT p50 of a {p.stream_prompt}-token prompt", "ms", "lower"),
    ("long_ttft_p50_s", "a {p.long_prompt:,}-token prompt: TTFT p50", "s", "lower"),
    ("start_to_ready_s", "start to ready", "s", "lower"),
)
# The targets for ours/vLLM (issue 29), shown beside the ratios.
TARGETS = {"burst_tok_s": ">= 1.3", "stream_itl_p50_ms": "<= 0.8", "long_ttft_p50_s": "<= 1.0",
           "start_to_ready_s": "<= 0.25"}


# ---- workloads ----------------------------------------------------------------------------------------------


def token_prompt(rng: random.Random, n: int) -> Prompt:
    return Prompt("", [rng.randrange(FIRST_SPECIAL_TOKEN) for _ in range(n)])


def workloads(plan: Plan, seed: int) -> dict[str, list[tuple[Prompt, int]]]:
    """Every workload's (prompt, max_tokens) list, the same for the same seed; no two prompts share a prefix."""
    rng = random.Random(seed)

    def fixed(count: int, prompt: int, output: int) -> list[tuple[Prompt, int]]:
        return [(token_prompt(rng, prompt), output) for _ in range(count)]

    return {
        "warmup": [(token_prompt(rng, rng.randint(64, 256)), 16) for _ in range(plan.warmup_requests)],
        "burst": [(token_prompt(rng, rng.randint(*plan.burst_prompt)), rng.randint(*plan.burst_output))
                  for _ in range(plan.burst_requests)],
        "stream": fixed(plan.stream_requests, plan.stream_prompt, plan.stream_output),
        "long": fixed(plan.long_requests, plan.long_prompt, plan.long_output),
    }


WORKLOADS = ("burst", "stream", "long")


def load_requests(name: str, items: list[tuple[Prompt, int]], tag: str) -> list[LoadRequest]:
    return [LoadRequest(f"peer-{tag}-{name}-{i}", RequestSpec(i, len(p.token_ids), out, name, arrival_s=0.0), p)
            for i, (p, out) in enumerate(items)]


class TokenIdTarget(HttpTarget):
    """The OpenAI completions API with the prompt sent as token ids (no tokenizer in the measurement)."""

    def _body(self, req: LoadRequest) -> dict[str, Any]:
        return {**super()._body(req), "prompt": list(req.prompt.token_ids)}


# ---- servers ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one server configuration; "{port}" and "{grpc_port}" in argv are filled at each start."""

    name: str
    dtype: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 300.0


# Our configurations: the name's dtype, and `up`'s own flags (unified: no prefill process, the decode worker prefills
# its prompts itself, one engine as vLLM's; w4a16: per-stage precision, the decode processes on the checkpoint's AWQ
# 4-bit copy behind a prefill on the checkpoint itself; w4a16-head8: and the LM head as 8-bit codes, --quantize-lm-head).
OURS = {"ours-fp32": ("float32", ()), "ours-auto": ("auto", ()), "ours-unified": ("auto", ("--prefill", "0")),
        "ours-w4a16": ("auto", ("--decode-model", "{awq}")),
        "ours-w4a16-head8": ("auto", ("--decode-model", "{awq}", "--quantize-lm-head", "int8"))}


def ours_spec(model: Path, name: str, kv_gb: float, max_len: int) -> ServerSpec:
    dtype, flags = OURS[name]
    exe = Path(sys.executable).with_name("qwen-serve")
    cmd = (str(exe),) if exe.exists() else (sys.executable, "-m", "qwenserve.cli")
    if "{awq}" in flags:
        flags = tuple(str(awq_copy(model)) if f == "{awq}" else f for f in flags)
    argv = (*cmd, "up", str(model), "--http-port", "{port}", "--grpc-port", "{grpc_port}", "--dtype", dtype,
            "--kv-cache-gb", f"{kv_gb:g}", "--max-model-len", str(max_len), *flags)
    return ServerSpec(name, dtype, argv)


def vllm_preload(venv: Path) -> tuple[list[str], list[str]]:
    """LD_PRELOAD's libraries (Debian's tcmalloc, the venv's Intel OpenMP) and what was not found."""
    found, missing = [], []
    tcmalloc = next((p for p in (Path("/usr/lib/x86_64-linux-gnu") / TCMALLOC, Path("/usr/lib64") / TCMALLOC)
                     if p.exists()), None)
    (found if tcmalloc else missing).append(str(tcmalloc or TCMALLOC))
    iomp = next(iter(sorted(venv.glob("lib/**/libiomp5.so"))), None)
    (found if iomp else missing).append(str(iomp or "libiomp5.so"))
    return found, missing


def vllm_spec(venv: Path, model: Path, kv_gb: float, max_len: int, omp_bind: str, preload: list[str]) -> ServerSpec:
    argv = (str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", str(max_len))
    env = {"VLLM_CPU_OMP_THREADS_BIND": omp_bind, "VLLM_CPU_KVCACHE_SPACE": f"{kv_gb:g}",
           "LD_PRELOAD": ":".join(preload), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    return ServerSpec("vllm", "bfloat16", argv, env, ready_timeout_s=900.0)


def vllm_version(venv: Path) -> tuple[str | None, str | None]:
    """(vLLM's version in `venv`, None), or (None, why it cannot be imported there)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"{python} does not exist"
    probe = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode != 0:
        return None, "import vllm failed: " + " | ".join(probe.stderr.strip().splitlines()[-3:])
    return probe.stdout.strip().splitlines()[-1], None


def proc_stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (field 3, the state, first), or None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def session_pids(sid: int) -> list[int]:
    """Every live (not zombie) process of session `sid`: a server and all it started."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (f := proc_stat_fields(entry)) is not None and int(f[3]) == sid and f[0] != "Z":
            pids.append(int(entry))
    return pids


def session_cpu_s(sid: int) -> float:
    """CPU seconds of a session's processes, with the children they have reaped (utime+stime+cutime+cstime)."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (f := proc_stat_fields(entry)) is not None and int(f[3]) == sid:
            total += sum(int(x) for x in f[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat's first line."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def own_cpu_s() -> float:
    f = proc_stat_fields("self")
    return sum(int(x) for x in f[11:13]) / os.sysconf("SC_CLK_TCK") if f else 0.0


class ServerProcess:
    """One running server in a session of its own, its output in `log`; stop() ends the whole session."""

    running: list[ServerProcess] = []

    def __init__(self, spec: ServerSpec, log: Path) -> None:
        self.spec, self.log = spec, log
        self.port = free_port()
        grpc_port = free_port()
        argv = [a.format(port=self.port, grpc_port=grpc_port) for a in spec.argv]
        self.cpu_before, self.own_before = machine_cpu_s(), own_cpu_s()
        self.started = time.monotonic()
        with open(log, "wb") as out:
            self.process = subprocess.Popen(argv, env={**os.environ, **spec.env}, stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        ServerProcess.running.append(self)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def died(self) -> str | None:
        if self.process.poll() is None:
            return None
        tail = self.log.read_text(errors="replace").strip().splitlines()[-8:]
        return f"{self.spec.name} exited with {self.process.returncode}: " + " | ".join(tail)

    def close_window(self) -> dict[str, float]:
        """The CPU accounting of this server's window, from its start to now (call just before stop())."""
        busy, steal = machine_cpu_s()
        wall = time.monotonic() - self.started
        server = session_cpu_s(self.process.pid)
        own = own_cpu_s() - self.own_before
        other = busy - self.cpu_before[0] - server - own
        cores = len(os.sched_getaffinity(0))
        return {"wall_s": wall, "server_cpu_s": server, "bench_cpu_s": own, "other_cpu_s": other,
                "other_pct_of_cores": 100 * other / (wall * cores), "steal_s": steal - self.cpu_before[1]}

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the leader (it stops its own children in order), then SIGKILL whatever of the session is left."""
        sid = self.process.pid
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.process.poll() is None or session_pids(sid)):
            time.sleep(0.2)
        for pid in session_pids(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self in ServerProcess.running:
            ServerProcess.running.remove(self)


async def wait_ready(server: ServerProcess, session: aiohttp.ClientSession) -> tuple[float, str]:
    """Seconds from the server's spawn to its first successful completion, and the served model's name."""
    deadline = server.started + server.spec.ready_timeout_s
    body = {"prompt": [9707, 11, 1879], "max_tokens": 1, "temperature": 0.0}
    while time.monotonic() < deadline:
        if (how := server.died()) is not None:
            raise RuntimeError(how)
        try:
            async with session.get(f"{server.url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                model = (await resp.json())["data"][0]["id"] if resp.status == 200 else None
            if model is not None:
                async with session.post(f"{server.url}/v1/completions", json={**body, "model": model},
                                        timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    if resp.status == 200:
                        await resp.read()
                        return time.monotonic() - server.started, model
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, KeyError, IndexError):
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.spec.name} did not answer a completion within {server.spec.ready_timeout_s:g} s "
                       f"(log: {server.log})")


def logged_precision(spec: ServerSpec, log: Path) -> str:
    """What dtype the server says it runs: ours' engines' `precision:` lines (else `engine: ... on cpu/X`), vLLM's
    `dtype=torch.X`; the flag where the log says nothing."""
    text = log.read_text(errors="replace")
    found = re.findall(r"precision: ([^(\n]*?)\s*(?:\(|$)", text, re.M) or re.findall(r"engine: \S+ on (\S+?),", text)
    found = found or re.findall(r"dtype=torch\.(\w+)", text)
    return " / ".join(dict.fromkeys(found)) or f"--dtype {spec.dtype}"


# ---- one server's run ---------------------------------------------------------------------------------------


async def run_workload(url: str, model: str, requests: list[LoadRequest], at_once: bool,
                       timeout_s: float) -> list[RequestRecord]:
    """All `requests` at once (open loop, arrival 0) or one after another; bounded by count and `timeout_s`."""
    target = TokenIdTarget(url, model=model, timeout_s=timeout_s)
    await target.start()
    stop = asyncio.Event()
    bounds = Bounds(num_requests=len(requests), request_timeout_s=timeout_s)
    try:
        async with asyncio.timeout(timeout_s + 30):
            if at_once:
                result = await run_open_loop(target, requests, bounds, stop, LiveCounters())
            else:
                result = await run_closed_loop(target, lambda i: requests[i], 1, bounds, stop, LiveCounters())
    finally:
        await target.close()
    return result.records


def errors_of(name: str, records: list[RequestRecord]) -> list[str]:
    return [f"{name}[{r.index}]: {r.error} {r.error_message[:200]}" for r in records if not r.ok]


async def run_server(spec: ServerSpec, loads: dict[str, list[tuple[Prompt, int]]], tag: str, log: Path,
                     timeout_s: float, only: tuple[str, ...] = WORKLOADS) -> dict[str, Any]:
    """Start `spec`, wait for it, warm it up, run the workloads (`only` those named), stop it; its figures and CPU
    window."""
    out: dict[str, Any] = {"log": str(log), "errors": [], "phase_s": {}}
    server = ServerProcess(spec, log)
    try:
        async with aiohttp.ClientSession() as session:
            ready_s, model = await wait_ready(server, session)
        out["start_to_ready_s"] = ready_s
        print(f"    {spec.name}: ready after {ready_s:.1f} s", flush=True)
        for name, at_once in (("warmup", True), ("burst", True), ("stream", False), ("long", False)):
            if name != "warmup" and name not in only:
                continue
            t = time.monotonic()
            records = await run_workload(server.url, model, load_requests(name, loads[name], tag), at_once, timeout_s)
            out["phase_s"][name] = time.monotonic() - t
            out["errors"] += errors_of(name, records)
            if (how := server.died()) is not None:
                raise RuntimeError(how)
            s = summarize(records)
            if name == "burst":
                out["burst_tok_s"], out["burst_itl_p50_ms"] = s.output_throughput, s.itl_ms.p50
            elif name == "stream":
                out["stream_itl_p50_ms"], out["stream_ttft_p50_ms"] = s.itl_ms.p50, s.ttft_ms.p50
            elif name == "long":
                out["long_ttft_p50_s"] = s.ttft_ms.p50 / 1000
            print(f"    {spec.name}: {name} done in {out['phase_s'][name]:.1f} s ({s.successes}/{s.requests} ok)",
                  flush=True)
    finally:
        out["cpu"] = server.close_window()
        server.stop()
        out["precision"] = logged_precision(spec, log)
    return out


# ---- summary ------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float] | None:
    """Median, min and max of the rounds' values (NaNs left out), None when there are none."""
    values = [v for v in values if v == v]
    if not values:
        return None
    return {"median": percentile(values, 50), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict[str, float] | None, digits: int) -> str:
    if s is None:
        return "—"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def summary(rounds: list[dict[str, Any]], servers: list[str], baseline: str | None) -> dict[str, Any]:
    """Per measure: each server's spread over the rounds, and each other server's ratio to `baseline` per round."""
    table: dict[str, Any] = {}
    for key, *_ in MEASURES:
        row: dict[str, Any] = {"servers": {}, "ratios": {}}
        for name in servers:
            row["servers"][name] = spread([r["servers"][name].get(key, float("nan"))
                                           for r in rounds if name in r["servers"]])
            if baseline and name != baseline:
                ratios = [r["servers"][name].get(key, float("nan")) / r["servers"][baseline][key]
                          for r in rounds if name in r["servers"] and r["servers"].get(baseline, {}).get(key)]
                row["ratios"][f"{name}/{baseline}"] = spread(ratios)
        table[key] = row
    return table


def markdown(plan: Plan, table: dict[str, Any], servers: list[str], dtypes: dict[str, str], baseline: str | None,
             header: list[str]) -> str:
    ratio_names = [f"{n}/{baseline}" for n in servers if baseline and n != baseline]
    cols = [f"{n} ({dtypes.get(n, '?')})" for n in servers] + ratio_names
    with_targets = baseline == "vllm"
    lines = [*header, "", "| measure | " + " | ".join(cols) + (" | target ours/vLLM |" if with_targets else " |"),
             "|---" * (len(cols) + 1 + with_targets) + "|"]
    for key, label, unit, better in MEASURES:
        digits = 2 if unit == "s" else 1
        cells = [fmt(table[key]["servers"][n], digits) for n in servers]
        cells += [fmt(table[key]["ratios"][r], 2) for r in ratio_names]
        target = f" | {TARGETS.get(key, '')}" if with_targets else ""
        lines.append(f"| {label.format(p=plan)} ({unit}, {better} is better) | " + " | ".join(cells)
                     + target + " |")
    return "\n".join(lines)


def cpu_table(rounds: list[dict[str, Any]]) -> list[str]:
    lines = ["", "| round | order | other processes' CPU while each server ran (core-s, % of the cores) | steal (s) |",
             "|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        per = [f"{n} {s['cpu']['other_cpu_s']:.1f} ({s['cpu']['other_pct_of_cores']:.1f}%) in {s['cpu']['wall_s']:.0f} s"
               for n, s in r["servers"].items() if "cpu" in s]
        steal = sum(s["cpu"]["steal_s"] for s in r["servers"].values() if "cpu" in s)
        lines.append(f"| {i} | {' '.join(r['order'])} | {'; '.join(per)} | {steal:.1f} |")
    return lines


# ---- the run ------------------------------------------------------------------------------------------------


def cpu_description() -> tuple[str, dict[str, bool]]:
    model, flags = "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, {f: f in flags for f in CPU_FLAGS}


def awq_copy(model: Path) -> Path:
    """`model`'s decoder linears in AWQ 4-bit, groups of 128 (round to nearest, the format of Qwen's AWQ checkpoints;
    tests/support/quantized_checkpoints.py writes it), made once beside it."""
    target = model.parent / f"{model.name}-awq"
    if (target / "model.safetensors").is_file():
        return target
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, where tests/ lives
    from tests.support.quantized_checkpoints import quantize_checkpoint

    staging = Path(tempfile.mkdtemp(dir=model.parent, prefix=f".{target.name}."))
    shutil.rmtree(staging)
    try:
        print(f"writing {target} (AWQ 4-bit, groups of 128) ...", flush=True)
        quantize_checkpoint(model, staging, "awq", group_size=128)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_checkpoint(model: Path | None) -> Path:
    """--model, else the random Qwen3-0.6B-shaped bf16 checkpoint with the real vocabulary, written once."""
    if model is not None:
        return model
    target = cache_root() / "models" / CHECKPOINT_NAME
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        print(f"writing {target} (Qwen3-0.6B shape, bf16, random weights) ...", flush=True)
        write_checkpoint(staging, QWEN3_0_6B_CONFIG, dtype="bfloat16")
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


async def bench(args: argparse.Namespace, plan: Plan, specs: list[ServerSpec],
                log_dir: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every round's figures per server, and the servers that could not run with why (left out after failing)."""
    loads = workloads(plan, args.seed)
    rounds: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for r in range(args.rounds):
        order = [s for s in (specs if r % 2 == 0 else specs[::-1]) if s.name not in failed]
        print(f"round {r + 1}/{args.rounds}: {' '.join(s.name for s in order)}", flush=True)
        result: dict[str, Any] = {"order": [s.name for s in order], "servers": {}}
        for spec in order:
            log = log_dir / f"round{r + 1}-{spec.name}.log"
            try:
                result["servers"][spec.name] = await run_server(spec, loads, f"r{r + 1}-{spec.name}", log,
                                                                args.request_timeout_s, args.workloads)
            except (RuntimeError, TimeoutError) as e:
                failed[spec.name] = str(e) or f"a workload ran past {args.request_timeout_s + 30:g} s"
                print(f"    {spec.name} FAILED, left out from now on: {e}", flush=True)
        rounds.append(result)
    return rounds, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-venv", type=Path, required=True, help="virtual environment holding vLLM's CPU build")
    parser.add_argument("--rounds", type=int, default=None, help="rounds in alternating order (default 3; --quick 1)")
    parser.add_argument("--model", type=Path, default=None,
                        help=f"checkpoint (default: a random Qwen3-0.6B-shaped bf16 one, ~/.cache/qwen-serve/models/"
                             f"{CHECKPOINT_NAME})")
    parser.add_argument("--servers", default="ours-fp32,ours-auto,vllm",
                        help=f"which of {','.join(OURS)},vllm (ours-unified: `up --prefill 0`; ours-w4a16: "
                             "`up --decode-model` of the checkpoint's AWQ copy; ours-w4a16-head8: and "
                             "--quantize-lm-head int8)")
    parser.add_argument("--kv-cache-gb", type=float, default=4.0,
                        help="KV-cache memory of every server (ours: per engine; vLLM: VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--vllm-omp-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND (default: 0-<cores-1> of this process's CPUs)")
    parser.add_argument("--quick", action="store_true", help="smoke run: one round, fewer and shorter requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"which of {','.join(WORKLOADS)} to run after the warm-up (default: all; the others' "
                             "rows stay empty)")
    parser.add_argument("--request-timeout-s", type=float, default=900.0, help="bound on one workload's requests")
    parser.add_argument("--log-dir", type=Path, default=None, help="servers' logs (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    plan = QUICK if args.quick else Plan()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"--workloads: unknown {', '.join(sorted(unknown))} (known: {', '.join(WORKLOADS)})")
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="peer-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    cpu_model, flags = cpu_description()
    cores = sorted(os.sched_getaffinity(0))
    notes: list[str] = []
    model = ensure_checkpoint(args.model)
    specs = [ours_spec(model, n, args.kv_cache_gb, plan.max_model_len) for n in wanted if n in OURS]
    version, problem = vllm_version(args.vllm_venv) if "vllm" in wanted else (None, None)
    if "vllm" in wanted:
        if problem is None:
            preload, missing = vllm_preload(args.vllm_venv)
            if missing:
                notes.append(f"vLLM runs without LD_PRELOAD of {', '.join(missing)} (not found)")
            specs.append(vllm_spec(args.vllm_venv, model, args.kv_cache_gb, plan.max_model_len,
                                   args.vllm_omp_bind or f"{cores[0]}-{cores[-1]}", preload))
        else:
            notes.append(f"vLLM could not run: {problem}")

    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        rounds, failed = asyncio.run(bench(args, plan, specs, log_dir))
    except KeyboardInterrupt:
        print("interrupted: every server started was stopped", file=sys.stderr)
        sys.exit(130)
    finally:
        for server in list(ServerProcess.running):
            server.stop(grace_s=5)
        signal.signal(signal.SIGTERM, previous)
    wall = time.monotonic() - started

    names = [s.name for s in specs if any(s.name in r["servers"] for r in rounds)]
    for name, why in failed.items():
        notes.append(f"{name} could not run: {why}")
    baseline = "vllm" if "vllm" in names else ("ours-fp32" if "ours-fp32" in names else None)
    if baseline == "ours-fp32" and "vllm" in wanted:
        notes.append("vLLM did not run: ratios are against ours at fp32")
    dtypes = {s.name: s.dtype for s in specs}
    precision = {n: " | ".join(dict.fromkeys(r["servers"][n]["precision"] for r in rounds if n in r["servers"]))
                 for n in names}
    errors = [e for r in rounds for s in r["servers"].values() for e in s["errors"]]
    table = summary(rounds, names, baseline)
    header = [
        f"peer_bench {'--quick ' if args.quick else ''}{time.strftime('%Y-%m-%d')}: {args.rounds} round(s), "
        f"{wall / 60:.1f} min; CPU {cpu_model}, {len(cores)} cores, "
        + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in flags.items()),
        f"checkpoint {model} (Qwen3-0.6B shape, random bf16 weights); KV cache {args.kv_cache_gb:g} GB per engine; "
        f"max_model_len {plan.max_model_len}; median over rounds (min–max); ratios per round",
        *[f"{n}: {precision[n]}" for n in names],
        *([f"vLLM {version} (CPU build)"] if version else []),
        *notes,
        *([f"{len(errors)} failed requests, first: {errors[0]}"] if errors else []),
    ]
    text = markdown(plan, table, names, dtypes, baseline, header) + "\n" + "\n".join(cpu_table(rounds))
    print("\n" + text)
    print(f"\nserver logs: {log_dir}")
    if args.json:
        doc = {"plan": asdict(plan), "cpu": {"model": cpu_model, "flags": flags, "cores": len(cores)},
               "vllm_version": version,
               "servers": {s.name: {"dtype": s.dtype, "precision": precision.get(s.name), "argv": list(s.argv),
                                    "env": s.env} for s in specs},
               "rounds": rounds, "summary": table, "notes": notes, "errors": errors, "wall_s": wall,
               "markdown": text}
        write_json(args.json, doc)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
