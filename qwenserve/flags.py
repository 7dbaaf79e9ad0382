"""Command-line flags derived from configuration dataclasses, with `QWENSERVE_<FLAG>` environment fallbacks.

The one rule: a dataclass field declared with `option(...)` is the flag `--field-name` (or the `flag=` it names),
and that flag's environment fallback is `QWENSERVE_` + the flag's name, upper case, `-` as `_`
(`--kv-cache-gb` <-> `QWENSERVE_KV_CACHE_GB`). A flag given on the command line wins over its variable, the
variable over the field's default. A field declared with `nested(Cls)` contributes `Cls`'s options as flags of
the same parser (a stage's engine or front-door settings).

    @dataclass(frozen=True)
    class DecodeServiceConfig:
        port: int = option(50053, help="gRPC port")
        engine: EngineConfig = nested(EngineConfig)

    parser = StrictParser(prog="qwen-serve serve decode")
    add_options(parser, DecodeServiceConfig)
    config = parser.parse_config(DecodeServiceConfig, argv)

Parsers are strict (`StrictParser`): no abbreviations, and an unknown flag, a bad value or a bad variable ends
the process with one line on stderr (`prog: unknown flag --kv-cahce-gb (did you mean --kv-cache-gb?)`), exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any, NoReturn

ENV_PREFIX = "QWENSERVE_"
_OPTION = "qwenserve.option"
_NESTED = "qwenserve.nested"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class FlagError(ValueError):
    """A flag's or variable's value is unusable; the message names it and says what would do."""


def env_name(flag: str) -> str:
    """`--kv-transfer` -> `QWENSERVE_KV_TRANSFER`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class Option:
    """How a dataclass field appears on the command line (see `option`)."""

    help: str = ""
    flag: str | None = None  # default: --field-name
    aliases: tuple[str, ...] = ()  # other spellings of the flag (no variables of their own)
    choices: tuple[str, ...] | None = None
    env: bool = True  # False: no QWENSERVE_* fallback (the variable is read elsewhere, or not at all)
    secret: bool = False  # never printed; `qwen-serve up` hands it to a stage through its variable, not argv
    positional: bool = False  # also accepted as the optional positional argument (`serve STAGE [MODEL]`)
    type: Callable[[str], Any] | None = None  # default: from the field's annotation

    def flag_of(self, field_name: str) -> str:
        return self.flag or "--" + field_name.replace("_", "-")


def option(default: Any = MISSING, *, default_factory: Callable[[], Any] | Any = MISSING, help: str = "",
           flag: str | None = None, aliases: Sequence[str] = (), choices: Sequence[str] | None = None,
           env: bool = True, secret: bool = False, positional: bool = False,
           type: Callable[[str], Any] | None = None) -> Any:
    """A dataclass field that is also a command-line flag with an environment fallback."""
    spec = Option(help, flag, tuple(aliases), tuple(choices) if choices is not None else None, env, secret,
                  positional, type)
    return field(default=default, default_factory=default_factory, metadata={_OPTION: spec})


def nested(cls: type, **defaults: Any) -> Any:
    """A dataclass field holding another options dataclass, whose flags belong to the same parser; `defaults`
    replace some of `cls`'s own (a stage's engine gets less KV memory than the engine's default)."""
    return field(default_factory=functools.partial(cls, **defaults), metadata={_NESTED: (cls, defaults)})


@dataclass(frozen=True)
class FlagSpec:
    """One flag as derived from a field: its spelling, destination, type and default."""

    flag: str
    dest: str
    type: Callable[[str], Any]
    default: Any
    option: Option

    @property
    def is_bool(self) -> bool:
        return self.type is bool

    @property
    def env(self) -> str | None:
        return env_name(self.flag) if self.option.env else None


def option_specs(cls: type, defaults: Mapping[str, Any] | None = None) -> Iterator[FlagSpec]:
    """Every flag of `cls` (nested option dataclasses included), in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            inner, inner_defaults = f.metadata[_NESTED]
            yield from option_specs(inner, {**inner_defaults, **(defaults or {})})
            continue
        spec: Option | None = f.metadata.get(_OPTION)
        if spec is None:
            continue
        if defaults and f.name in defaults:
            default = defaults[f.name]
        elif f.default is not MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not MISSING else None
        yield FlagSpec(spec.flag_of(f.name), f.name, spec.type or _scalar(hints[f.name]), default, spec)


def _scalar(hint: Any) -> Callable[[str], Any]:
    """`int | None` -> int; `Literal["a", "b"]` -> str; plain types as they are."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _scalar(args[0])
    if typing.get_origin(hint) is typing.Literal:
        return type(typing.get_args(hint)[0])
    return hint


