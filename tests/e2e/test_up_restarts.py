"""`qwen-serve up` supervises its stages as a kubelet would: a stage killed with SIGKILL under load is restarted on
its ports after a backoff (the log says which, why and when), every request meanwhile gets exactly one terminal
answer (a success or an error the client may retry, never a hang), the stage serves again and shows its restart
count on /metrics; a stage that keeps failing at start stops `up` with one line naming it."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from qwenserve.router.openai_errors import RETRYABLE_CODES
from qwenserve.status import parse_gauges
from tests.support.answers import CUT, Answer, http_post
from tests.support.checkpoints import tiny_checkpoint
from tests.support.clusters import WORKER_ENV
from tests.support.ports import free_port

MODEL_NAME = "restart-model"
BACKOFF_S = 0.5
# A request's bound, start to terminal answer: a kill noticed, then a few tokens on a busy two-core machine.
BOUND_S = 60.0
# How long a killed stage may take to serve again: the backoff, then a start (imports, model load, warm-up).
BACK_WITHIN_S = 120.0
CLIENTS = 3
RESTARTS = "qwenserve_stage_restarts"


@dataclass
class Up:
    """A running `qwen-serve up`: its process, the lines of its stdout after `ready`, its stderr file."""

    process: subprocess.Popen[str]
    http_port: int
    grpc_port: int
    metrics: dict[str, str]  # child name -> its metrics host:port
    stderr_path: Path

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stage_pid(self, stage: str) -> int:
        """The pid of `up`'s child that serves `stage` (tokenizer, prefill, decode)."""
        pids = [int(p) for task in os.listdir(f"/proc/{self.process.pid}/task")
                for p in _read(Path(f"/proc/{self.process.pid}/task/{task}/children")).split()]
        found = [pid for pid in pids if f"serve\0{stage}\0" in _cmdline(pid)]
        assert len(found) == 1, (stage, found)
        return found[0]

    def wait_log(self, text: str, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while text not in self.log():
            assert self.process.poll() is None, f"up exited ({self.process.returncode}): {self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in up's log within {within_s:g} s: {self.log()[-3000:]}"
            time.sleep(0.2)


def _read(path: Path) -> str:
    """A /proc file's text, "" where its task or process is gone (one of up's threads may end while we look)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def restart_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of this module's own (the crash-loop test moves its folder away)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("restart-model") / MODEL_NAME, seed=5)


@pytest.fixture(scope="module")
def up(restart_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`qwen-serve up` of the tiny model, one prefill and one decode, every prompt handed from one to the other, a
    short restart backoff."""
    tmp = tmp_path_factory.mktemp("up-restarts")
    http_port, grpc_port = free_port(), free_port()
    stderr_path = tmp / "up.stderr"
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "qwenserve.cli", "up", str(restart_model), "--port", str(http_port),
             "--grpc-port", str(grpc_port), "--log-dir", str(tmp / "logs"), "--restart-backoff-s", str(BACKOFF_S),
             "--local-prefill-threshold", "0"],  # every prompt through prefill: its restarts are the subject
            stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, **WORKER_ENV, "QWENSERVE_PROGRESS": "off", "QWENSERVE_DTYPE": "auto"},
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or ()], daemon=True).start()
    try:
        first = lines.get(timeout=240)
        assert "ready" in first, first + stderr_path.read_text()
        metrics = {}
        for _ in range(4):  # one line per service: name, gRPC address, metrics URL
            name, _grpc, url = lines.get(timeout=10).split()
            metrics[name] = url.removeprefix("metrics=http://").removesuffix("/metrics")
        yield Up(process, http_port, grpc_port, metrics, stderr_path)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(60)


async def _request(session: aiohttp.ClientSession, up: Up, n: int) -> Answer:
    body = {"model": MODEL_NAME, "max_tokens": 8, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"Request {n}: tell me about restarts"}]}
    return await http_post(session, f"{up.http_base}/v1/chat/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"}, BOUND_S)


async def _load(up: Up, stop: asyncio.Event, answers: list[Answer]) -> None:
    """CLIENTS clients sending streamed chats back to back until `stop`; a client pauses after an error."""
    async with aiohttp.ClientSession() as session:
        async def client(index: int) -> None:
            n = 0
            while not stop.is_set():
                answer = await _request(session, up, index * 10_000 + n)
                answers.append(answer)
                n += 1
                if not answer.succeeded:
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(client(i) for i in range(CLIENTS)))


async def _serves_again(up: Up, within_s: float = 30.0) -> Answer:
    """The first successful answer within `within_s` (the router reconnects to a restarted stage within a
    second or two), else the last failure."""
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while True:
            answer = await _request(session, up, -1)
            if answer.succeeded or time.monotonic() > deadline:
                return answer
            await asyncio.sleep(0.5)


def _restarts_shown(up: Up, name: str) -> float:
    with urllib.request.urlopen(f"http://{up.metrics[name]}/metrics", timeout=5) as reply:
        return parse_gauges(reply.read().decode(), [RESTARTS]).get(RESTARTS, -1.0)


def _retryable(answer: Answer) -> bool:
    """An error a client may retry: a 503 (or 429) before the stream began, or, once it began, an error event whose
    code says "try again" (no_decode_worker while the only decode worker restarts); never a 500 or a 4xx."""
    if answer.http_status in (429, 503):
        return answer.clean_error
    return answer.http_status == 200 and answer.clean_error and answer.error_code in RETRYABLE_CODES


