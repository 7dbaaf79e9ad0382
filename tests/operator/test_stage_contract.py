"""The contract between the operator and the stages: every argument a rendered container gets is a flag its
stage defines (parsed by that stage's own strict parser, with the container's environment), and every
QWENSERVE_* variable the manifests set is one that stage reads."""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

import pytest

from qwenserve.cli import COMMANDS as CLI_COMMANDS
from qwenserve.cli import STAGES as CLI_STAGES
from qwenserve_operator import manifests, naming, pod_template
from qwenserve_operator.crd import STAGES

UID = "0b7d1c2e-0000-4000-8000-000000000002"
SECRET_VALUE = "from-a-secret"  # what a secretKeyRef or another fieldRef resolves to in a pod
POD_IP = "10.244.1.7"  # what status.podIP resolves to
CONFIG_CLASSES = {"tokenizer": "TokenizerServiceConfig", "prefill": "PrefillServiceConfig",
                  "decode": "DecodeServiceConfig", "router": "RouterServiceConfig"}

VARIANTS: dict[str, dict[str, Any]] = {
    "minimal": {},
    "shm": {"kvTransfer": {"mode": "shm"}},
    "network": {"kvTransfer": {"mode": "network"}},
    "mooncake": {"kvTransfer": {"mode": "mooncake"}},
    "pvc": {"model": {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "Qwen3-0.6B"}}},
    "hostpath": {"model": {"source": "hostPath", "hostPath": "/srv/models/qwen"}},
    "hf": {"model": {"source": "hf", "hf": {"repo": "Qwen/Qwen3-0.6B", "tokenSecretRef": {"name": "t"}}}},
    "secrets": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}}, "apiKeysSecret": {"name": "keys"},
                "telemetry": {"otlpEndpoint": "http://otel:4317", "logFormat": "json"}},
    "redis-and-limits": {"redis": {"url": "redis://redis:6379/0"},
                         "rateLimits": {"requestsPerMinute": 60, "tokensPerMinute": 10_000, "failOpen": False}},
    "stage-args": {"stages": {"router": {"args": ["--stall-timeout-s", "60", "--local-prefill-threshold", "32"]},
                              "decode": {"args": ["--max-num-seqs", "64", "--stream-interval-ms", "20"]},
                              "prefill": {"args": ["--kv-cache-gb", "2", "--lease-s", "10"]}}},
}


