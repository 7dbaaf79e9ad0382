"""Prefix caching for hybrid models: their linear-attention state kept at prompt block boundaries.

A cached prefix of a dense model is its KV blocks. A hybrid model's linear-attention layers keep one state per
sequence instead, which a prefix hit cannot rebuild from blocks: the state after the prefix is needed too. So every
`interval` tokens (a whole number of KV blocks) the scheduler ends a prefill chunk, and the state the sequence
reached there is copied into a snapshot keyed by the prefix-cache hash of the block that ends at that token (the
chain hash names the whole prefix and the cache salt). A later prompt whose cached blocks reach such a boundary
resumes from the snapshot: its state slot is loaded from it and only the rest is computed.

Snapshots are a fixed number of state-sized entries allocated at start beside the state slots, reused least
recently used first. A snapshot outlives its blocks harmlessly: admission counts a hit only where both the KV
blocks and the snapshot at their end are present.
"""

from __future__ import annotations

from collections import OrderedDict

from qwenserve.kv_layout import LinearState
from qwenserve.models.linear_state import LinearStateCache


class StateSnapshots:
    """`capacity` snapshots of a hybrid model's linear-attention state, every `interval` tokens of a prompt."""

    def __init__(self, storage: LinearStateCache, interval: int) -> None:
        self.storage = storage
        self.interval = interval
        self.capacity = storage.conv.shape[1]
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # block hash -> entry, least recently used first
        self.saved = 0
        self.restored = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def save(self, key: bytes, state: LinearState) -> None:
        """Keep `state` (a sequence's slot, after the tokens `key` names) unless it is kept already."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if len(self._entries) < self.capacity:
            entry = len(self._entries)
        else:
            _, entry = self._entries.popitem(last=False)
        self.storage.load(entry, state)
        self._entries[key] = entry
        self.saved += 1

    def restore(self, key: bytes) -> LinearState:
        """The state kept under `key` (which must be present), now the most recently used."""
        self._entries.move_to_end(key)
        self.restored += 1
        return self.storage.slot(self._entries[key])
