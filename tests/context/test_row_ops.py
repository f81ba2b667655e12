"""Megatron-Core 0.19's row operations by hand (context/row_ops.py):
``release_memory_blocks_from_request_indexes`` and ``evict_overflow_paused_requests``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, check_invariants, make_ctx, request, step

from dynctx.context import MambaInferenceStateConfig


def test_release_by_index_frees_the_rows_blocks_and_keeps_the_rest_of_the_rows():
    ctx = make_ctx()
    add(ctx, request(1, 9))
    add(ctx, request(2, 5))
    free = ctx.block_allocator.total_avail
    ctx.release_memory_blocks_from_request_indexes(torch.tensor([0]))
    assert ctx.block_allocator.total_avail == free + 3
    assert ctx.block_table_host[0].tolist() == [-1] * ctx.block_table_host.shape[1]
    assert ctx.block_table_host[1, :2].min() >= 0
    # 0.19: the row keeps its id and counts; the caller moves the counts next.
    assert ctx.request_ids[0].item() == 1 and ctx.request_kv_block_counts[0].item() == 3
    ctx.release_memory_blocks_from_request_indexes([])   # nothing to do
    assert ctx.block_allocator.total_avail == free + 3


def test_release_by_index_keeps_cached_blocks_under_lru_and_frees_the_mamba_slot():
    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                   mamba_inference_state_config=MambaInferenceStateConfig(
                       ["M", "*"], (6, 4), (2, 3, 5)), num_layers=2)
    tokens = torch.arange(10, 19)
    first = request(1, 9)
    first.prompt_tokens = first.remaining_prompt_tokens = tokens
    add(ctx, first)
    slots = ctx.mamba_metadata.mamba_state_free_slot_count
    ctx.release_memory_blocks_from_request_indexes([0])
    assert ctx.mamba_metadata.mamba_state_free_slot_count == slots + 1
    assert ctx.mamba_metadata.request_to_mamba_state_idx[0].item() == -1
    alloc = ctx.kv_block_allocator
    assert len(alloc.kv_hash_to_block_id) == 2 and alloc.idle_count == 2


def test_release_by_index_refuses_rows_holding_a_block_more_often_than_its_references():
    ctx = make_ctx()
    add(ctx, request(1, 5))
    add(ctx, request(2, 5))
    ctx.block_table_host[1, 0] = ctx.block_table_host[0, 0]   # a table written by hand
    before = ctx.block_allocator.total_avail, ctx.block_table_host.copy()
    with pytest.raises(RuntimeError, match="more often .* than they have references"):
        ctx.release_memory_blocks_from_request_indexes([0, 1])
    assert (ctx.block_allocator.total_avail, ctx.block_table_host.tolist()) == \
        (before[0], before[1].tolist())


def _paused_context():
    ctx = make_ctx(buffer_size_gb=10 * BLOCK / GIB, paused_buffer_size_gb=6 * BLOCK / GIB,
                   max_requests=8, max_tokens=64)
    for rid in range(1, 5):
        add(ctx, request(rid, 7, gen=40))
    for _ in range(12):
        step(ctx)
        if ctx.paused_request_count >= 2:
            return ctx
    raise AssertionError("the workload never paused two requests")


def test_evict_overflow_evicts_the_rightmost_paused_rows_and_moves_the_callers_tokens():
    ctx = _paused_context()
    paused, total = ctx.paused_request_count, ctx.total_request_count
    assert ctx.evict_overflow_paused_requests(total - paused, torch.zeros(total)) is None
    ids = ctx.host_request_ids().tolist()
    counts = ctx.kv_block_counts_host[:paused].tolist()
    ctx.block_allocator.paused_count = counts[0]    # a smaller paused budget, by hand
    free = ctx.block_allocator.total_avail
    next_tokens = torch.arange(total) * 10
    evicted = ctx.evict_overflow_paused_requests(total - paused, next_tokens).tolist()
    kept = paused - len(evicted)
    # The right-most paused rows go (the update's rule, docs/SEMANTICS.md §9.4).
    assert evicted and evicted == ids[kept:paused]
    assert ctx.paused_request_count == kept and ctx.total_request_count == total - len(evicted)
    assert ctx.block_allocator.total_avail == free + sum(counts[kept:])
    assert ctx.host_request_ids().tolist() == ids[:kept] + ids[paused:]
    # The caller's per-row tokens moved with the rows (0.19's swap of next_tokens).
    origin = [ids.index(i) for i in ctx.host_request_ids().tolist()]
    assert next_tokens[:len(origin)].tolist() == [10 * r for r in origin]
    check_invariants(ctx)
    step(ctx)
    check_invariants(ctx)
    assert np.all(ctx.kv_block_counts_host[:ctx.total_request_count] > 0)
