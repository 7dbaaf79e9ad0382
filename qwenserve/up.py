"""`qwen-serve up`: the four stages as separate local processes on loopback, started and stopped together.

`up`'s parser is its own options and every stage's flags; each flag goes to the stages that have it
(qwenserve/launcher.py runs the processes). Before starting anything it parses each child's command line with
the stage's strict parser and runs the stage's start-up checks, so a mistake is one line and nothing starts.

Once every child is healthy it prints one line containing `ready` with the router's addresses, then one line
per service with its gRPC and metrics addresses, and on Ctrl-C / SIGTERM stops them all. A child that exits
meanwhile is restarted on its ports after a backoff, as a kubelet would (qwenserve/restarts.py; the log says
which, why and when; the router answers retryably or routes around it meanwhile). Only a child that keeps
failing at start stops `up`, with one line naming it and its last lines of output.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwenserve.checkpoint_config import architecture_differences
from qwenserve.flags import (
    FlagError,
    FlagSpec,
    StrictParser,
    add_options,
    config_from_args,
    config_line,
    env_name,
    option,
    option_specs,
)
from qwenserve.launcher import Child, LocalCluster, serving, stage_configs
from qwenserve.preflight import StartupError, check_model_folder, check_port_free, one_line
from qwenserve.presets import preset_defaults, preset_named
from qwenserve.restarts import GiveUp, RestartPolicy, StageExit, after_exit
from qwenserve.stage_secret import per_run_secret_file
from qwenserve.stages.common import stage_module
from qwenserve.telemetry.logs import console

# Stage flags `qwen-serve up` sets itself (addresses and ports it chooses, the model it serves).
LAUNCHER_SET = frozenset({"host", "port", "model", "metrics_port", "http_port", "tokenizer", "prefill", "decode",
                          "tokenizer_metrics", "prefill_metrics", "decode_metrics", "kv_transfer"})
# Prompts shorter than this are prefilled on the decode worker unless told otherwise (_prefill_short_prompts_on_decode):
# on the 2-core AMX Xeon (peer_bench, 2026-12-06) 32 requests at once of 64-512-token prompts streamed 51.6 tokens/s
# through the split against 70.6 with every prompt prefilled on decode; a 2,000-token prompt's first token took
# 4.37 against 4.11 s, so long prompts keep the prefill stage.
UP_LOCAL_PREFILL_TOKENS = 1024


@dataclass(frozen=True)
class UpConfig:
    """`qwen-serve up`'s own options; every other flag it accepts is a stage's, passed to the stages that have it."""

    model: str | None = option(None, positional=True,
                               help="Hugging Face checkpoint folder to serve (default: the built-in small Qwen3)")
    prefill: int = option(1, help="prefill processes (0: decode workers prefill themselves)")
    decode_model: str | None = option(
        None, help="another checkpoint of the same model for the decode processes (e.g. its AWQ or GPTQ copy: 4-bit "
                   "decode behind a 16-bit prefill); they continue the prefill's KV (--kv-from-other-weights)")
    decode: int = option(1, help="decode processes")
    host: str = option("127.0.0.1", help="address every stage binds")
    port: int = option(8000, aliases=("--http-port",), help="the router's OpenAI-compatible HTTP port")
    grpc_port: int = option(50050, help="the router's gRPC port")
    kv_transfer: str = option("shm", choices=("shm", "network"), help="how prefill hands KV to decode")
    log_dir: str | None = option(None, help="write each child's log to a file here")
    prefill_nice: int = option(
        10, help="lower prefill processes' CPU priority by this much, so that on shared cores their long prompt "
                 "steps yield to decode steps and the router's relay (0: equal priority)")
    restart_backoff_s: float = option(
        1.0, help="wait this long before restarting a stage that exited, doubling with each exit in a row "
                  "(at most 30 s)")
    max_start_failures: int = option(
        3, help="stop when a stage exits this many times in a row before it becomes ready")
    print_config: bool = option(False, env=False,
                                help="print every stage's configuration as it would start (preset applied), then exit")


def up_parser(argv: Sequence[str] = ()) -> tuple[StrictParser, dict[str, list[FlagSpec]]]:
    """`qwen-serve up`'s parser: its own options (with the defaults of the preset `argv` names), then every stage
    flag it passes on (by stage)."""
    parser = StrictParser(prog="qwen-serve up", description=__doc__.splitlines()[0],
                          epilog="Every flag also reads QWENSERVE_<FLAG> from the environment.")
    add_options(parser, UpConfig, defaults=preset_defaults(preset_named(argv)))
    routed: dict[str, list[FlagSpec]] = {}
    for stage, cls in stage_configs().items():
        group = parser.add_argument_group(f"{stage} flags", "passed to every stage that has them")
        add_options(group, cls, suppress=True, skip=lambda spec: spec.dest in LAUNCHER_SET)
        routed[stage] = [spec for spec in option_specs(cls) if spec.dest not in LAUNCHER_SET]
    return parser, routed


def main(argv: list[str]) -> int:
    """`qwen-serve up`: run the whole stack until Ctrl-C."""
    parser, routed = up_parser(argv)
    args = parser.parse_args(argv)
    try:
        up: UpConfig = config_from_args(UpConfig, args)
    except FlagError as e:
        parser.error(str(e))
    if up.prefill < 0 or up.decode < 1:
        parser.error("need --decode >= 1 and --prefill >= 0")
    if up.restart_backoff_s < 0 or up.max_start_failures < 1:
        parser.error("need --restart-backoff-s >= 0 and --max-start-failures >= 1")
    given = vars(args)
    stage_values = {spec.dest: given[spec.dest] for specs in routed.values() for spec in specs if spec.dest in given}
    if not stage_values.get("stage_secret_file") and not os.environ.get("QWENSERVE_STAGE_SECRET_FILE"):
        # Only this run's stages may call each other: a secret made for it, handed to every stage as a file.
        stage_values["stage_secret_file"] = str(per_run_secret_file())
    try:
        model = _checked_model(up.model)
        decode_model = _checked_decode_model(model, up)
        _prefill_short_prompts_on_decode(up, decode_model, stage_values)
        cluster = LocalCluster(
            model=Path(model), decode_model=decode_model, prefill=up.prefill, decode=up.decode, host=up.host,
            router_port=up.grpc_port,
            http_port=up.port, kv_transfer=up.kv_transfer, log_dir=Path(up.log_dir) if up.log_dir else None,
            prefill_nice=up.prefill_nice, stage_values=stage_values,
        )
        cluster.plan()
        configs = _child_configs(cluster)
        if up.print_config:
            for name, _stage, config in configs:
                print(f"{name}: {config_line(config)}")
            print(f"up: prefill_nice={up.prefill_nice}")
            return 0
        _check_plan(configs, up)
    except StartupError as e:
        console("qwen-serve up: cannot start: %s", one_line(e), level=logging.ERROR, stderr=True)
        return 1
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
    except RuntimeError as e:
        console("qwen-serve up: %s; stopped the others", e, level=logging.ERROR, stderr=True)
        return 1
    # Plain text as programs parse it; a JSON record each under --log-json, as the stages' lines.
    console("qwen-serve ready: router grpc=%s:%s http=http://%s:%s/v1 model=%s prefill=%s decode=%s",
            cluster.host, cluster.router_port, cluster.host, cluster.http_port, model, up.prefill, up.decode)
    for line in cluster.addresses():
        console("%s", line)
    code = 0
    policy = RestartPolicy(initial_backoff_s=up.restart_backoff_s,
                           max_backoff_s=max(up.restart_backoff_s, RestartPolicy.max_backoff_s),
                           max_start_failures=up.max_start_failures)
    watches = [StageWatch(child) for child in cluster.children]
    while not stop["signal"]:
        failed = next((why for watch in watches if (why := watch.tick(cluster, policy, time.monotonic()))), None)
        if failed is not None:
            console("qwen-serve up: %s; stopping the others", failed, level=logging.ERROR, stderr=True)
            code = 1
            break
        time.sleep(0.2)
    cluster.stop()
    console("qwen-serve stopped")
    return code


class StageWatch:
    """One child as `up` watches it: started at, ready yet, its exits, the restart it waits for."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.started_at = time.monotonic()
        self.ready = True  # the cluster started only once every child was serving
        self.exits: list[StageExit] = []
        self.restart_at: float | None = None

    def tick(self, cluster: LocalCluster, policy: RestartPolicy, now: float) -> str | None:
        """Act on the child's state now: note an exit and schedule its restart, restart it when due, notice it
        serving again. Returns why `up` must stop (the child keeps failing at start), else None."""
        child = self.child
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                cluster.restart(child)
                self.started_at, self.ready = now, False
                console("qwen-serve up: restarted %s on %s (restart %d, pid %s)", child.name, child.address,
                        child.restarts, child.process.pid if child.process else "-", level=logging.WARNING,
                        stderr=True, stage=child.name, restarts=child.restarts)
            return None
        how = child.died()
        if how is None:
            if not self.ready and serving(child.address):
                self.ready = True
                console("qwen-serve up: %s is serving again (restart %d, %.1f s after it started)", child.name,
                        child.restarts, now - self.started_at, stderr=True, stage=child.name,
                        restarts=child.restarts)
            return None
        self.exits.append(StageExit(ran_s=now - self.started_at, ready=self.ready))
        decision = after_exit(self.exits, policy)
        if isinstance(decision, GiveUp):
            lines = " | ".join(child.last_lines) or "no output"
            return (f"{child.name} failed to start {decision.start_failures} times in a row (last: {how}); "
                    f"its last lines: {lines}")
        self.restart_at = now + decision.delay_s
        console("qwen-serve up: %s; restarting it on %s in %.1f s (restart %d)", how, child.address,
                decision.delay_s, child.restarts + 1, level=logging.WARNING, stderr=True, stage=child.name,
                restarts=child.restarts + 1)
        return None


