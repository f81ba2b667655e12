"""Block-allocator cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md
"Mutation testing"): under the "lru" policy, a step that releases block 0 (the stack hands it
out last, so only a full pool reaches it) gives it back like any other block."""

from __future__ import annotations

from helpers import add, check_invariants, make_ctx, request, step


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
