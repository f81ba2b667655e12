"""The prefix cache's host tier (docs/SEMANTICS.md §21): cached blocks the device must reuse
spill to the host pool and a later hit copies them back, with digests, parents and 0.19's
columns consistent; the host pool's policy between spilled blocks and swapped requests; the
block budget of a hit that restores; hybrids' Mamba snapshots; the option on and off (its
bad values: test_error_snapshots.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, assert_same, check_invariants, make_ctx, snapshot

from dynctx.context import (
    BlockOverflowError,
    DynamicInferenceRequest,
    MambaInferenceStateConfig,
    SamplingParams,
)
from dynctx.context.prefix_cache import chain_links

BS = 4
A = list(range(10, 23))          # 13 tokens: 3 full blocks
B = list(range(300, 313))


def req(rid, tokens, gen=4, **sampling):
    return DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(tokens),
                                   sampling_params=SamplingParams(num_tokens_to_generate=gen,
                                                                  **sampling))


def tier_ctx(device_blocks=12, host_blocks=8, policy="lru", **overrides):
    args = dict(enable_prefix_caching=True, prefix_caching_eviction_policy=policy,
                buffer_size_gb=device_blocks * BLOCK / GIB, paused_buffer_size_gb=2 * BLOCK / GIB,
                kv_offload_gb=host_blocks * BLOCK / GIB)
    args.update(overrides)
    return make_ctx(**args)


def step(ctx, keep=None):
    ctx.initialize_attention_state()
    P, T = ctx.paused_request_count, ctx.total_request_count
    ids = ctx.host_request_ids()[P:T].tolist()
    mask = torch.tensor([keep is None or i in keep for i in ids], dtype=torch.bool)
    ctx.update_requests(mask, torch.tensor([7] * len(ids)))


def run_once(ctx, rid, tokens):
    """Add a request, step it once and finish it: its full prompt blocks are cached, idle."""
    add(ctx, req(rid, tokens))
    step(ctx, keep=set())


def mark_blocks(ctx):
    """Write a distinct value into every cached block; returns digest -> its bytes."""
    buffer = ctx.memory_buffer
    content = {}
    for digest, (block, _, _) in ctx.prefix_cache.entries.items():
        buffer[:, :, block] = float(block) + 0.25
        content[digest] = buffer[:, :, block].clone()
    return content


def fill_device(ctx, count=None):
    """Take ``count`` free blocks (default all) and give them back: the allocator hands out
    the idle cached blocks last, least recently released first (they spill)."""
    alloc = ctx.block_allocator
    taken = alloc.allocate_memory_blocks(alloc.total_avail if count is None else count)
    alloc.release_memory_blocks(taken)


def check_columns(ctx):
    """The digest table, the cached marks and 0.19's columns agree (as the state machine's
    check_prefix_cache), and every host slot is free or owned once."""
    alloc, cache = ctx.block_allocator, ctx.prefix_cache
    cached = sorted(b for b, _, _ in cache.entries.values())
    assert np.flatnonzero(alloc.cached).tolist() == cached
    assert np.array_equal(alloc.hash_ids != -1, alloc.cached)
    parents = alloc.parent_ids[alloc.parent_ids >= 0]
    assert np.array_equal(np.bincount(parents, minlength=alloc.total_count), alloc.child_counts)
    tier = ctx._parts.offload.tier
    assert not set(tier.blocks) & set(cache.entries)
    ctx._parts.offload.check()
    check_invariants(ctx)


def test_spilled_blocks_come_back_with_their_bytes_digests_and_parents():
    ctx = tier_ctx()
    run_once(ctx, 1, A)
    links = chain_links(np.array(A), BS)
    content = mark_blocks(ctx)
    hashes = {d: int(ctx.block_allocator.hash_ids[b]) for d, (b, _, _) in
              ctx.prefix_cache.entries.items()}
    fill_device(ctx)
    tier = ctx._parts.offload.tier
    # A's three blocks left the device for the host, their chain intact, least recently used
    # first: the tail (dropped first when the host needs room).
    assert list(tier.blocks) == [d for d, _, _ in reversed(links)]
    for digest, parent, data in links:
        entry = tier.blocks[digest]
        assert (entry.parent, entry.data, entry.hash) == (parent, data, hashes[digest])
        assert torch.equal(ctx._parts.offload.pool.kv[entry.slot], content[digest])
        assert digest not in ctx.prefix_cache.entries
    check_columns(ctx)
    again = req(3, A)
    assert ctx.prefix_cache_lookup(again) == 12
    add(ctx, again)
    row = ctx.host_request_ids().tolist().index(3)
    assert int(ctx.request_kv_length_offsets[row]) == 12
    blocks = ctx.block_table_host[row, :3].tolist()
    for (digest, parent, _), block in zip(links, blocks):
        assert ctx.prefix_cache.entries[digest][0] == block
        assert torch.equal(ctx.memory_buffer[:, :, block], content[digest])
        assert int(ctx.block_allocator.hash_ids[block]) == hashes[digest]
    # 0.19's parents: each restored block's parent is the previous block of the chain.
    assert ctx.block_allocator.parent_ids[blocks].tolist() == [-1, blocks[0], blocks[1]]
    assert not set(d for d, _, _ in links) & set(tier.blocks)
    stats = ctx.get_kv_offload_stats()
    assert stats["kv_offload_prefix_restored_blocks"] == 3
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks_matched"] == 3
    check_columns(ctx)
    step(ctx)
    check_columns(ctx)


def test_a_chain_partly_on_the_device_partly_on_the_host():
    """Only the blocks the device reused spill: a hit matches the device head and restores
    the host tail (and the allocator's least recently used blocks are a chain's tail)."""
    ctx = tier_ctx(device_blocks=12)
    run_once(ctx, 1, A)
    mark_blocks(ctx)   # (the buffer starts uninitialised: NaN bits would never compare equal)
    # Every uncached free block and one more: one idle block (A's tail) is reused.
    fill_device(ctx, ctx.block_allocator.total_avail - 3 + 1)
    tier = ctx._parts.offload.tier
    links = chain_links(np.array(A), BS)
    assert list(tier.blocks) == [links[2][0]]
    content = tier.blocks[links[2][0]]
    before = ctx._parts.offload.pool.kv[content.slot].clone()
    add(ctx, req(3, A))
    row = ctx.host_request_ids().tolist().index(3)
    tail = int(ctx.block_table_host[row, 2])
    assert torch.equal(ctx.memory_buffer[:, :, tail], before)
    assert ctx.get_prefix_cache_stats()["prefix_cache_prefill_skipped_tokens"] == 12
    check_columns(ctx)


def test_a_full_host_pool_keeps_the_chain_heads_and_drops_the_least_recently_used():
    ctx = tier_ctx(host_blocks=2)
    run_once(ctx, 1, A)
    fill_device(ctx)
    tier = ctx._parts.offload.tier
    a = [d for d, _, _ in chain_links(np.array(A), BS)]
    assert set(tier.blocks) == set(a[:2])          # the head blocks; the tail did not fit
    assert ctx.get_kv_offload_stats()["kv_offload_prefix_unspilled_blocks"] == 1
    assert ctx.prefix_cache_lookup(req(3, A)) == 8
    check_columns(ctx)
    run_once(ctx, 3, B)                             # B's blocks are cached, idle
    fill_device(ctx)            # B's spill drops A's, oldest first
    b = [d for d, _, _ in chain_links(np.array(B), BS)]
    assert set(tier.blocks) == set(b[:2])
    assert ctx.get_kv_offload_stats()["kv_offload_prefix_dropped_blocks"] == 2
    assert ctx.prefix_cache_lookup(req(5, A)) == 0 and ctx.prefix_cache_lookup(req(5, B)) == 8
    check_columns(ctx)


def test_the_block_budget_counts_a_block_per_restored_block():
    ctx = tier_ctx()
    run_once(ctx, 1, A)
    fill_device(ctx)
    again = req(3, A)
    alloc = ctx.block_allocator
    # The hit restores three blocks into new ones, and its last token needs a fourth.
    hog = alloc.allocate_memory_blocks(alloc.total_avail - 3)
    assert ctx.check_availability(again) == (True, True, False)
    before = snapshot(ctx, device=True)
    tier = dict(ctx._parts.offload.tier.blocks)
    with pytest.raises(BlockOverflowError, match="needs 4 blocks, 3 free .3 of them cached "
                       "blocks it revives or restores from the host"):
        ctx.add_request(again)
    assert_same(before, snapshot(ctx, device=True))
    assert ctx._parts.offload.tier.blocks == tier
    alloc.release_memory_blocks(hog[:1])
    assert ctx.check_availability(again) == (True, True, True)
    add(ctx, again)
    assert ctx.get_kv_offload_stats()["kv_offload_prefix_restored_blocks"] == 3


def test_ref_zero_spills_at_the_last_release():
    ctx = tier_ctx(policy="ref_zero")
    run_once(ctx, 1, A)
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 0
    tier = ctx._parts.offload.tier
    assert len(tier.blocks) == 3
    add(ctx, req(2, A))
    assert ctx.get_kv_offload_stats()["kv_offload_prefix_restored_blocks"] == 3
    check_columns(ctx)


def test_swaps_drop_spilled_blocks_before_any_swapped_request():
    """The host pool's policy: a swap drops spilled prefix blocks (least recently used first)
    for room, and only then the oldest swapped requests."""
    ctx = tier_ctx(device_blocks=16, host_blocks=4, max_tokens=64)
    run_once(ctx, 90, A)
    fill_device(ctx)
    tier, offload = ctx._parts.offload.tier, ctx._parts.offload
    assert len(tier.blocks) == 3
    rid, evicted = 0, []
    for _ in range(40):
        while ctx.total_request_count < 8 and ctx.paused_request_count == 0:
            rid += 1
            r = req(rid, [1000 + 13 * rid + i for i in range(6)], gen=30)
            if not all(ctx.check_availability(r)):
                break
            add(ctx, r)
        step(ctx)
        evicted += ctx.evicted_request_ids.tolist()
        if evicted:
            break
    assert evicted and set(evicted) <= set(offload.entries)
    stats = ctx.get_kv_offload_stats()
    assert stats["kv_offload_prefix_dropped_blocks"] > 0
    assert stats["kv_offload_dropped_requests"] == 0
    check_columns(ctx)


def test_a_block_computed_again_while_on_the_host_stays_private():
    """A request that matches nothing (it wants every prompt log prob) computes a chain whose
    blocks are on the host: its blocks are not published (a digest lives in one tier)."""
    ctx = tier_ctx()
    run_once(ctx, 1, A)
    fill_device(ctx)
    tier = ctx._parts.offload.tier
    held = dict(tier.blocks)
    add(ctx, req(3, A, return_log_probs=True))
    step(ctx, keep=set())
    assert tier.blocks == held
    assert not set(held) & set(ctx.prefix_cache.entries)
    check_columns(ctx)


def test_resets_and_suspends():
    ctx = tier_ctx()
    run_once(ctx, 1, A)
    fill_device(ctx)
    tier = ctx._parts.offload.tier
    ctx.reset(preserve_prefix_cache=True)           # the tier is the prefix cache's: kept
    assert len(tier.blocks) == 3 and ctx.prefix_cache_lookup(req(3, A)) == 12
    ctx._parts.offload.check()
    ctx.reset()
    assert not tier.blocks and ctx.prefix_cache_lookup(req(3, A)) == 0
    ctx._parts.offload.check()
    run_once(ctx, 1, A)
    fill_device(ctx)
    ctx.deallocate_all_tensors()                    # "recompute": the host copies go too
    ctx.allocate_all_tensors(is_init=False)
    assert not tier.blocks
    ctx._parts.offload.check()


def test_0_19_prefix_match_counts_host_blocks_as_blocks_from_the_pool():
    ctx = tier_ctx()
    run_once(ctx, 1, A)
    fill_device(ctx)
    matched, from_pool, already, overall, skip, chunk = ctx._compute_prefix_match(req(3, A), 13)
    assert matched == [-1, -1, -1] and (from_pool, already, overall) == (4, 0, 4)
    assert (skip, chunk) == (12, 1)
    assert ctx._find_kv_match_count(req(3, A), 0, 3) == ([], 0)


def test_host_tier_off_and_on():
    off = tier_ctx(prefix_caching_host_tier=False)
    assert off._parts.offload.tier is None and off.prefix_cache.tier is None
    run_once(off, 1, A)
    fill_device(off)
    assert off.prefix_cache_lookup(req(3, A)) == 0
    assert "kv_offload_prefix_spilled_blocks" not in off.get_kv_offload_stats()
    # In OFFLOAD mode the default pool serves the tier when asked.
    on = tier_ctx(kv_offload_gb=0, kv_cache_management_mode="offload",
                  prefix_caching_host_tier=True)
    assert on._parts.offload.tier is not None
    assert tier_ctx(kv_offload_gb=0, kv_cache_management_mode="offload")._parts.offload.tier \
        is None


# ---------------------------------------------------------------- hybrids
CONV, SSM = (6, 4), (2, 3, 5)
STATE_BYTES = 4 * (6 * 4 + 2 * 3 * 5)


def hybrid_tier_ctx(**overrides):
    return tier_ctx(num_layers=2, prefix_caching_mamba_gb=STATE_BYTES / GIB,
                    mamba_inference_state_config=MambaInferenceStateConfig(("M", "*"), CONV,
                                                                           SSM),
                    kv_offload_gb=8 * (BLOCK + STATE_BYTES) / GIB, **overrides)


def hybrid_run(ctx, rid, tokens, value):
    """Run a 12-token prompt; its Mamba state after it is ``value`` (snapshotted: 3 blocks)."""
    add(ctx, req(rid, tokens))
    ctx.initialize_attention_state()
    slot = int(ctx.mamba_metadata.request_to_mamba_state_idx[ctx.total_request_count - 1])
    conv, ssm = ctx.mamba_states_cache(1)
    conv[slot].fill_(value)
    ssm[slot].fill_(value + 0.5)
    ctx.update_requests(torch.tensor([False]), torch.tensor([7]))


def test_hybrid_snapshots_spill_and_come_back_with_their_blocks():
    ctx = hybrid_tier_ctx()
    snaps, tier = ctx.prefix_cache.mamba, ctx._parts.offload.tier
    assert snaps.count == 1 and ctx._parts.offload.pool.states.count >= 2
    hybrid_run(ctx, 1, A[:12], 3.0)
    hybrid_run(ctx, 2, B[:12], 5.0)             # the one device snapshot is B's: A's spills
    a3 = chain_links(np.array(A), BS)[2][0]
    assert list(tier.snapshots) == [a3] and a3 not in snaps.index
    fill_device(ctx)                          # A's blocks spill too, and B's
    b3 = chain_links(np.array(B), BS)[2][0]
    assert a3 in tier.blocks and b3 in tier.blocks
    # A snapshot goes with its block (0.19's slot does): B's spilled along with B's blocks.
    assert list(tier.snapshots) == [a3, b3] and not snaps.index
    assert ctx.prefix_cache_lookup(req(4, A)) == 12
    add(ctx, req(4, A))
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="hybrid"):  # the hit resumes: it is the continuation
        ctx.add_request(req(5, [1, 2, 3]))
    assert_same(before, snapshot(ctx))
    ctx.initialize_attention_state()
    meta = ctx.mamba_metadata
    slot = int(meta.request_to_mamba_state_idx[ctx.total_request_count - 1])
    assert meta.batch_indices_chunked_prefill.tolist() == [slot]
    conv, ssm = ctx.mamba_states_cache(1)
    assert bool((conv[slot] == 3.0).all()) and bool((ssm[slot] == 3.5).all())
    stats = ctx.get_kv_offload_stats()
    assert stats["kv_offload_prefix_restored_snapshots"] == 1
    assert stats["kv_offload_prefix_restored_blocks"] == 3
    assert list(tier.snapshots) == [b3, a3]      # the host copy stays, most recently used
    ctx._parts.offload.check()
    # Room for a swap: the least recently used spilled snapshot goes, its state slot freed.
    pool = ctx._parts.offload.pool
    free = pool.free_states
    assert tier.drop_states(1) == 1
    assert list(tier.snapshots) == [a3] and pool.free_states == free + 1
    assert ctx.get_kv_offload_stats()["kv_offload_prefix_dropped_snapshots"] == 1
    ctx._parts.offload.check()


def test_a_restored_request_publishes_its_blocks():
    """A request swapped back from the host (KV offload) publishes its full blocks, the
    generated tokens' among them, as it computes past them; its restore is no cache lookup."""
    ctx = tier_ctx(device_blocks=16, host_blocks=32, max_tokens=64)
    rid, evicted, requests = 0, [], {}
    for _ in range(40):
        while ctx.total_request_count < 8 and ctx.paused_request_count == 0:
            rid += 1
            requests[rid] = [1000 + 13 * rid + i for i in range(6)]
            r = req(rid, requests[rid], gen=30)
            if not all(ctx.check_availability(r)):
                break
            add(ctx, r)
        step(ctx)
        evicted += ctx.evicted_request_ids.tolist()
        if evicted:
            break
    assert evicted
    while ctx.total_request_count:   # room for it: every request finishes
        step(ctx, keep=set())
    entry = ctx._parts.offload.entries[evicted[0]]
    # The engine re-adds it with its prompt and generated tokens (7 each step here).
    prompt = requests[evicted[0]] + [7] * (entry.tokens + 1 - 6)
    lookups = ctx.get_prefix_cache_stats()["prefix_cache_lookups"]
    add(ctx, req(evicted[0], prompt))
    assert ctx.get_kv_offload_stats()["kv_offload_restored_tokens"] == entry.tokens
    assert ctx.get_prefix_cache_stats()["prefix_cache_lookups"] == lookups
    step(ctx)
    links = chain_links(np.array(prompt), BS)
    row = ctx.host_request_ids().tolist().index(evicted[0])
    held = ctx.block_table_host[row, :len(links)].tolist()
    for (digest, _, _), block in zip(links, held):
        assert digest in ctx.prefix_cache.entries
    # Its blocks past the first (which the first incarnation had published) are its own.
    assert [ctx.prefix_cache.entries[d][0] for d, _, _ in links[1:]] == held[1:]
    assert ctx.prefix_cache_lookup(req(99, prompt + [5])) == len(links) * BS
    check_columns(ctx)