def _checked_model(model: str | None) -> str:
    """The checkpoint folder to serve, checked; the built-in one is made (once) when none is given."""
    if model is None:
        from qwenserve.default_model import ensure_default_model

        return str(ensure_default_model())
    check_model_folder(model, "MODEL", needs_tokenizer=True)
    return model


def _prefill_short_prompts_on_decode(up: UpConfig, decode_model: Path | None, stage_values: dict[str, Any]) -> None:
    """Unless told otherwise (`--local-prefill-threshold`, its variable), `up`'s router prefills prompts shorter than
    UP_LOCAL_PREFILL_TOKENS on the decode worker: on one host the prefill and decode engines share the cores, so a
    short prompt handed from one to the other pays a handoff and both engines' steps contending for the same cores,
    and isolates nothing. Long prompts still go through the prefill stage, and a --decode-model deployment sends
    every prompt there (its decode weights are not the ones to prefill with)."""
    if up.prefill == 0 or decode_model is not None or "local_prefill_threshold" in stage_values \
            or env_name("--local-prefill-threshold") in os.environ:
        return
    stage_values["local_prefill_threshold"] = UP_LOCAL_PREFILL_TOKENS


def _checked_decode_model(model: str, up: UpConfig) -> Path | None:
    """--decode-model, checked: a checkpoint of MODEL's architecture (its KV is the prefill's), behind prefill
    processes."""
    if up.decode_model is None:
        return None
    check_model_folder(up.decode_model, "--decode-model")
    if up.prefill == 0:
        raise StartupError("--decode-model needs prefill processes (--prefill 0 makes the decode workers prefill on "
                           "their own weights): leave --prefill at 1 or more, or serve the decode model as MODEL")
    if differences := architecture_differences(model, up.decode_model):
        raise StartupError(f"--decode-model {up.decode_model} is not MODEL's architecture ({'; '.join(differences)}), "
                           "so its decode workers could not continue the prefill's KV: give a checkpoint of the same "
                           "model in another precision")
    return Path(up.decode_model)


def _child_configs(cluster: LocalCluster) -> list[tuple[str, str, Any]]:
    """(child name, stage, the stage's configuration) as the child will parse it: its planned command line with the
    stage's strict parser (a refusal exits here, in one line), its variables from the environment it will get
    (the secrets `up` hands it there included). Nothing is started, and this process's environment is untouched."""
    configs = []
    for child in cluster.children:
        serve = child.argv.index("serve")
        stage = child.argv[serve + 1]
        config = stage_module(stage).parse_config(child.argv[serve + 2:], prog="qwen-serve up",
                                                  environ=cluster.child_environment(child))
        configs.append((child.name, stage, config))
    return configs


def _check_plan(configs: list[tuple[str, str, Any]], up: UpConfig) -> None:
    """Before starting anything: `up`'s own ports are free and each stage's start-up checks pass (ports, key
    and TLS files) for its first child, whose parsed config they are given."""
    check_port_free(up.host, up.grpc_port, "--grpc-port")
    check_port_free(up.host, up.port, "--port")
    checked: set[str] = set()
    for _name, stage, config in configs:
        if stage not in checked:
            stage_module(stage).check(config)
            checked.add(stage)
