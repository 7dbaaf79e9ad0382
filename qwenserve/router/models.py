"""Several models behind one router: which deployment answers a request.

Each served name is one model deployment with its own tokenizer, prefill and decode workers (its own
`Router`). A request names a model (or gets the default); its tenant may be limited to some models;
a model may send a share of tenants to a canary (a stable hash of the tenant, or of the request's
`user` when the tenant is the shared default, so a tenant always sees the same version); and a model
whose decode workers are all unavailable (none found, or every circuit open) hands its requests to its
fallback, which the answer's `model` field names and `qwenserve_router_fallbacks_total` counts. A request
admitted to the primary whose workers then fail it before its first token (a retryable error: they died
since the last look) is handed over too, so the first request after a failure is not lost; so is one whose decode
worker is stopped (it sends no headers within --accept-timeout-s, and a model with a fallback holds back the
prefill's first token until a decode worker has taken the call). Once a worker
of the primary is back (its circuit closes), the primary answers again. A fallback must share its
primary's vocabulary: the prompt is tokenized once.

The models file (`--models-file`):

    default: qwen3-8b                  # optional; else the first
    models:
      - name: qwen3-8b                 # the name clients send as `model`
        model: /models/Qwen3-8B        # its checkpoint folder (tokenizer, config); default: the built-in
        tokenizer: qwen3-8b-tokenizer:50051
        prefill: [qwen3-8b-prefill:50052]
        decode: [qwen3-8b-decode:50053]
        fallback: qwen3-1.7b           # optional
        canary: {model: qwen3-8b-next, percent: 10}   # optional
        stage_secret_file: /etc/qwen-serve/stage-secrets/qwen3-8b/secret   # optional; default --stage-secret-file
      - name: qwen3-1.7b
        ...
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenserve.config_file import read_yaml
from qwenserve.router.errors import ModelNotAllowed, UnknownModel
from qwenserve.untrusted_input import echo
from qwenserve.v1 import common_pb2, router_pb2


class ModelsConfigError(ValueError):
    """The models file is malformed; the message says where."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One served model: where its stages are, and where its requests may go instead."""

    name: str
    tokenizer: str
    decode: tuple[str, ...]
    prefill: tuple[str, ...] = ()
    model: str | None = None
    fallback: str | None = None
    canary: str | None = None
    canary_percent: float = 0.0
    stage_secret_file: str | None = None  # its stages' deployment secret, when not the router's own


@dataclass(frozen=True, slots=True)
class ModelsConfig:
    entries: tuple[ModelEntry, ...]
    default: str


def _addresses(raw: object, where: str) -> tuple[str, ...]:
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(a, str) and a for a in items):
        raise ModelsConfigError(f"{where}: expected host:port or a list of them")
    return tuple(a.strip() for item in items for a in item.split(",") if a.strip())


def parse_models(data: object, where: str) -> ModelsConfig:
    """A decoded models file, checked: names unique, fallbacks and canaries among them, no cycle."""
    if not isinstance(data, Mapping) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ModelsConfigError(f"{where}: expected {{models: [{{name, tokenizer, decode, ...}}, ...]}}")
    if set(data) - {"models", "default"}:
        raise ModelsConfigError(f"{where}: unknown field(s) {sorted(set(data) - {'models', 'default'})}")
    entries: list[ModelEntry] = []
    known = {"name", "model", "tokenizer", "prefill", "decode", "fallback", "canary", "stage_secret_file"}
    for i, raw in enumerate(data["models"]):
        here = f"{where}: models[{i}]"
        if not isinstance(raw, Mapping) or set(raw) - known:
            raise ModelsConfigError(f"{here}: expected a mapping of {sorted(known)}")
        name, tokenizer = raw.get("name"), raw.get("tokenizer")
        if not isinstance(name, str) or not name or not isinstance(tokenizer, str) or not tokenizer:
            raise ModelsConfigError(f"{here}: name and tokenizer are required")
        canary, percent = None, 0.0
        if raw.get("canary") is not None:
            spec = raw["canary"]
            if not isinstance(spec, Mapping) or not isinstance(spec.get("model"), str) or \
                    not isinstance(spec.get("percent"), int | float) or not 0 <= spec["percent"] <= 100:
                raise ModelsConfigError(f"{here}.canary: expected {{model: NAME, percent: 0..100}}")
            canary, percent = spec["model"], float(spec["percent"])
        fallback = raw.get("fallback")
        if fallback is not None and not isinstance(fallback, str):
            raise ModelsConfigError(f"{here}.fallback: expected a model name")
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            raise ModelsConfigError(f"{here}.model: expected a checkpoint folder")
        secret_file = raw.get("stage_secret_file")
        if secret_file is not None and not isinstance(secret_file, str):
            raise ModelsConfigError(f"{here}.stage_secret_file: expected a file path")
        entries.append(ModelEntry(name, tokenizer, _addresses(raw.get("decode"), f"{here}.decode"),
                                  _addresses(raw.get("prefill") or [], f"{here}.prefill"), model, fallback, canary,
                                  percent, secret_file))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ModelsConfigError(f"{where}: a model name appears twice")
    for e in entries:
        for other in (e.fallback, e.canary):
            if other is not None and (other not in names or other == e.name):
                raise ModelsConfigError(f"{where}: {e.name} names {other!r}, which is no other model here")
    default = data.get("default", names[0])
    if default not in names:
        raise ModelsConfigError(f"{where}: default {default!r} is none of the models")
    return ModelsConfig(tuple(entries), default)


