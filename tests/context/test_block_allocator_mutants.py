"""Block-allocator cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md
"Mutation testing"): under the "lru" policy, a step that releases block 0 (the stack hands it
out last, so only a full pool reaches it) gives it back like any other block, and a prefix hit
shares it like any other; an update whose plan fails takes back the cached marks the prefix
cache set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import add, assert_same, check_invariants, make_ctx, request, snapshot, step


def test_the_lru_plan_releases_block_0_like_any_other():
    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                   max_tokens=256, max_sequence_length=256, paused_buffer_size_gb=0)
    allocator = ctx.block_allocator
    add(ctx, request(1, 99))
    add(ctx, request(2, 56))           # 25 + 14 blocks: the whole pool, block 0 included
    assert allocator.total_avail == 0 and (ctx.block_table_host[:2] == 0).any()
    step(ctx, finished_ids=(1, 2))
    assert ctx.total_request_count == 0
    assert allocator.total_avail == allocator.total_count - 1
    check_invariants(ctx)


def test_a_prefix_hit_shares_block_0_like_any_other():
    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                   max_tokens=256, max_sequence_length=256, paused_buffer_size_gb=0)
    allocator = ctx.block_allocator
    add(ctx, request(1, 99))
    add(ctx, request(2, 56))           # 25 + 14 blocks: the whole pool, block 0 the first
    assert ctx.block_table_host[1, 0] == 0 and allocator.total_avail == 0
    same = request(2, 56)
    same.request_id = 3                # request 2's prompt: its 14 blocks shared, none taken
    add(ctx, same)
    assert ctx.block_table_host[2, :14].tolist() == ctx.block_table_host[1, :14].tolist()
    assert allocator.ref_counts[0] == 2
    check_invariants(ctx)


def test_an_update_that_fails_keeps_the_blocks_registered_at_add():
    """A prompt's full blocks are registered (cached marks included) at the ``add_request``
    that fills them (docs/SEMANTICS.md §17.3); an update whose plan raises changes nothing, so
    they stay registered, and the update run again keeps them."""
    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
    add(ctx, request(1, 13))                  # 3 full blocks of 4
    same = request(1, 13)
    same.request_id = 3                       # request 1's prompt
    assert ctx.prefix_cache_lookup(same) == 12
    assert ctx.block_allocator.cached[ctx.block_table_host[0, :3]].all()
    ctx.chunked_prefill_request_id = 1        # accepted: request 1 is the last row now
    add(ctx, request(2, 3))                   # ... and no longer
    ctx.initialize_attention_state()
    tokens = torch.tensor([7, 7])
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="chunked_prefill_request_id=1"):
        ctx.update_requests(torch.ones(2, dtype=torch.bool), tokens)
    assert_same(before, snapshot(ctx))
    assert ctx.prefix_cache_lookup(same) == 12
    assert ctx.block_allocator.cached[ctx.block_table_host[0, :3]].all()
    ctx.chunked_prefill_request_id = -1
    ctx.update_requests(torch.ones(2, dtype=torch.bool), tokens)
    assert ctx.prefix_cache_lookup(same) == 12
    check_invariants(ctx)


def test_forget_cached_takes_back_note_cached():
    """The base allocator's marks (``KVBlockAllocator`` adds 0.19's columns on top)."""
    from dynctx.context import BlockAllocator

    alloc = BlockAllocator(total_count=10, paused_count=2)
    blocks = np.array([3, 4, 7])
    alloc.note_cached(blocks, np.array([11, 12, 13]), np.array([-1, 3, 4]))
    assert np.flatnonzero(alloc.cached).tolist() == [3, 4, 7]
    alloc.forget_cached(np.array([4, 7]))
    assert np.flatnonzero(alloc.cached).tolist() == [3]
