"""What can go wrong when tokenizing, as types the service edge maps to INVALID_ARGUMENT or FAILED_PRECONDITION."""

from __future__ import annotations


class TokenizerError(Exception):
    """Base class of every tokenizer error."""


class InvalidInput(TokenizerError):
    """The caller sent something the tokenizer cannot accept; `field` names the part at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class ChatTemplateError(TokenizerError):
    """The chat template refused the conversation (raise_exception) or failed to render."""


class CheckpointError(TokenizerError):
    """A checkpoint folder lacks a file the tokenizer needs, or a file is malformed."""
