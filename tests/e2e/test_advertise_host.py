"""Prefill advertises an address decode can dial, never its bind address; a handle naming an address that cannot
be dialled is an error in decode's log and a counted `unreachable` handoff failure, not a silent recompute."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from qwenserve.launcher import LocalCluster
from qwenserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2
from tests.support.clusters import make_cluster, router_stub
from tests.support.metrics import by_labels, scrape, total
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def wildcard_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One prefill bound to every address (as in a pod) that advertises 127.0.0.1, one decode, network mode."""
    with make_cluster(tiny_model, tmp_path_factory.mktemp("advertise"), kv_transfer="network",
                      extra_worker_args=["--host", "0.0.0.0", "--advertise-host", "127.0.0.1"]) as cluster:
        yield cluster


def test_a_prefill_bound_to_a_wildcard_hands_off_over_the_network_at_its_advertised_address(
    wildcard_cluster: LocalCluster,
) -> None:
    prefill, decode = wildcard_cluster.child("prefill-0"), wildcard_cluster.child("decode-0")
    assert prefill.argv[prefill.argv.index("--advertise-host") + 1] == "127.0.0.1"
    assert "--kv-transfer" not in decode.argv  # decode's default: shm or network handoffs

    async def generate() -> list[router_pb2.GenerateResponse]:
        channel, stub = router_stub(wildcard_cluster)
        async with channel:
            request = router_pb2.GenerateRequest()
            request.prompt_token_ids.ids.extend(range(100, 160))
            request.sampling.max_tokens, request.sampling.ignore_eos = 4, True
            return [m async for m in stub.Generate(request)]

    messages = asyncio.run(generate())
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and not messages[-1].HasField("error")
    # Decode fetched the prompt's KV over gRPC from prefill's advertised address instead of recomputing it.
    assert total(scrape(decode.metrics_port), "qwenserve_handoff_bytes_total", transport="grpc") > 0
    assert not by_labels(scrape(decode.metrics_port), "qwenserve_handoff_failures_total")


@pytest.mark.parametrize("location", ["closed-port", "wildcard"])
def test_a_handle_whose_location_cannot_be_dialled_is_a_logged_error_and_counted_unreachable(
    wildcard_cluster: LocalCluster, location: str,
) -> None:
    prefill, decode = wildcard_cluster.child("prefill-0"), wildcard_cluster.child("decode-0")
    prompt = list(range(300, 340))
    dead = f"127.0.0.1:{free_port()}" if location == "closed-port" else f"0.0.0.0:{prefill.address.split(':')[1]}"

    async def handoff_to_nowhere() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(prefill.address) as pch, grpc.aio.insecure_channel(decode.address) as dch:
            request = prefill_pb2.PrefillRequest(request_id=f"nowhere-{location}", prompt_token_ids=prompt)
            request.sampling.temperature, request.sampling.max_tokens = 0.0, 4
            response = await prefill_pb2_grpc.PrefillStub(pch).Prefill(request)
            handle = response.kv_handle
            assert handle.location == handle.control_endpoint == f"127.0.0.1:{prefill.address.split(':')[1]}"
            handle.location = dead  # a real handoff whose bytes sit where nobody can dial
            decode_request = decode_pb2.DecodeRequest(request_id=request.request_id, prompt_token_ids=prompt,
                                                      sampling=request.sampling)
            decode_request.prefilled.kv_handle.CopyFrom(handle)
            decode_request.prefilled.first_token_id = response.first_token_id
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in decode_pb2_grpc.DecodeStub(dch).Decode(decode_request):
                    pass
            return refused.value.code()

    before = scrape(decode.metrics_port)
    # FAILED_PRECONDITION: the router's cue to recompute the prompt, which it logs.
    assert asyncio.run(handoff_to_nowhere()) == grpc.StatusCode.FAILED_PRECONDITION
    after = scrape(decode.metrics_port)
    unreachable = {"reason": "unreachable", "transport": "grpc"}
    failures = "qwenserve_handoff_failures_total"
    assert total(after, failures, **unreachable) - total(before, failures, **unreachable) == 1, by_labels(after, failures)
    assert wildcard_cluster.log_dir is not None
    log = (wildcard_cluster.log_dir / "decode-0.log").read_text()
    errors = [line for line in log.splitlines() if "ERROR" in line and "handoff refused" in line and dead in line]
    assert errors, log[-2000:]


def test_prefill_and_decode_hand_off_over_mooncake_when_both_are_told_to(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")
    args = ["--kv-transfer", "mooncake", "--host", "0.0.0.0", "--advertise-host", "127.0.0.1"]
    with make_cluster(tiny_model, tmp_path, kv_transfer="mooncake", extra_worker_args=args) as cluster:
        decode = cluster.child("decode-0")
        assert decode.argv[decode.argv.index("--kv-transfer") + 1] == "mooncake"

        async def generate() -> list[router_pb2.GenerateResponse]:
            channel, stub = router_stub(cluster)
            async with channel:
                request = router_pb2.GenerateRequest()
                request.prompt_token_ids.ids.extend(range(500, 540))
                request.sampling.max_tokens, request.sampling.ignore_eos = 3, True
                return [m async for m in stub.Generate(request)]

        messages = asyncio.run(generate())
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and not messages[-1].HasField("error")
        assert total(scrape(decode.metrics_port), "qwenserve_handoff_bytes_total", transport="mooncake") > 0
        assert not by_labels(scrape(decode.metrics_port), "qwenserve_handoff_failures_total")
