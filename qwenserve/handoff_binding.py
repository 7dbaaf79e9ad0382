"""Handoff ids nobody can guess, and the token that binds a handoff to the one importer meant to have it.

The router makes a token per request and sends it to prefill (PrefillRequest.handoff_token) and, with the
handle, to the decode worker it picks after prefill (PrefilledStart.handoff_token). The exporter keeps it
with the handoff; KVTransfer Fetch and Release must present it. Ids appear in logs; tokens never do.
Torch-free, outside qwenserve.kv_transfer (whose package imports torch), since the router makes the tokens.
"""

from __future__ import annotations

import hmac
import secrets

#: Random bytes in a handoff id and in a token: 128 bits, beyond any guessing.
RANDOM_BYTES = 16
#: The longest token an exporter keeps (ours are 22 characters): a caller cannot make it hold more.
MAX_TOKEN_CHARS = 256


def new_handoff_id(request_id: str) -> str:
    """A fresh handoff id: the request id (for logs) and 128 random bits (what protects it)."""
    return f"{request_id}-{secrets.token_hex(RANDOM_BYTES)}"


def new_handoff_token() -> str:
    """A fresh secret to bind one request's handoff to."""
    return secrets.token_urlsafe(RANDOM_BYTES)


def refusal(bound_to: str, presented: str | None) -> str | None:
    """Why a caller presenting `presented` may not touch a handoff bound to `bound_to`: "missing", "wrong", or
    None when it may (an unbound handoff, or `presented` None: the exporter's own process, which needs none)."""
    if presented is None or not bound_to:
        return None
    if not presented:
        return "missing"
    # Constant time: a caller must not learn the token a byte at a time from how fast it is refused.
    return None if hmac.compare_digest(bound_to.encode(), presented.encode()) else "wrong"
