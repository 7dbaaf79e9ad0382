"""Block pool accounting: reference counts, prefix hits, LRU eviction of unreferenced cached blocks."""

from __future__ import annotations

from qwenserve.engine.block_pool import BlockPool


def hashes_for(tokens: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    return BlockPool(num_blocks=1, block_size=block_size).chain_hashes(tokens, salt, len(tokens) // block_size)


def test_shared_blocks_are_reference_counted_and_evicted_least_recently_used_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = hashes_for([1, 2, 3, 4], 2), hashes_for([7, 8], 2)
    blocks_a = pool.allocate(2)
    for blk, h in zip(blocks_a, a, strict=True):
        pool.register(blk, h)
    shared = pool.lookup_prefix(a)
    assert shared == blocks_a and pool.ref_counts[blocks_a[0]] == 2
    pool.free(blocks_a)
    pool.free(shared)
    assert pool.num_used == 0 and pool.num_cached_free == 2
    blocks_b = pool.allocate(1)
    pool.register(blocks_b[0], b[0])
    pool.free(blocks_b)
    # One uncached block remains; the second allocation must evict a's tail (freed first = least recent).
    fresh = pool.allocate(2)
    assert blocks_a[1] in fresh and pool.lookup_prefix(a) == [blocks_a[0]]
    assert pool.lookup_prefix(b) == blocks_b


def test_different_salts_never_share():
    assert hashes_for([1, 2], 2, "x") != hashes_for([1, 2], 2, "y")
    assert hashes_for([1, 2, 3, 4], 2)[0] == hashes_for([1, 2, 9, 9], 2)[0]
    assert hashes_for([1, 2, 3, 4], 2)[1] != hashes_for([0, 2, 3, 4], 2)[1]  # chain: parent matters


def test_a_chain_continued_from_known_blocks_equals_the_chain_computed_at_once():
    pool, tokens = BlockPool(num_blocks=1, block_size=2), [5, 6, 7, 8, 9, 10, 11]
    first = pool.chain_hashes(tokens, "t", 1)
    assert first + pool.chain_hashes(tokens, "t", 3, known=first) == pool.chain_hashes(tokens, "t", 3)
    assert pool.chain_hashes(tokens, "t", 3, known=first) != pool.chain_hashes(tokens, "u", 3)[1:]


def _seq(rid: str, n: int, arrival: float):
    from qwenserve.engine.sampling_params import SamplingParams
    from qwenserve.engine.sequence import Sequence

    return Sequence(rid, n, list(range(n)), SamplingParams(), max_tokens=8, emit=lambda o: None, arrival_time=arrival)


def _first_step(policy: str) -> dict[str, int]:
    import time

    from qwenserve.engine.scheduler import Scheduler, SchedulerLimits

    pool = BlockPool(num_blocks=64, block_size=16)
    sched = Scheduler(SchedulerLimits(max_num_batched_tokens=128, max_num_seqs=8, admission_policy=policy), pool)
    now = time.monotonic()
    for rid, n in [("long-1", 400), ("long-2", 300), ("short", 20)]:
        sched.add(_seq(rid, n, now))
    plan = sched.schedule()
    return {s.seq.request_id: s.num_tokens for s in plan.scheduled}


def test_short_first_admits_a_short_prompt_ahead_of_long_ones_in_a_burst():
    assert _first_step("short_first") == {"short": 20, "long-2": 108}
    assert _first_step("fcfs") == {"long-1": 128}
