"""Megatron-Core 0.19's ``mamba_slot_allocator`` as a view of the hybrid's Mamba state
snapshots (context/mamba_slot_allocator.py): one store, 0.19's names over it."""

from __future__ import annotations

import pytest
import torch
from helpers import add, assert_same, make_ctx, snapshot
from test_prefix_cache import PROMPT, hybrid_ctx, req, step

PER_REQUEST = 4 * (6 * 4 + 2 * 3 * 5)   # fp32 conv (6, 4) + ssm (2, 3, 5), one Mamba layer


def _ctx(snapshots=3, **overrides):
    return hybrid_ctx(prefix_caching_mamba_gb=snapshots * PER_REQUEST / 1024 ** 3, **overrides)


def test_absent_without_a_budget_or_a_hybrid():
    assert hybrid_ctx().mamba_slot_allocator is None
    assert make_ctx(enable_prefix_caching=True).mamba_slot_allocator is None


def test_slots_are_the_snapshots_and_follow_the_blocks_digests():
    ctx = _ctx(prefix_caching_eviction_policy="ref_zero")
    msa, snaps = ctx.mamba_slot_allocator, ctx.prefix_cache.mamba
    assert msa.max_slots == snaps.count == 3 and msa.conv_states is snaps.conv
    add(ctx, req(1, PROMPT))      # 13 tokens: blocks 0..2 cached at the add
    blocks = ctx.block_table_host[0, :3].tolist()
    slots = msa.allocate_slots_batch([blocks[1], blocks[1], blocks[0]])
    assert slots[0] == slots[1] != slots[2] and msa.free_count == 1
    assert msa.block_to_slot[blocks].tolist() == [slots[2], slots[0], -1]
    assert msa.slot_to_block[slots[0]].item() == blocks[1]
    hashes = ctx.kv_block_allocator.block_hashes[blocks].tolist()
    assert msa.hash_to_block_id == {hashes[0]: blocks[0], hashes[1]: blocks[1]}
    msa.store_from_tensors(blocks[1], 0, torch.full((2, 3, 5), 4.0), torch.full((6, 4), 3.0))
    assert (snaps.ssm[0, slots[0]] == 4.0).all() and (snaps.conv[0, slots[0]] == 3.0).all()
    # The snapshot of block 1 is a hit's resume point for a request of the same prompt.
    assert ctx._find_mamba_match_count(req(2, PROMPT), 0, 3) == 2
    # "ref_zero": the blocks leave the cache at the request's end; their snapshots go too.
    step(ctx, keep=set())
    assert msa.free_count == 3 and msa.hash_to_block_id == {}
    assert msa.block_to_slot.max().item() == -1


def test_a_block_that_is_not_cached_gets_no_slot_and_nothing_changes():
    ctx = _ctx()
    add(ctx, req(1, PROMPT))
    partial = int(ctx.block_table_host[0, 3])          # the 13th token's block: not full
    before = snapshot(ctx)
    with pytest.raises(ValueError, match=f"block {partial} is not a cached prompt block"):
        ctx.mamba_slot_allocator.allocate_slots_batch([int(ctx.block_table_host[0, 0]),
                                                       partial])
    assert_same(before, snapshot(ctx))
    assert ctx.mamba_slot_allocator.free_count == 3


def test_extraction_plan_reaches_the_step_metadata_and_clears_at_the_update():
    ctx = _ctx()
    msa = ctx.mamba_slot_allocator
    msa.mamba_chunk_size = 4   # the chunk size a 0.19 model reads (4: one block)
    add(ctx, req(1, PROMPT))   # 13 tokens: the last full block ends at 12
    assert msa._intermediate_counts_cpu[0].item() == 1
    assert msa._intermediate_offsets_cpu[0, 0].item() == 12
    assert msa._intermediate_block_ids_cpu[0, 0].item() == ctx.block_table_host[0, 2]
    assert msa._eos_cache_block_id_cpu[0].item() == -1     # 13 is not a block boundary
    ctx.initialize_attention_state()
    meta = ctx.mamba_metadata
    assert meta.intermediate_count == 1 and meta.per_request_intermediate_counts == [1]
    # Chunk 3 of the request's 4 chunks of 4 tokens ends at token 12.
    assert meta.intermediate_chunk_indices.tolist() == [2]
    assert meta.intermediate_abs_positions.tolist() == [12]
    ctx.update_requests(torch.tensor([1]), torch.tensor([5]))
    assert msa._intermediate_counts_cpu.sum().item() == 0 and not msa._has_intermediates
    assert meta.intermediate_count == 0
