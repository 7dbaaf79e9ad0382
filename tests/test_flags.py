"""Flags: derived from configuration dataclasses, environment fallbacks, strict one-line errors, and what
`qwen-serve up` passes to each stage."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from qwenserve.flags import (
    StrictParser,
    add_flag,
    add_options,
    address_list,
    argv_for,
    config_from_env,
    env_name,
    nested,
    option,
    option_specs,
    print_config,
)
from qwenserve.telemetry import logs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flag(parser, "--no-auth", type=bool, default=False)
    add_flag(parser, "--warm", type=bool, default=True)
    add_flag(parser, "--kv-cache-gb", type=float, default=1.0)
    return parser


def test_a_negative_switch_turns_on_when_given() -> None:
    assert _parser().parse_args(["--no-auth"]).no_auth is True
    assert _parser().parse_args([]).no_auth is False


def test_positive_switches_can_be_turned_off() -> None:
    assert _parser().parse_args(["--no-warm"]).warm is False


def test_environment_is_the_fallback_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_name("--kv-cache-gb"), "0.5")
    monkeypatch.setenv("QWENSERVE_NO_AUTH", "true")
    assert _parser().parse_args([]).kv_cache_gb == 0.5
    assert _parser().parse_args([]).no_auth is True
    assert _parser().parse_args(["--kv-cache-gb", "2"]).kv_cache_gb == 2.0


def test_address_lists() -> None:
    assert address_list(" a:1, b:2 ,") == ["a:1", "b:2"]
    assert address_list("") == []


# ---- options derived from dataclasses ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Inner:
    kv_cache_memory_gb: float = option(4.0, flag="--kv-cache-gb", help="KV memory")
    max_model_len: int | None = option(None)
    not_a_flag: int = 7


@dataclass(frozen=True)
class _Outer:
    model: str | None = option(None, positional=True)
    served_model_name: str = option("", aliases=("--model-name",))
    api_key: str | None = option(None, secret=True)
    enable_prefix_caching: bool = option(True)
    inner: _Inner = nested(_Inner, kv_cache_memory_gb=1.0)


def _outer_parser() -> StrictParser:
    parser = StrictParser(prog="qwen-serve test")
    add_options(parser, _Outer)
    return parser


def test_flags_and_their_variables_follow_the_field_names_and_nested_defaults_replace_the_inner_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    specs = {spec.flag: spec for spec in option_specs(_Outer)}
    assert list(specs) == ["--model", "--served-model-name", "--api-key", "--enable-prefix-caching",
                           "--kv-cache-gb", "--max-model-len"]
    assert specs["--kv-cache-gb"].env == "QWENSERVE_KV_CACHE_GB" and specs["--kv-cache-gb"].default == 1.0
    assert _outer_parser().parse_config(_Outer, []).inner == _Inner(kv_cache_memory_gb=1.0)
    monkeypatch.setenv("QWENSERVE_KV_CACHE_GB", "0.25")
    monkeypatch.setenv("QWENSERVE_MAX_MODEL_LEN", "512")
    config = _outer_parser().parse_config(_Outer, ["--model-name", "m", "--no-enable-prefix-caching"])
    assert config == _Outer(served_model_name="m", enable_prefix_caching=False,
                            inner=_Inner(kv_cache_memory_gb=0.25, max_model_len=512))
    assert config_from_env(_Inner) == _Inner(kv_cache_memory_gb=0.25, max_model_len=512)


def test_the_model_is_positional_or_a_flag_and_the_positional_wins_over_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("QWENSERVE_MODEL", "/from/env")
    assert _outer_parser().parse_config(_Outer, []).model == "/from/env"
    assert _outer_parser().parse_config(_Outer, ["/given"]).model == "/given"
    assert _outer_parser().parse_config(_Outer, ["--model", "/flag"]).model == "/flag"
    with pytest.raises(SystemExit):
        _outer_parser().parse_config(_Outer, ["/a", "--model", "/b"])
    assert capsys.readouterr().err == "qwen-serve test: MODEL '/a' and --model '/b' disagree; give one of them\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-cahce-gb", "2"], "unknown flag --kv-cahce-gb (did you mean --kv-cache-gb?)"),
    (["--kv-cache", "2"], "unknown flag --kv-cache (did you mean --kv-cache-gb?)"),  # no abbreviations
    (["--api", "sk"], "unknown flag --api (`qwen-serve test --help` lists the flags)"),
    (["--max-model-len", "many"], "argument --max-model-len: invalid int value: 'many'"),
    (["/a", "/b"], "unexpected argument '/b'"),
])
def test_a_bad_command_line_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _outer_parser().parse_config(_Outer, argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"qwen-serve test: {message}\n"


def test_a_bad_variable_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("QWENSERVE_ENABLE_PREFIX_CACHING", "maybe")
    with pytest.raises(SystemExit):
        _outer_parser()
    assert capsys.readouterr().err == (
        "qwen-serve test: QWENSERVE_ENABLE_PREFIX_CACHING='maybe' is not a switch value; use 1/0, true/false, "
        "yes/no or on/off (the environment fallback of --enable-prefix-caching)\n")


def test_argv_for_is_the_inverse_of_parsing_and_keeps_secrets_out_of_argv() -> None:
    values = {"served_model_name": "m", "api_key": "sk-1", "enable_prefix_caching": False,
              "kv_cache_memory_gb": 0.5}
    argv, env = argv_for(_Outer, values)
    assert argv == ["--served-model-name", "m", "--no-enable-prefix-caching", "--kv-cache-gb", "0.5"]
    assert env == {"QWENSERVE_API_KEY": "sk-1"}
    parsed = _outer_parser().parse_config(_Outer, argv)
    assert (parsed.served_model_name, parsed.enable_prefix_caching, parsed.inner.kv_cache_memory_gb) == ("m", False, 0.5)


def test_the_printed_configuration_hides_secrets(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a process that has not set up logging (an earlier test in this one may have).
    monkeypatch.setattr(logs, "_console_handlers", [])
    print_config("test", _Outer(api_key="sk-secret"))
    line = capsys.readouterr().err
    assert "api_key=***" in line and "sk-secret" not in line and "inner={kv_cache_memory_gb=1.0" in line


# ---- what qwen-serve up passes to each stage ----------------------------------------------------------------


def test_up_routes_the_names_vllm_users_type_to_the_stages_that_own_them(tmp_path: Path) -> None:
    from qwenserve.launcher import LocalCluster
    from qwenserve.up import up_parser

    parser, routed = up_parser()
    args = vars(parser.parse_args([
        "--served-model-name", "qwen-tiny", "--max-model-len", "2048", "--dtype", "float32", "--kv-cache-gb", "2",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--no-enable-prefix-caching", "--api-key", "sk-1",
        "--tensor-parallel-size", "1", "--lease-s", "5", "--stall-timeout-s", "9", "--workers", "3",
    ]))
    values = {spec.dest: args[spec.dest] for specs in routed.values() for spec in specs if spec.dest in args}
    cluster = LocalCluster(model=tmp_path, stage_values=values)
    argv = {child.name: child.argv[child.argv.index("serve") + 2:] for child in cluster.plan()}
    env = {child.name: child.env for child in cluster.children}
    engine_flags = ["--served-model-name", "qwen-tiny", "--tensor-parallel-size", "1", "--dtype", "float32",
                    "--max-model-len", "2048", "--kv-cache-gb", "2.0", "--max-num-batched-tokens", "256",
                    "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    for engine in ("prefill-0", "decode-0"):
        assert _contains(argv[engine], engine_flags), argv[engine]
    assert _contains(argv["prefill-0"], ["--lease-s", "5.0"]) and "--lease-s" not in argv["decode-0"]
    assert _contains(argv["router"], ["--served-model-name", "qwen-tiny", "--max-model-len", "2048"])
    assert _contains(argv["router"], ["--stall-timeout-s", "9.0"]) and "--no-auth" not in argv["router"]
    assert env["router"] == {"QWENSERVE_API_KEY": "sk-1"} and "sk-1" not in " ".join(argv["router"])
    assert _contains(argv["tokenizer"], ["--workers", "3"]) and "--served-model-name" not in argv["tokenizer"]
    assert all("--api-key" not in a and "--dtype" not in a for a in (argv["tokenizer"], argv["router"]))


def test_worker_arguments_go_to_the_worker_stages_that_define_them() -> None:
    from qwenserve.launcher import route_args

    assert route_args(["--lease-s", "2", "--log-json", "--max-num-seqs=4"], ("prefill", "decode")) == {
        "prefill": ["--lease-s", "2", "--log-json", "--max-num-seqs=4"],
        "decode": ["--log-json", "--max-num-seqs=4"],
    }
    with pytest.raises(ValueError, match="--shm-dir: none of prefill, decode defines this flag"):
        route_args(["--shm-dir", "/dev/shm"], ("prefill", "decode"))


def _contains(argv: list[str], part: list[str]) -> bool:
    """`part` appears in `argv` as consecutive items."""
    return any(argv[i:i + len(part)] == part for i in range(len(argv)))
