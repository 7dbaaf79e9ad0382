"""Several models behind one router: routing by `model`, tenants' allowed models, a canary share, and a fallback
that takes a model's requests while its decode workers are gone and gives them back when they return.

Two deployments run as local clusters (different checkpoints): "qwen-main" (tokenizer, prefill, decode) and
"qwen-backup" (tokenizer + decode); a third router serves both (and "qwen-main-next", a canary of qwen-main on
the backup's stages) from a models file, as `qwen-serve serve router --models-file` does in a pod.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from qwenserve.default_model import write_checkpoint
from qwenserve.launcher import LocalCluster
from qwenserve.router.models import canary_share
from tests.support.checkpoints import TINY
from tests.support.clusters import make_cluster
from tests.support.ports import free_port

KEYS = {"tenants": {"anyone": None, "limited": {"models": ["qwen-backup"]}},
        "keys": [{"tenant": "anyone", "key": "sk-anyone"}, {"tenant": "limited", "key": "sk-limited"}]}


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LocalCluster]]:
    root = tmp_path_factory.mktemp("multi")
    clusters = {}
    try:
        # The primary hands off from prefill: a request's first token is computed before its decode call starts.
        for name, seed, prefill in (("main", 41, 1), ("backup", 43, 0)):
            model = write_checkpoint(root / f"qwen3-{name}", TINY, seed=seed)
            cluster = make_cluster(model, root / name, prefill=prefill, decode=1)
            cluster.start()
            clusters[name] = cluster
        yield clusters
    finally:
        for cluster in clusters.values():
            cluster.stop()


@pytest.fixture(scope="module")
def router(deployments: dict[str, LocalCluster], tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The router over both deployments; returns its HTTP port."""
    root = tmp_path_factory.mktemp("multi-router")

    def entry(name: str, cluster: LocalCluster, **more: object) -> dict:
        return {"name": name, "model": str(cluster.model), "tokenizer": cluster.child("tokenizer").address,
                "decode": [cluster.child("decode-0").address], **more}

    main, backup = deployments["main"], deployments["backup"]
    models = {"models": [entry("qwen-main", main, fallback="qwen-backup", prefill=[main.child("prefill-0").address],
                               canary={"model": "qwen-main-next", "percent": 10}),
                         entry("qwen-backup", backup), entry("qwen-main-next", backup)]}
    (root / "models.yaml").write_text(yaml.safe_dump(models))
    (root / "keys.json").write_text(json.dumps(KEYS))
    port = free_port()
    log = open(root / "router.log", "ab")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "qwenserve.cli", "serve", "router", "--models-file", str(root / "models.yaml"),
         "--port", str(free_port()), "--http-port", str(port), "--api-keys-file", str(root / "keys.json")],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while _models(port, "sk-anyone") is None:
            assert process.poll() is None and time.monotonic() < deadline, (root / "router.log").read_text()[-3000:]
            time.sleep(0.3)
        yield port
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _post(port: int, key: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _models(port: int, key: str) -> list[str] | None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return [m["id"] for m in json.loads(response.read())["data"]]
    except (urllib.error.URLError, ConnectionError):
        return None


def _complete(port: int, model: str, user: str = "u", key: str = "sk-anyone") -> tuple[int, dict]:
    return _post(port, key, {"model": model, "prompt": "The sea is", "max_tokens": 4, "temperature": 0,
                             "user": user})


def test_requests_go_to_the_model_they_name_and_tenants_only_see_theirs(router: int) -> None:
    assert _models(router, "sk-anyone") == ["qwen-main", "qwen-backup", "qwen-main-next"]
    assert _models(router, "sk-limited") == ["qwen-backup"]
    texts = {}
    for model in ("qwen-main", "qwen-backup"):
        status, body = _complete(router, model, user="user-outside-the-canary")
        assert status == 200 and body["model"] in (model, "qwen-main-next"), body
        texts[model] = body["choices"][0]["text"]
    assert texts["qwen-main"] != texts["qwen-backup"]  # two checkpoints: two answers
    status, body = _complete(router, "qwen-main", key="sk-limited")
    assert status == 403 and body["error"]["code"] == "model_not_allowed", body
    status, body = _complete(router, "qwen-nope")
    assert status == 404 and body["error"]["param"] == "model", body


def test_a_ten_percent_canary_takes_ten_percent_of_a_thousand_users(router: int) -> None:
    # The split is the hash's: a thousand users' shares put ten percent on the canary (a pure function; no
    # request needed), and the router sends each user where its share puts it, and again on the next request
    # (checked through the cluster for the first 200, some 20 of them on the canary).
    users = [f"user-{i}" for i in range(1000)]
    on_canary = {user: canary_share(user, "qwen-main") < 10 for user in users}
    assert 50 <= sum(on_canary.values()) <= 150
    asked = users[:200]
    with ThreadPoolExecutor(8) as pool:
        answered = list(pool.map(lambda u: _complete(router, "qwen-main", user=u), asked))
    assert all(status == 200 for status, _ in answered)
    counts = Counter(body["model"] for _, body in answered)
    assert set(counts) == {"qwen-main", "qwen-main-next"}, counts
    for user, (_, body) in zip(asked, answered, strict=True):
        assert body["model"] == ("qwen-main-next" if on_canary[user] else "qwen-main"), user
    for user, (_, body) in zip(asked[:50], answered[:50], strict=True):
        assert _complete(router, "qwen-main", user=user)[1]["model"] == body["model"]


def test_the_fallback_answers_while_the_primarys_decode_is_gone_and_hands_back(
        router: int, deployments: dict[str, LocalCluster]) -> None:
    user = next(f"user-{i}" for i in range(1000) if canary_share(f"user-{i}", "qwen-main") >= 10)
    assert _complete(router, "qwen-main", user=user)[1]["model"] == "qwen-main"
    main = deployments["main"]
    decode = main.child("decode-0")
    decode.process.send_signal(signal.SIGKILL)
    decode.process.wait(10)

    # The first request still goes to the primary (nothing has failed there yet): its decode call fails before
    # any token and the fallback answers it; that failure opened the circuit, so the next go to the fallback.
    seen = [_complete(router, "qwen-main", user=user) for _ in range(3)]
    assert [(status, body.get("model")) for status, body in seen] == [(200, "qwen-backup")] * 3, seen
    assert seen[0][1] == seen[1][1] | {"id": seen[0][1]["id"], "created": seen[0][1]["created"]}
    assert _available_decode_workers(router, "qwen-main") == 0  # what the StageUnavailable alert reads
    assert _available_decode_workers(router, "qwen-backup") == 1

    # The primary's decode worker comes back on its address: once its circuit closes, it answers again.
    decode.process = subprocess.Popen(decode.argv, env={**os.environ, **main.env, **decode.env},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    main.wait_healthy(60)
    deadline = time.monotonic() + 60
    while (answer := _complete(router, "qwen-main", user=user))[1].get("model") != "qwen-main":
        assert time.monotonic() < deadline, answer
        time.sleep(0.5)
    assert _available_decode_workers(router, "qwen-main") == 1
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{router}/metrics", timeout=5).read().decode()
    fallbacks = re.search(r'qwenserve_router_fallbacks_total\{fallback="qwen-backup",model="qwen-main"\} (\S+)',
                          metrics)
    assert fallbacks and float(fallbacks.group(1)) >= 1, metrics[-2000:]


def _available_decode_workers(port: int, model: str) -> float:
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf'qwenserve_router_available_workers{{model="{model}",worker_stage="decode"}} (\S+)', metrics)
    assert found, metrics[-2000:]
    return float(found.group(1))


def test_a_stopped_primary_decode_hands_its_requests_to_the_fallback_within_seconds(
        router: int, deployments: dict[str, LocalCluster]) -> None:
    user = next(f"user-{i}" for i in range(1000) if canary_share(f"user-{i}", "qwen-main") >= 10)
    deadline = time.monotonic() + 60  # the previous test may have left the primary's circuit open
    while _complete(router, "qwen-main", user=user)[1].get("model") != "qwen-main":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    decode = deployments["main"].child("decode-0").process
    decode.send_signal(signal.SIGSTOP)
    try:
        # The first request is prefilled and its decode call is never taken (no headers within the router's
        # 5 s accept timeout): its first token was held back, so the fallback answers it, and the circuit that
        # stall opened sends the next ones straight there. Before, each waited for the 30 s stall timeout (or
        # ~20 s of keepalive) and got a 503.
        started = time.monotonic()
        seen = [_complete(router, "qwen-main", user=user) for _ in range(3)]
        took = time.monotonic() - started
    finally:
        decode.send_signal(signal.SIGCONT)
    assert [(status, body.get("model")) for status, body in seen] == [(200, "qwen-backup")] * 3, seen
    assert took < 15, took
    deadline = time.monotonic() + 60
    while (answer := _complete(router, "qwen-main", user=user))[1].get("model") != "qwen-main":
        assert time.monotonic() < deadline, answer
        time.sleep(0.5)
