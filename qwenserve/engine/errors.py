"""Errors the engine raises, each with a message a caller can act on. Services map them to gRPC / HTTP
statuses once, at their edge: the RequestError family is the client's fault (INVALID_ARGUMENT / 400)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """The checkpoint folder cannot be loaded; `tensor` names the offending tensor when there is one."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class MaxModelLenError(EngineError, ValueError):
    """An explicit max_model_len is more than the model's positions or than one request can have of the KV cache:
    the engine does not start (a derived one is lowered instead)."""


class RequestError(EngineError, ValueError):
    """A request was rejected before it ran for a reason only this engine knows (its grammar backend, a KV
    import's layout, an id already in flight); what the model's limits refuse is a
    `qwenserve.request_limits.RequestOutOfLimits`."""


class DuplicateRequestError(RequestError):
    """A request with this id is already running."""


class EngineShutdownError(EngineError):
    """The engine has been shut down and takes no more requests."""


class EngineDeadError(EngineShutdownError):
    """The compute loop stopped on an internal fault: every request in flight ended with an error, no new one is
    taken, and the process serving this engine should exit so that it is restarted."""
