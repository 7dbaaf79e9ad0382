"""The `qwen-serve` command: one entry point, subcommands dispatched to the modules that own them.

Each subcommand names a `module:function` taking the remaining argv and returning an exit code,
so importing the CLI stays cheap (no torch import just to print help).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from collections.abc import Iterable

from qwenserve import supervision

# subcommand -> (module:function, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("qwenserve.up:main", "run tokenizer, prefill, decode and router on loopback"),
    "generate": ("qwenserve.client:main", "stream an answer from a running router"),
    "status": ("qwenserve.status:main", "health and load of every stage, asked of a running router"),
    "tokens": ("qwenserve.tokenizer.cli:main", "count or show the tokens of a file"),
    "model": ("qwenserve.default_model:main", "write the built-in default checkpoint"),
    "operator": ("qwenserve_operator.main:main", "run the Kubernetes operator (kopf)"),
    "dev-cluster": ("qwenserve_devcluster.cli:main", "the operator's pods as a cluster on this machine (root)"),
    "bench": ("qwenserve.loadgen:main", "load generator and SLO report"),
    "usage": ("qwenserve.tenancy.cli:main", "per-tenant usage (requests and tokens)"),
}

# `qwen-serve serve <stage>`: the container entrypoint of each stage; the function takes the stage's checked config
# (qwenserve.stages), so the server module (and torch) is imported only once the flags and the host are fine.
STAGES: dict[str, str] = {
    "tokenizer": "qwenserve_services.tokenizer.server:start",
    "prefill": "qwenserve_services.prefill.server:start",
    "decode": "qwenserve_services.decode.server:start",
    "router": "qwenserve_services.router.server:start",
}


#: The modules each optional extra of pyproject.toml brings (tests/test_extras.py keeps the two equal).
EXTRAS: dict[str, tuple[str, ...]] = {
    "operator": ("kopf", "kubernetes"),
    "devcluster": ("kopf", "kubernetes", "kmock", "dnslib"),
}

# subcommand -> the extra it needs beyond a server install.
COMMAND_EXTRAS: dict[str, str] = {"operator": "operator", "dev-cluster": "devcluster"}


def missing_extra(command: str) -> str | None:
    """The one line saying which extra `command` lacks here, or None when its modules import (or it needs none)."""
    extra = COMMAND_EXTRAS.get(command)
    if extra is None:
        return None
    missing = [name for name in EXTRAS[extra] if not _importable(name)]
    if not missing:
        return None
    return (f"qwen-serve {command} needs the '{extra}' extra ({', '.join(missing)} not installed): "
            f"pip install 'qwen-serve[{extra}]'")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules, or a broken parent package
        return False


def _call(target: str, argument: object) -> int:
    """Import `module:function` and call it with `argument` (a command's argv, a stage's config)."""
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(argument) or 0)


def _usage() -> str:
    lines = ["usage: qwen-serve <command> [args...]", "", "commands:"]
    lines.append(f"  {'serve <stage>':<16} run one stage: {', '.join(STAGES)}")
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("")
    lines.append("`qwen-serve <command> --help` shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch `qwen-serve <command> ...`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from qwenserve import __version__

        print(f"qwen-serve {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        supervision.apply()  # started by `qwen-serve up`: die with it, at the priority it gave
        if rest and rest[0] in ("-h", "--help"):
            print(_serve_usage())
            return 0
        if not rest or rest[0] not in STAGES:
            given = f"unknown stage {rest[0]!r}{_did_you_mean(rest[0], STAGES)}; " if rest else ""
            print(f"qwen-serve serve: {given}give one of {', '.join(STAGES)}", file=sys.stderr)
            return 2
        return _serve(rest[0], rest[1:])
    if command not in COMMANDS:
        print(f"qwen-serve: unknown command {command!r}{_did_you_mean(command, [*COMMANDS, 'serve'])}; "
              "`qwen-serve --help` lists them", file=sys.stderr)
        return 2
    if (message := missing_extra(command)) is not None:
        print(message, file=sys.stderr)
        return 2
    return _call(COMMANDS[command][0], rest)


def _serve(stage: str, argv: list[str]) -> int:
    """Parse the stage's flags and check its host (model folder, ports, key files) once, with its light config
    module, before the server module imports torch (a mistake is one line within a second); then start the
    server with that config."""
    from qwenserve.stages.common import checked, stage_module

    config_module = stage_module(stage)
    config = checked(stage, config_module.parse_config(argv), config_module.check)  # a bad flag: one line, exit 2
    if config is None:
        return 1
    return _call(STAGES[stage], config)


def _serve_usage() -> str:
    lines = [f"usage: qwen-serve serve {{{','.join(STAGES)}}} [MODEL] [options]", "",
             "Run one stage (the container entrypoint); `qwen-serve serve STAGE --help` shows its options.",
             "Every flag also reads QWENSERVE_<FLAG> from the environment (--kv-cache-gb: QWENSERVE_KV_CACHE_GB)."]
    return "\n".join(lines)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


if __name__ == "__main__":
    sys.exit(main())