def test_up_with_dtype_auto_says_which_precision_it_chose(up: Up) -> None:
    """The default `qwen-serve up MODEL` is `--dtype auto`: on a CPU with the C kernels each engine stage keeps a
    bf16 KV cache and computes in bf16 where its start-up probe found the bf16 weights faster, in fp32 over fp32
    weights where not; the stage's log says which and why, its metrics and `qwen-serve status` show it, and prefill
    and decode agree on the KV (their handoffs are accepted: the requests above and below are served)."""
    status = subprocess.run([sys.executable, "-m", "qwenserve.cli", "status", "--router", f"127.0.0.1:{up.grpc_port}",
                             "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    shown = {row["stage"]: row["precision"] for row in json.loads(status.stdout)}
    assert shown["router"] == shown["tokenizer"] == "", shown
    for stage in ("prefill", "decode"):
        assert (shown[stage].startswith("bfloat16")
                or shown[stage] == "weights=float32 kv=bfloat16 activations=float32"), shown
    for name in ("prefill-0", "decode-0"):
        with urllib.request.urlopen(f"http://{up.metrics[name]}/metrics", timeout=5) as reply:
            info = [line for line in reply.read().decode().splitlines()
                    if line.startswith("qwenserve_engine_precision_info{")]
        assert len(info) == 1 and 'kv="bfloat16"' in info[0] and "bf16 attention kernel" in info[0], info
    logs = "".join(path.read_text() for path in (up.stderr_path.parent / "logs").glob("*decode*"))
    chose = [line for line in logs.splitlines() if "precision: " in line and "(" in line]
    assert chose and "KV bfloat16" in chose[0] and ("panels decode" in chose[0]), logs[-2000:]


async def test_a_killed_stage_is_restarted_on_its_port_and_serves_while_every_request_gets_one_answer(
    up: Up,
) -> None:
    answers: list[Answer] = []
    stop = asyncio.Event()
    load = asyncio.create_task(_load(up, stop, answers))
    try:
        await asyncio.sleep(2.0)
        for stage, name in (("decode", "decode-0"), ("prefill", "prefill-0"), ("tokenizer", "tokenizer")):
            killed = up.stage_pid(stage)
            os.kill(killed, signal.SIGKILL)
            await asyncio.to_thread(up.wait_log, f"{name} was killed by SIGKILL", 10.0)
            await asyncio.to_thread(up.wait_log, f"restarted {name} on ", 30.0)  # 0.5 s backoff; loaded: seconds
            await asyncio.to_thread(up.wait_log, f"{name} is serving again (restart 1", BACK_WITHIN_S)
            assert up.stage_pid(stage) != killed
            after = await _serves_again(up)
            assert after.succeeded, f"after {name}'s restart: {after.describe()}"
            assert _restarts_shown(up, name) == 1.0
        # The router last: the connections of its clients break with it (a client's only possible answer from a
        # killed process), and up restarts it on its ports like any other stage.
        killed, cut_from = up.stage_pid("router"), len(answers)
        os.kill(killed, signal.SIGKILL)
        await asyncio.to_thread(up.wait_log, "router was killed by SIGKILL", 10.0)
        await asyncio.to_thread(up.wait_log, "router is serving again (restart 1", BACK_WITHIN_S)
        cut_until = len(answers) + CLIENTS  # the requests sent before it served again end by now or soon after
        after = await _serves_again(up)
        assert after.succeeded, f"after the router's restart: {after.describe()}"
        assert _restarts_shown(up, "router") == 1.0
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await load
    log = up.log()
    for name in ("decode-0", "prefill-0", "tokenizer", "router"):  # which, why and when
        said = [line for line in log.splitlines() if line.startswith(f"qwen-serve up: {name} was killed by SIGKILL")]
        assert len(said) == 1 and "; restarting it on 127.0.0.1:" in said[0], log
        assert said[0].endswith(f" in {BACKOFF_S:.1f} s (restart 1)"), said[0]
    broken = [a.describe() for i, a in enumerate(answers)
              if not (a.succeeded or _retryable(a) or (cut_from <= i < cut_until and a.status == CUT))]
    kinds = Counter("ok" if a.succeeded else f"{a.status} {a.error_code}" for a in answers)
    assert not broken, f"{len(broken)} of {len(answers)} answers broke the rules ({dict(kinds)}): {broken[:5]}"
    assert kinds["ok"] > 0, dict(kinds)
    assert up.process.poll() is None, "up stopped after a stage was killed"
    status = subprocess.run([sys.executable, "-m", "qwenserve.cli", "status", "--router", f"127.0.0.1:{up.grpc_port}",
                             "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    shown = {row["stage"]: row["restarts"] for row in json.loads(status.stdout)}
    assert shown == {"router": 1, "tokenizer": 1, "prefill": 1, "decode": 1}, status.stdout


def test_a_stage_that_keeps_failing_at_start_stops_up_with_one_line_naming_it(up: Up, restart_model: Path) -> None:
    moved = restart_model.with_name(MODEL_NAME + "-moved")
    restart_model.rename(moved)  # the stages already running hold what they loaded; a new one cannot start
    try:
        pids = [up.stage_pid(stage) for stage in ("tokenizer", "prefill", "decode", "router")]
        os.kill(pids[0], signal.SIGKILL)
        code = up.process.wait(BACK_WITHIN_S)
    finally:
        moved.rename(restart_model)
    assert code == 1, up.log()[-3000:]
    stopping = [line for line in up.log().splitlines() if "failed to start 3 times in a row" in line]
    assert len(stopping) == 1 and stopping[0].startswith("qwen-serve up: tokenizer "), up.log()[-3000:]
    assert MODEL_NAME in stopping[0], stopping[0]  # its last lines say what is wrong
    assert all(not _cmdline(pid) for pid in pids[1:]), "up left stages running"
