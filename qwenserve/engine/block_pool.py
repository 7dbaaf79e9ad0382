"""The KV block pool: allocation with reference counts, and automatic prefix caching.

A full block is identified by a chain hash of (parent block's hash, its token ids), with the request's
cache salt folded into the root, so equal prefixes under the same salt map to the same blocks. Blocks
whose reference count drops to zero stay in the cache (still hashed) until a new allocation needs them;
uncached free blocks are handed out first, then cached ones in least-recently-used order.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq


def _chain_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """Hash of a full block given its parent's hash: collisions would share wrong KV, so 128 bits."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def _root_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a sequence's first block: tenants with different salts never share blocks."""
    return hashlib.blake2b((cache_salt or "").encode(), digest_size=16, person=b"qwenserve-kv").digest()


class BlockPool:
    """Hands out block ids; knows which blocks hold which cached prefix."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (including cached ones that would be evicted)."""
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self.free_cached)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with reference count 1; evicts the least recently used cached blocks if needed."""
        if n > self.num_free:
            raise RuntimeError(f"block pool exhausted: asked for {n}, {self.num_free} free")  # scheduler checks first
        blocks = []
        for _ in range(n):
            if self.free_uncached:
                block = self.free_uncached.popleft()
            else:
                block, _ = self.free_cached.popitem(last=False)
                del self.cached[self.block_hash[block]]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Seq[int]) -> None:
        """Drop one reference to each block, tail first so a chain's last blocks are evicted first."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.free_cached[block] = None
                else:
                    self.free_uncached.append(block)

    def chain_hashes(
        self, token_ids: Seq[int], cache_salt: str | None, num_blocks: int, known: Seq[bytes] = ()
    ) -> list[bytes]:
        """The prefix-cache keys of a sequence's full blocks len(known) .. num_blocks-1, continuing the chain from
        `known` (the keys of its first blocks, already computed) or from the salt's root."""
        bs = self.block_size
        parent = known[-1] if known else _root_hash(cache_salt)
        hashes = []
        for b in range(len(known), num_blocks):
            parent = _chain_hash(parent, token_ids[b * bs : (b + 1) * bs])
            hashes.append(parent)
        return hashes

    def lookup_prefix(self, hashes: Seq[bytes]) -> list[int]:
        """The cached blocks for the longest run of `hashes` present, each now referenced once more."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free_cached[block]
            self.ref_counts[block] += 1
            hits.append(block)
        return hits

    def count_prefix_hits(self, hashes: Seq[bytes]) -> tuple[int, int]:
        """(cached blocks for the longest run of `hashes`, how many of them are currently unreferenced)
        without taking references: what admitting would cost."""
        if not self.enable_prefix_caching:
            return 0, 0
        hits = idle = 0
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits += 1
            idle += self.ref_counts[block] == 0
        return hits, idle

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that `block` (full, computed) holds the prefix `block_hash`; first writer wins."""
        if not self.enable_prefix_caching or block_hash in self.cached or self.block_hash[block] is not None:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
