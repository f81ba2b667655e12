"""The update plan's simulation of the block allocator (``block_allocator.StackSimulation``, and
``AllocatorSimulation`` for the "lru" prefix caching policy): a plan decides on the stack as it
would be after its own releases and allocations, without touching the allocator, and the
commit then replays them. Any sequence of releases (of blocks held when the plan starts, each
reference once) and allocations must give the ids and free counts the allocator itself gives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynctx.context.block_allocator import AllocatorSimulation, BlockAllocator, StackSimulation

TOTAL, PAUSED = 14, 2


def start(held_counts, extra_refs):
    """An allocator with ``held_counts`` blocks taken per request (each an allocation) and
    ``extra_refs`` more references on some of them (shared blocks); the references held."""
    allocator = BlockAllocator(total_count=TOTAL, paused_count=PAUSED)
    held = []
    for count in held_counts:
        blocks = allocator.allocate_memory_blocks_host(min(count, allocator.total_avail))
        held += blocks.tolist()
    shared = [held[i % len(held)] for i in extra_refs] if held else []
    if shared:
        allocator.share(np.array(shared, dtype=np.int32))
    return allocator, held + shared


operation = st.one_of(st.tuples(st.just("allocate"), st.integers(0, 5)),
                      st.tuples(st.just("release"), st.lists(st.integers(0, 40), max_size=6)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), max_size=4), st.lists(st.integers(0, 40), max_size=4),
       st.lists(operation, max_size=12), st.booleans())
def test_the_simulation_gives_what_the_allocator_gives(held_counts, extra_refs, ops, lru):
    allocator, held = start(held_counts, extra_refs)
    before = (allocator.block_bag.copy(), allocator.ref_counts.copy(), allocator.total_avail)
    sim = AllocatorSimulation(allocator) if lru else StackSimulation(allocator)
    real = allocator.clone()
    for kind, arg in ops:
        if kind == "allocate":
            count = min(arg, real.total_avail)
            want = real.allocate_memory_blocks_host(count)
            got = sim.allocate(count)
            assert got.tolist() == want.tolist(), (kind, count)
        else:
            picks = sorted({i % len(held) for i in arg}, reverse=True) if held else []
            blocks = np.array([held.pop(i) for i in picks], dtype=np.int32)
            real.release_memory_blocks(blocks)
            sim.release(blocks)
        assert sim.total_avail == real.total_avail, (kind, arg)
    # The allocator itself is untouched: the commit replays the simulation's operations.
    assert np.array_equal(allocator.block_bag, before[0])
    assert np.array_equal(allocator.ref_counts, before[1])
    assert allocator.total_avail == before[2]
    replay = allocator.clone()
    for kind, arg in sim.ops:
        if kind == "allocate":
            replay.allocate_memory_blocks_host(arg)
        else:
            replay.release_memory_blocks(arg)
    assert replay.total_avail == real.total_avail
    assert np.array_equal(replay.block_bag[:replay.total_avail],
                          real.block_bag[:real.total_avail])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 6), max_size=6))
def test_the_lru_simulation_evicts_idle_cached_blocks_on_its_clone_only(cached, allocations):
    """Under "lru" idle cached blocks sit at the bottom of the free stack and an allocation that
    needs them evicts them: in a plan that happens on the simulation's clone, never on the
    allocator (its cached marks and its ``on_evict``, which would drop the cache's digests)."""
    allocator = BlockAllocator(total_count=TOTAL, paused_count=PAUSED)
    allocator.keeps_idle_blocks = True
    evicted = []
    allocator.on_evict = lambda blocks: evicted.append(blocks.tolist())
    blocks = allocator.allocate_memory_blocks_host(cached)
    allocator.cached[blocks] = True
    allocator.release_memory_blocks(blocks)          # idle cached blocks now
    assert allocator.idle_count == cached
    marks = allocator.cached.copy()
    sim, real = AllocatorSimulation(allocator), allocator.clone()
    real.on_evict = None
    for count in allocations:
        count = min(count, real.total_avail)
        assert sim.allocate(count).tolist() == real.allocate_memory_blocks_host(count).tolist()
        assert sim.total_avail == real.total_avail
    assert evicted == [] and np.array_equal(allocator.cached, marks)
    assert allocator.idle_count == cached