def _container(children: list[dict[str, Any]], stage: str) -> dict[str, Any]:
    deployment = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == f"demo-{stage}")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _environment(container: dict[str, Any], config_map: dict[str, str]) -> dict[str, str]:
    """What the container's process sees: its env (references resolved to a stand-in) and its envFrom keys."""
    def value(var: dict[str, Any]) -> str:
        if var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            return POD_IP
        return str(var.get("value", SECRET_VALUE))

    env = {e["name"]: value(e) for e in container["env"]}
    if container.get("envFrom"):
        assert container["envFrom"] == [{"configMapRef": {"name": "demo-config"}}]
        env.update({k: v for k, v in config_map.items() if k.isidentifier()})  # the kubelet skips other keys
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of an argument (an unknown variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_stage_parses_its_rendered_arguments_and_reads_every_variable_set(
    make_spec, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(**VARIANTS[variant])
    children = manifests.children("demo", "ns1", UID, spec, {s: 1 for s in STAGES})
    config_map = next(c for c in children if c["kind"] == "ConfigMap")["data"]
    for stage in STAGES:
        container = _container(children, stage)
        args = container["args"]
        assert args[:2] == ["serve", stage] and stage in CLI_STAGES
        module = importlib.import_module(f"qwenserve.stages.{stage}")
        env = _environment(container, config_map)
        reads = getattr(module, CONFIG_CLASSES[stage]).variables()
        unread = sorted(name for name in env if name.startswith("QWENSERVE_") and name not in reads)
        assert not unread, f"{stage}: the manifests set {unread}, which the stage never reads"
        # The stage starts from exactly this environment (flags fall back to QWENSERVE_* variables).
        for name in [n for n in os.environ if n.startswith("QWENSERVE_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        # The kubelet expands $(VAR) in args from the container's environment.
        argv = [_expand(a, env) for a in args[2:]]
        assert not [a for a in argv if "$(" in a], f"{stage}: an argument names a variable the container lacks"
        config = module.parse_config(argv)  # strict: an unknown flag or a bad value exits
        assert config.port == naming.GRPC_PORTS[stage] and config.host == "0.0.0.0"
        assert config.metrics_port == naming.METRICS_PORT and config.model == naming.model_dir(spec)
        if stage == "router":
            assert config.decode == [f"demo-decode.ns1.svc.cluster.local:{naming.GRPC_PORTS['decode']}"]
            assert config.model_name == spec["model"]["name"] and config.http_port == naming.HTTP_PORT
            assert config.front.no_auth is not bool(spec.get("apiKeysSecret"))
        if stage in ("prefill", "decode"):
            assert config.served_model_name == spec["model"]["name"]  # vLLM's metrics' model_name, as the router's
        if stage in ("prefill", "decode"):
            assert config.kv_transfer == spec["kvTransfer"]["mode"]  # decode fetches over that transport alone
        if stage == "prefill" or (stage == "decode" and config.kv_transfer == "mooncake"):
            assert config.advertise_host == POD_IP  # handoffs name the pod, never the 0.0.0.0 it binds


def test_the_crd_offers_exactly_the_transports_the_stages_define() -> None:
    from qwenserve.stages.common import KV_TRANSFER_MODES as STAGE_MODES
    from qwenserve.stages.decode import build_parser as decode_parser
    from qwenserve.stages.prefill import build_parser as prefill_parser
    from qwenserve_operator.crd import KV_TRANSFER_MODES, spec_schema

    assert spec_schema()["properties"]["kvTransfer"]["properties"]["mode"]["enum"] == list(KV_TRANSFER_MODES)
    assert KV_TRANSFER_MODES == STAGE_MODES
    for parser in (prefill_parser(), decode_parser()):
        assert tuple(parser._option_string_actions["--kv-transfer"].choices) == KV_TRANSFER_MODES


def test_a_presets_crd_field_reaches_prefill_decode_and_the_router_as_their_flag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qwenserve.presets import PRESET_NAMES as STAGE_PRESETS
    from qwenserve.stages.decode import parse_config as decode_config
    from qwenserve.stages.prefill import parse_config as prefill_config
    from qwenserve_operator.crd import PRESET_NAMES, spec_schema, with_defaults
    from qwenserve_operator.pod_template import stage_args

    assert PRESET_NAMES == STAGE_PRESETS and spec_schema()["properties"]["preset"]["enum"] == list(PRESET_NAMES)
    spec = with_defaults({"model": {"name": "m", "source": "image"}, "preset": "throughput"})
    decode = decode_config(stage_args("d", "ns", "decode", spec)[2:])
    prefill = prefill_config(stage_args("d", "ns", "prefill", spec)[2:])
    assert decode.preset == prefill.preset == "throughput"
    assert decode.engine.max_num_batched_tokens == prefill.engine.max_num_batched_tokens == 2048
    assert decode.stream_interval_ms == 25.0 and decode.engine.admission_policy == "fcfs"
    spec["stages"]["decode"]["args"] = ["--max-num-batched-tokens", "1024", "--preset", "latency"]
    decode = decode_config(stage_args("d", "ns", "decode", spec)[2:])
    assert (decode.preset, decode.engine.max_num_batched_tokens, decode.stream_interval_ms) == ("latency", 1024, 0.0)
    from qwenserve.stages.router import parse_config as router_config

    monkeypatch.setenv("QWENSERVE_DECODE", "decode.ns.svc:50052")  # the router's ConfigMap gives its workers
    spec["preset"] = "latency"
    router = router_config(stage_args("d", "ns", "router", spec)[2:])
    assert (router.preset, router.router.max_streams_per_decode_worker) == ("latency", 32)


def test_the_stages_refuse_a_flag_they_do_not_define(capsys: pytest.CaptureFixture[str]) -> None:
    """What let --shm-dir through for months: a stage that ignored what it did not know."""
    from qwenserve.stages.prefill import parse_config

    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--model", "/models/m", "--shm-dir", "/dev/shm"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["qwen-serve serve prefill: unknown flag --shm-dir "
                                                            "(`qwen-serve serve prefill --help` lists the flags)"]


def test_extra_stage_arguments_a_stage_would_refuse_are_spec_problems(make_spec) -> None:
    spec = make_spec(stages={"router": {"args": ["--log-requests", "--stall-timeout-s", "60"]},
                             "decode": {"args": ["--port=9999", "--max-num-seqs", "8"]}})
    assert manifests.validate_spec(spec) == [
        "spec.stages.decode.args: --port is set by the operator",
        "spec.stages.router.args: --log-requests is not a flag of `qwen-serve serve router`",
    ]
    assert manifests.validate_spec(make_spec(**VARIANTS["stage-args"])) == []


def test_the_fetch_model_init_container_runs_a_command_the_image_defines(make_spec) -> None:
    from qwenserve.default_model import build_parser

    spec = make_spec(model={"source": "hf", "hf": {"repo": "Qwen/Qwen3-0.6B", "revision": "main"}})
    init = pod_template.model_fetch_container(spec)
    assert init is not None and init["args"][0] in CLI_COMMANDS
    args = build_parser().parse_args(init["args"][1:])  # strict: an unknown flag exits
    assert (args.action, args.source, str(args.dir), args.revision) == (
        "fetch", "hf://Qwen/Qwen3-0.6B", naming.model_dir(spec), "main")