def load_models_file(path: str | Path) -> ModelsConfig:
    return parse_models(read_yaml(path, "models file", ModelsConfigError), str(path))


def canary_share(key: str, model: str) -> float:
    """Where `key` (a tenant or user) falls in [0, 100) for `model`'s canary: stable across restarts and
    routers, independent between models."""
    digest = hashlib.blake2b(f"{model}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 1_000_000 / 10_000


@dataclass
class ModelRoutes:
    """The models one router serves, by name, and the choice of which one answers a request."""

    routers: Mapping[str, Any]  # name -> generation.Router
    default: str
    entries: Mapping[str, ModelEntry] = field(default_factory=dict)
    on_fallback: Any = None  # called with (model, fallback) when a request is handed over

    @property
    def names(self) -> list[str]:
        return list(self.routers)

    def choose(self, requested: str | None, allowed: Iterable[str] | None = None,
               key: str = "") -> tuple[str, Any]:
        """(served name, its router) for a request naming `requested` (None: the default), from a tenant
        limited to `allowed` (None: any), split by `key` for canaries."""
        name = self.default if requested is None else requested
        if name not in self.routers:
            raise UnknownModel(f"the model {echo(name)} does not exist; this server serves {', '.join(self.routers)}",
                               "model")
        allowed_set = None if allowed is None else set(allowed)
        if allowed_set is not None and name not in allowed_set:
            raise ModelNotAllowed(f"this API key may not use the model {echo(name)}", "model")
        entry = self.entries.get(name)
        if entry is not None and entry.canary and canary_share(key, name) < entry.canary_percent:
            if allowed_set is None or entry.canary in allowed_set:
                name = entry.canary
                entry = self.entries.get(name)
        if not self.routers[name].fleet.can_serve():
            fallback = self._fallback(name, allowed_set)
            if fallback is not None:
                self._note_fallback(name, fallback)
                name = fallback
            elif self._fallback(name, None) is not None:  # one would answer, but not for this key: say so
                raise ModelNotAllowed(
                    f"the model {echo(name)} has no decode worker available now, and this API key may not use its "
                    f"fallback {echo(self.entries[name].fallback or '')}", "model")
        return name, self.routers[name]

    async def run(self, name: str, prep: Any, allowed: Iterable[str] | None = None
                  ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """`name`'s answer to a prepared request, from its fallback when the primary fails it before the first
        token with a retryable error; the fallback's first message names it in `model`."""
        allowed_set = None if allowed is None else set(allowed)
        fallback = None
        async with contextlib.aclosing(self.routers[name].run(prep)) as stream:
            first = True
            async for msg in stream:
                if first and _failed_before_start(msg):
                    fallback = self._fallback(name, allowed_set)
                    if fallback is not None:
                        break
                first = False
                yield msg
        if fallback is None:
            return
        self._note_fallback(name, fallback)
        async with contextlib.aclosing(self.routers[fallback].run(prep)) as stream:
            first = True
            async for msg in stream:
                if first:
                    msg.model, first = fallback, False
                yield msg

    def _fallback(self, name: str, allowed: set[str] | None) -> str | None:
        """`name`'s fallback if it can serve and the tenant may use it."""
        entry = self.entries.get(name)
        fallback = entry.fallback if entry is not None else None
        if fallback is None or not self.routers[fallback].fleet.can_serve():
            return None
        return fallback if allowed is None or fallback in allowed else None

    def _note_fallback(self, name: str, fallback: str) -> None:
        if self.on_fallback is not None:
            self.on_fallback(name, fallback)

    def single(self) -> bool:
        return len(self.routers) == 1


def _failed_before_start(msg: router_pb2.GenerateResponse) -> bool:
    """A first message that ends the answer with a retryable error and no token: nothing reached the client."""
    return (msg.finish_reason == common_pb2.FINISH_REASON_ERROR and not msg.token_ids and not msg.text
            and msg.error.retryable)