def convert(spec: FlagSpec, raw: str, source: str) -> Any:
    """`raw` as the flag's type; FlagError naming `source` (a flag or a variable) otherwise."""
    if spec.is_bool:
        value = raw.strip().lower()
        if value in _TRUE or value in _FALSE:
            return value in _TRUE
        raise FlagError(f"{source}={raw!r} is not a switch value; use 1/0, true/false, yes/no or on/off")
    try:
        converted = spec.type(raw)
    except (TypeError, ValueError):
        kind = getattr(spec.type, "__name__", "value")
        raise FlagError(f"{source}={raw!r} is not a valid {kind}") from None
    if spec.option.choices is not None and converted not in spec.option.choices:
        raise FlagError(f"{source}={raw!r} is not one of {', '.join(spec.option.choices)}")
    return converted


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser without abbreviations whose every error is one line (and exit status 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown(extras))
        return parsed

    def parse_config(self, cls: type, argv: Sequence[str] | None, **values: Any) -> Any:
        """Parse `argv` and build `cls` from the options `add_options` added; FlagError ends in one line."""
        args = self.parse_args(argv)
        try:
            return config_from_args(cls, args, **values)
        except FlagError as e:
            self.error(str(e))

    def unknown(self, extras: Sequence[str]) -> str:
        """The message for arguments nobody defines: the first unknown flag, with the closest known one."""
        flags = [e for e in extras if e.startswith("-") and e != "-"]
        if not flags:
            return f"unexpected argument {extras[0]!r}"
        flag = flags[0].split("=", 1)[0]
        known = sorted(set(self.known_flags()))
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else f" (`{self.prog} --help` lists the flags)"
        return f"unknown flag {flag}{hint}"

    def known_flags(self) -> Iterator[str]:
        """Every option string of this parser and of its subcommands."""
        for action in self._actions:
            yield from (s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    if isinstance(sub, StrictParser):
                        yield from sub.known_flags()

    def error(self, message: str) -> NoReturn:
        _console_error("%s: %s", self.prog, message)
        raise SystemExit(2)


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, *, default: Any = None,
             type: Callable[[str], Any] = str, help: str = "", choices: Sequence[str] | None = None,
             aliases: Sequence[str] = (), dest: str | None = None, env: bool = True, secret: bool = False,
             positional: bool = False, suppress: bool = False) -> None:
    """Add `flag` (and `aliases`); its default comes from `QWENSERVE_<FLAG>` when that is set.

    `suppress`: no default at all (the attribute exists only when given) and no variable: for a parser that
    passes what the user typed on to other processes (`qwen-serve up`). A bad variable is one line and exit 2.
    """
    dest = dest or flag.lstrip("-").replace("-", "_")
    spec = FlagSpec(flag, dest, type, default,
                    Option(help, flag, tuple(aliases), tuple(choices) if choices else None, env, secret, positional))
    _add(parser, spec, suppress)


def _add(parser: argparse.ArgumentParser | argparse._ArgumentGroup, spec: FlagSpec, suppress: bool,
         environ: Mapping[str, str] | None = None) -> None:
    opt, default = spec.option, spec.default
    variable = spec.env
    environ = os.environ if environ is None else environ
    if suppress:
        default = argparse.SUPPRESS
    elif variable is not None and variable in environ:
        try:
            default = convert(spec, environ[variable], variable)
        except FlagError as e:
            _fail(parser, f"{e} (the environment fallback of {spec.flag})")
    text = opt.help + (f" [env {variable}]" if variable else "")
    if opt.secret:
        text += " (secret: prefer the variable, argv is visible to other users)"
    names = [spec.flag, *opt.aliases]
    if opt.positional and not suppress:
        default = _Fallback(default)  # so that the positional argument wins over a variable or default
    if spec.is_bool:
        # BooleanOptionalAction reads any "--no-..." spelling as False, so negative names are plain switches.
        action: Any = "store_true" if spec.flag.startswith("--no-") else argparse.BooleanOptionalAction
        parser.add_argument(*names, dest=spec.dest, action=action,
                            default=default if default in (None, argparse.SUPPRESS) else bool(default), help=text)
    else:
        parser.add_argument(*names, dest=spec.dest, type=spec.type, default=default, choices=opt.choices,
                            metavar=_metavar(spec), help=text)
    if opt.positional:
        parser.add_argument(f"{spec.dest}_positional", nargs="?", metavar=spec.dest.upper(),
                            default=argparse.SUPPRESS if suppress else None,
                            help=f"the same as {spec.flag}")


@dataclass(frozen=True)
class _Fallback:
    """The default of a flag that also has a positional form: used only when neither was given."""

    value: Any

    def __str__(self) -> str:
        return str(self.value)


def _metavar(spec: FlagSpec) -> str:
    if spec.option.choices:
        return "{" + ",".join(spec.option.choices) + "}"
    return spec.flag.lstrip("-").replace("-", "_").upper()


