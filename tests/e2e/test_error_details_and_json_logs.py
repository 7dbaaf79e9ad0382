"""Operability over real processes: every error status carries an ErrorDetail any gRPC client can read
(`grpc_status.rpc_status.from_call`), and under JSON logs every line every stage writes is a JSON record.

One cluster (tokenizer, one prefill, one decode, a router with API keys) serves the module, all its stages
logging JSON (`--log-json` for the engines and the router, QWENSERVE_LOG_FORMAT=json for the tokenizer).
The last test stops it and reads what each stage wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status

from qwenserve.launcher import LocalCluster, wait_serving
from qwenserve.rpc_errors import retry_after_of
from qwenserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.support.clusters import make_cluster

OPEN_KEY, LIMITED_KEY = "sk-open", "sk-limited"
OUT_OF_VOCAB = 10_000_000
RECORD_FIELDS = {"ts", "level", "logger", "message"}


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("operability")
    keys = tmp / "api-keys.json"
    keys.write_text(json.dumps({
        "tenants": {"open": {}, "limited": {"requests_per_minute": 1}},
        "keys": [{"tenant": "open", "key": OPEN_KEY}, {"tenant": "limited", "key": LIMITED_KEY}],
    }))
    with make_cluster(tiny_model, tmp, prefill=1, decode=1, env={"QWENSERVE_LOG_FORMAT": "json"},
                      extra_worker_args=["--log-json"],
                      extra_router_args=["--api-keys-file", str(keys), "--log-json"]) as c:
        yield c


def _channel(cluster: LocalCluster, stage: str) -> grpc.Channel:
    address = f"{cluster.host}:{cluster.router_port}" if stage == "router" else cluster.child(stage).address
    return grpc.insecure_channel(address)


def _generate(cluster: LocalCluster, key: str, **sampling: float) -> list[router_pb2.GenerateResponse]:
    request = router_pb2.GenerateRequest(prompt="Hello")
    request.sampling.max_tokens = 2
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    with _channel(cluster, "router") as channel:
        return list(router_pb2_grpc.RouterStub(channel).Generate(
            request, timeout=60, metadata=(("authorization", f"Bearer {key}"),)))


def _error_detail(error: grpc.RpcError) -> common_pb2.ErrorDetail:
    """What any gRPC client finds in the status: a google.rpc.Status whose first detail is our ErrorDetail."""
    assert isinstance(error, grpc.Call)
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status on {error.code()}: {error.details()}"
    assert status.code == error.code().value[0] and status.message == error.details()
    detail = common_pb2.ErrorDetail()
    assert status.details and status.details[0].Unpack(detail), status
    return detail


def test_router_refuses_an_invalid_sampling_value_with_its_error_detail(cluster: LocalCluster) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(cluster, OPEN_KEY, top_p=2.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = _error_detail(info.value)
    assert (detail.code, detail.field, detail.retryable) == ("invalid_request", "sampling.top_p", False)
    assert "top_p" in detail.message


def test_router_refuses_an_unknown_api_key_on_every_rpc_with_its_error_detail(cluster: LocalCluster) -> None:
    stub = router_pb2_grpc.RouterStub(_channel(cluster, "router"))
    wrong = (("authorization", "Bearer sk-wrong"),)
    for call in (lambda: stub.ListModels(router_pb2.ListModelsRequest(), metadata=wrong, timeout=10),
                 lambda: stub.GetStatus(router_pb2.GetStatusRequest(), metadata=wrong, timeout=10)):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _error_detail(info.value).code == "invalid_api_key"


def test_a_rate_limited_call_says_it_may_be_retried_and_when(cluster: LocalCluster) -> None:
    assert _generate(cluster, LIMITED_KEY)[-1].finish_reason  # the tenant's one request this minute
    with pytest.raises(grpc.RpcError) as info:
        _generate(cluster, LIMITED_KEY)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    detail = _error_detail(info.value)
    assert (detail.code, detail.retryable) == ("rate_limit_exceeded", True)
    retry_after = retry_after_of(info.value)
    assert retry_after is not None and 0 < retry_after <= 60


def test_prefill_refuses_a_token_outside_the_vocabulary_with_its_error_detail(cluster: LocalCluster) -> None:
    request = prefill_pb2.PrefillRequest(request_id="bad-prefill", prompt_token_ids=[1, OUT_OF_VOCAB])
    with _channel(cluster, "prefill-0") as channel, pytest.raises(grpc.RpcError) as info:
        prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = _error_detail(info.value)
    assert (detail.code, detail.field) == ("invalid_argument", "prompt_token_ids")
    assert str(OUT_OF_VOCAB) in detail.message


def test_decode_refuses_a_token_outside_the_vocabulary_with_its_error_detail(cluster: LocalCluster) -> None:
    request = decode_pb2.DecodeRequest(request_id="bad-decode", prompt_token_ids=[OUT_OF_VOCAB],
                                       local_prefill=True)
    with _channel(cluster, "decode-0") as channel, pytest.raises(grpc.RpcError) as info:
        list(decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = _error_detail(info.value)
    assert (detail.code, detail.field) == ("invalid_argument", "prompt_token_ids")


def test_tokenizer_refuses_a_request_without_input_with_its_error_detail(cluster: LocalCluster) -> None:
    with _channel(cluster, "tokenizer") as channel, pytest.raises(grpc.RpcError) as info:
        tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(tokenizer_pb2.TokenizeRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = _error_detail(info.value)
    assert (detail.code, detail.field) == ("invalid_argument", "request")


def _json_records(text: str, where: str) -> list[dict]:
    records = []
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"{where}: a line that is not JSON: {line!r}")
        assert isinstance(record, dict) and RECORD_FIELDS <= record.keys(), f"{where}: {line!r}"
        records.append(record)
    return records


def test_every_line_every_stage_writes_is_a_json_record(cluster: LocalCluster) -> None:
    assert _generate(cluster, OPEN_KEY)[-1].finish_reason
    cluster.stop()
    assert cluster.log_dir is not None
    for child in cluster.children:
        records = _json_records((cluster.log_dir / f"{child.name}.log").read_text(), child.name)
        messages = [r["message"] for r in records]
        stage = child.name.split("-")[0]
        assert any(m.startswith(f"{stage} listening on ") for m in messages), messages
        assert any(m.startswith(f"{stage} config: ") for m in messages), messages
        assert any(m.startswith(f"{stage} draining (grace ") for m in messages), messages


def test_a_stage_started_with_log_json_writes_only_json_on_stdout_and_stderr(tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("QWENSERVE_LOG_FORMAT", "GRPC_VERBOSITY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve_services.tokenizer.server", "--model", str(tiny_model),
         "--port", "0", "--grace-s", "1", "--log-json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert proc.stdout is not None
        listening = json.loads(proc.stdout.readline())  # the one line it writes on stdout, once bound
        assert listening["message"].startswith("tokenizer listening on ") and listening["level"] == "INFO"
        address = f"127.0.0.1:{listening['port']}"
        wait_serving(address, time.monotonic() + 60, proc, "the tokenizer")
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError):
            tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(tokenizer_pb2.TokenizeRequest(), timeout=10)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert _json_records(out, "stdout") == []  # nothing after the listening line
    messages = [r["message"] for r in _json_records(err, "stderr")]
    assert any(m.startswith("tokenizer draining") for m in messages), messages