def _fail(parser: argparse.ArgumentParser | argparse._ArgumentGroup, message: str) -> NoReturn:
    owner = getattr(parser, "error", None)
    if owner is not None:
        owner(message)
    _console_error("%s", message)
    raise SystemExit(2)


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                defaults: Mapping[str, Any] | None = None, suppress: bool = False,
                skip: Callable[[FlagSpec], bool] | None = None,
                environ: Mapping[str, str] | None = None) -> list[FlagSpec]:
    """Add a flag for every option of `cls` (see `add_flag` for `suppress`); flags the parser already has,
    or that `skip` refuses, are left out. The variables come from `environ` (default: this process's
    environment; another process's, for a command line built here). Returns the specs added."""
    added = []
    existing = parser._option_string_actions  # shared by a parser and its argument groups
    for spec in option_specs(cls, defaults):
        if spec.flag in existing or (skip is not None and skip(spec)):
            continue
        _add(parser, spec, suppress, environ)
        added.append(spec)
    return added


def config_from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """`cls` built from the parsed flags of its options (nested dataclasses too); `values` win."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif _NESTED in f.metadata:
            inner, inner_defaults = f.metadata[_NESTED]
            kwargs[f.name] = config_from_args(inner, args, **{k: v for k, v in inner_defaults.items()
                                                             if not hasattr(args, k)})
        elif _OPTION in f.metadata and hasattr(args, f.name):
            kwargs[f.name] = _positional_or_flag(f, args)
    return cls(**kwargs)


def _positional_or_flag(f: dataclasses.Field[Any], args: argparse.Namespace) -> Any:
    value = getattr(args, f.name)
    positional = getattr(args, f"{f.name}_positional", None)
    if isinstance(value, _Fallback):
        return value.value if positional is None else positional
    if positional is not None and value != positional:
        flag = f.metadata[_OPTION].flag_of(f.name)
        raise FlagError(f"{f.name.upper()} {positional!r} and {flag} {value!r} disagree; give one of them")
    return value


def config_from_env(cls: type, env: Mapping[str, str] | None = None, **overrides: Any) -> Any:
    """`cls` from its options' `QWENSERVE_*` variables (no command line), for code that builds a config itself
    (the load generator's in-process engine); `overrides` win. Raises FlagError for a bad variable."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for spec in option_specs(cls):
        if spec.env is not None and spec.env in env and spec.dest not in overrides:
            values[spec.dest] = convert(spec, env[spec.env], spec.env)
    return _build(cls, {**values, **overrides})


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            inner, inner_defaults = f.metadata[_NESTED]
            kwargs[f.name] = _build(inner, {**inner_defaults, **values})
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def argv_for(cls: type, values: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The command line (and, for secrets, the environment) that gives `cls`'s options these `values`
    (by field name; fields of `cls` not in `values` are left out). The inverse of parsing."""
    argv: list[str] = []
    env: dict[str, str] = {}
    for spec in option_specs(cls):
        if spec.dest not in values:
            continue
        value = values[spec.dest]
        if spec.option.secret and spec.env is not None:
            env[spec.env] = str(value)
        elif spec.is_bool:
            if spec.flag.startswith("--no-"):
                argv += [spec.flag] if value else []
            elif value is not None:
                argv.append(spec.flag if value else "--no-" + spec.flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [spec.flag, ",".join(str(v) for v in value)]
        elif value is not None:
            argv += [spec.flag, str(value)]
    return argv, env


def address_list(value: str) -> list[str]:
    """`host:port,host:port` -> list; empty string -> []."""
    return [a.strip() for a in value.split(",") if a.strip()]


def print_config(component: str, config: object) -> None:
    """Print a component's configuration once at start-up; secret options show as `***`."""
    from qwenserve.telemetry.logs import console  # here: importing the flags stays cheap

    console("%s config: %s", component, config_line(config), stderr=True)


def config_line(config: object) -> str:
    """`field=value ...` of a configuration on one line (nested ones in braces); secrets as `***`."""
    return " ".join(f"{k}={v}" for k, v in _printable(config).items())


def _console_error(message: str, *args: object) -> None:
    """One error line on stderr: the bare text, or a JSON record under JSON logs."""
    import logging

    from qwenserve.telemetry.logs import console, json_logs_requested  # here: importing the flags stays cheap

    if json_logs_requested():
        console(message, *args, level=logging.ERROR, stderr=True)
    else:  # the parse errors of a process whose logging is not set up yet: plain text, to stderr as it is now
        print(message % args, file=sys.stderr, flush=True)


def _printable(config: object) -> dict[str, Any]:
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return dict(vars(config))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.repr:  # left out of the dataclass's repr, so out of its line too (a router's per-model wiring)
            continue
        value = getattr(config, f.name)
        spec: Option | None = f.metadata.get(_OPTION)
        if spec is not None and spec.secret and value:
            value = "***"
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = "{" + ", ".join(f"{k}={v}" for k, v in _printable(value).items()) + "}"
        out[f.name] = value
    return out
