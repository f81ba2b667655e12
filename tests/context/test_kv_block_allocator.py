"""``KVBlockAllocator`` (Megatron-Core 0.19's allocator, docs/SEMANTICS.md §16 row 43) over the
context's own state: its 0.19 names are views of the allocator's arrays, the prefix cache
publishes 0.19's hashes and parents with each block, and every eviction clears them. 0.19's own
tests of the class, standalone over a duck-typed context, are ported in
``tests/megatron019/test_mcore019_kv_block_allocator.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, make_ctx

from dynctx.context import (
    BlockAllocator,
    ConfigAssertionError,
    DynamicInferenceRequest,
    KVBlockAllocator,
    SamplingParams,
    compute_block_hashes_batched,
)

BS = 4


def cached_ctx(policy="lru", blocks=24):
    return make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy=policy,
                    buffer_size_gb=blocks * BLOCK / GIB, max_requests=4)


def req(rid, tokens):
    return DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(tokens),
                                   sampling_params=SamplingParams(num_tokens_to_generate=4))


def step(ctx, finish=False):
    ctx.initialize_attention_state()
    active = ctx.total_request_count - ctx.paused_request_count
    ctx.update_requests(torch.full((active,), not finish, dtype=torch.bool),
                        torch.full((active,), 7))


def test_the_context_allocator_is_one_kv_block_allocator_whose_names_are_views():
    ctx = cached_ctx()
    alloc = ctx.kv_block_allocator
    assert alloc is ctx.block_allocator and isinstance(alloc, KVBlockAllocator)
    assert isinstance(alloc, BlockAllocator) and alloc.context is ctx
    alloc.block_ref_counts[3] = 5
    assert alloc.ref_counts[3] == 5  # one array, two names
    alloc.ref_counts[3] = 0
    assert alloc.block_ref_counts[3].item() == 0
    assert (alloc.block_hashes == -1).all() and alloc.kv_hash_to_block_id == {}
    assert (alloc.block_parent_id == -1).all() and (alloc.block_child_count == 0).all()


def test_a_computed_prompt_publishes_0_19_hashes_and_parents_and_eviction_clears_them():
    ctx = cached_ctx()
    alloc = ctx.kv_block_allocator
    tokens = list(range(10, 10 + 3 * BS + 1))
    ctx.prefix_cache_lru_clock = 3
    add(ctx, req(1, tokens))
    blocks = ctx.block_table_host[0, :3].tolist()
    hashes = compute_block_hashes_batched(torch.tensor(tokens), BS)
    assert alloc.kv_hash_to_block_id == dict(zip(hashes, blocks))  # registered at add (0.19)
    step(ctx)
    assert alloc.kv_hash_to_block_id == dict(zip(hashes, blocks))
    assert alloc.block_hashes[blocks].tolist() == hashes
    assert alloc.block_parent_id[blocks].tolist() == [-1, blocks[0], blocks[1]]
    assert alloc.block_child_count[blocks].tolist() == [1, 1, 0]
    assert alloc.block_timestamps[blocks].tolist() == [3, 3, 3]
    step(ctx, finish=True)  # "lru": the blocks stay cached, idle
    assert int(alloc.get_evictable_block_count()) == 3 == alloc.idle_count
    assert alloc.is_memory_available(alloc.total_avail)
    assert not alloc.is_memory_available(alloc.total_avail, potential_matched_count=1)
    # A second request matching two blocks stamps them with the clock of its hit.
    ctx.prefix_cache_lru_clock = 9
    add(ctx, req(2, tokens[:2 * BS + 1]))
    assert alloc.block_timestamps[blocks].tolist() == [9, 9, 3]
    assert alloc.block_ref_counts[blocks].tolist() == [1, 1, 0]
    step(ctx, finish=True)
    # Taking every free block evicts the idle ones: their 0.19 columns go with the digests.
    taken = alloc.allocate_memory_blocks(alloc.total_avail)
    assert np.isin(blocks, taken.numpy()).all()
    assert alloc.kv_hash_to_block_id == {} and not alloc.cached.any()
    assert (alloc.block_parent_id == -1).all() and (alloc.block_child_count == 0).all()


def test_ref_zero_uncaches_a_block_at_its_last_release_and_has_no_lru_columns():
    ctx = cached_ctx("ref_zero")
    alloc = ctx.kv_block_allocator
    assert not hasattr(alloc, "block_timestamps") and not hasattr(alloc, "block_parent_id")
    add(ctx, req(1, list(range(2 * BS + 1))))
    step(ctx)
    assert len(alloc.kv_hash_to_block_id) == 2
    step(ctx, finish=True)
    assert alloc.kv_hash_to_block_id == {} and (alloc.block_hashes == -1).all()


def test_without_prefix_caching_0_19_has_no_prefix_names():
    alloc = make_ctx().kv_block_allocator
    for name in ("block_hashes", "block_ref_counts", "kv_hash_to_block_id", "block_timestamps"):
        assert not hasattr(alloc, name)
    assert alloc.block_routing == {}


def test_bad_arguments_raise_naming_them_before_any_change():
    ctx = SimpleNamespace(paused_request_count=0, total_request_count=0,
                          prefix_cache_lru_clock=0)
    with pytest.raises(ConfigAssertionError, match="paused_count=2"):
        KVBlockAllocator(ctx, total_count=3, paused_count=2)
    with pytest.raises(ValueError, match="prefix_caching_eviction_policy='fifo'"):
        KVBlockAllocator(ctx, 8, 2, True, "fifo")
    with pytest.raises(TypeError, match="total_count=8.0"):
        KVBlockAllocator(ctx, 8.0, 2)
    with pytest.raises(TypeError, match="total_count=8.0"):   # the base class too
        BlockAllocator(8.0, 2)
    with pytest.raises(TypeError, match="enable_prefix_caching='no' must be a bool"):
        KVBlockAllocator(ctx, 8, 2, "no")   # was taken as true
    alloc = KVBlockAllocator(ctx, 8, 2, True, "lru")
    with pytest.raises(TypeError, match=r"attach\(context=None\): context must be"):
        alloc.attach(None)   # was weakref's "cannot create weak reference to 'NoneType'"
    assert alloc.context is ctx
    before = (alloc.hash_ids.copy(), alloc.cached.copy(), alloc.parent_ids.copy())
    for kwargs, error, match in [
        (dict(block_ids=[1, 2], block_hashes=[5]), AssertionError, "block_hashes has 1"),
        (dict(block_ids=[1], block_hashes=[5], parent_hashes=[1, 2]), AssertionError,
         "parent_hashes has 2"),
        (dict(block_ids=[7], block_hashes=[5]), ValueError, "dummy block"),
        (dict(block_ids=[1.5], block_hashes=[5]), TypeError, "block_ids"),
    ]:
        with pytest.raises(error, match=match):
            alloc.register_kv_block_hashes(**kwargs)
        after = (alloc.hash_ids, alloc.cached, alloc.parent_ids)
        assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_routing_per_block_follows_the_steps_token_layout():
    ctx = SimpleNamespace(block_size_tokens=4, active_token_count=5,
                          token_to_block_idx=torch.tensor([2, 2, 5, 7, 5]),
                          token_to_local_position_within_kv_block=torch.tensor([0, 1, 3, 0, 0]))
    alloc = KVBlockAllocator(ctx, 8, 1)
    routing = np.arange(5 * 2 * 3, dtype=np.int16).reshape(5, 2, 3)
    alloc.store_routing_per_block(routing)
    assert sorted(alloc.block_routing) == [2, 5]  # block 7 is the dummy block
    assert np.array_equal(alloc.get_block_routing(5)[[3, 0]], routing[[2, 4]])
    assert np.array_equal(alloc.reconstruct_routing_from_blocks([2, 5], 6)[:2], routing[:2])
    before = {b: r.copy() for b, r in alloc.block_routing.items()}
    for bad in (routing[:4], routing.tolist(), routing[:, 0]):   # short, a list, 2-D
        with pytest.raises(ValueError, match=r"not a numpy array \[active_token_count=5"):
            alloc.store_routing_per_block(bad)
    assert before.keys() == alloc.block_routing.keys()
    assert all(np.array_equal(r, alloc.block_routing[b]) for b, r in before.items())


def test_routing_per_block_of_another_shape_changes_no_block():
    """Block 2's routing was stored before block 5's [layers, topk] raised numpy's error."""
    ctx = SimpleNamespace(block_size_tokens=4, active_token_count=5,
                          token_to_block_idx=torch.tensor([2, 2, 5, 7, 5]),
                          token_to_local_position_within_kv_block=torch.tensor([0, 1, 3, 0, 0]))
    alloc = KVBlockAllocator(ctx, 8, 1)
    alloc.store_block_routing(5, np.arange(4), np.ones((4, 3, 3), dtype=np.int16))
    with pytest.raises(ValueError, match=r"\[layers, topk\]=\[2, 3\], the routing of blocks \[5\]"):
        alloc.store_routing_per_block(np.zeros((5, 2, 3), dtype=np.int16))
    assert list(alloc.block_routing) == [5] and (alloc.block_routing[5] == 1).all()


@pytest.mark.parametrize("block_id, positions, routing, error, match", [
    (-1, [0], (1, 2, 3), ValueError, r"block_id=-1 must lie in \[0, 7\)"),
    (7, [0], (1, 2, 3), ValueError, r"block_id=7 must lie in \[0, 7\) \(the dummy"),
    (1.0, [0], (1, 2, 3), TypeError, "block_id=1.0 must be an int"),
    (True, [0], (1, 2, 3), TypeError, "block_id=True must be an int"),
    (1, [4], (1, 2, 3), ValueError, r"positions=\[4\]: each must lie in \[0, block_size_tokens=4"),
    (1, [-1], (1, 2, 3), ValueError, r"positions=\[-1\]"),
    (1, [0.5], (1, 2, 3), TypeError, "positions must hold integers"),
    (1, [0, 1], (1, 2, 3), ValueError, r"\[len\(positions\)=2, layers, topk\], got \(1, 2, 3\)"),
    (1, [0], (1, 6), ValueError, "got \\(1, 6\\)"),
    (2, [0], (1, 5, 3), ValueError, r"routing has \[layers, topk\]=\[5, 3\], block 2's"),
])
def test_store_block_routing_checks_before_the_block_has_an_entry(block_id, positions, routing,
                                                                   error, match):
    ctx = SimpleNamespace(block_size_tokens=4)
    alloc = KVBlockAllocator(ctx, 8, 1)
    alloc.store_block_routing(2, np.arange(4), np.ones((4, 2, 3), dtype=np.int16))
    with pytest.raises(error, match=match):
        alloc.store_block_routing(block_id, np.asarray(positions),
                                  np.zeros(routing, dtype=np.int16))
    assert list(alloc.block_routing) == [2] and (alloc.block_routing[2] == 1).all()


@pytest.mark.parametrize("request_block_size", [BS, 5])
def test_precomputed_hashes_name_the_blocks_only_when_of_the_contexts_block_size(
        request_block_size):
    ctx = cached_ctx()
    tokens = torch.arange(20, 27)  # 7 tokens: one full block at 4 and at 5 tokens a block
    request = DynamicInferenceRequest(
        request_id=1, prompt_tokens=tokens, sampling_params=SamplingParams(
            num_tokens_to_generate=4), block_size_tokens=request_block_size,
        enable_prefix_caching=True)
    assert len(request.precomputed_block_hashes) == 1
    add(ctx, request)
    step(ctx)
    block = int(ctx.block_table_host[0, 0])
    assert ctx.kv_block_allocator.block_hashes[block].item() == \
        compute_block_hashes_batched(tokens, BS)[0]


def test_a_request_takes_enable_prefix_caching_as_a_bool_only():
    """``"no"`` was taken as true (0.19's hashes computed for a request that asked for none)."""
    with pytest.raises(TypeError, match="enable_prefix_caching='no' must be a bool"):
        DynamicInferenceRequest(request_id=1, prompt_tokens=torch.arange(9),
                                block_size_tokens=BS, enable_prefix_caching="no")
    plain = DynamicInferenceRequest(request_id=1, prompt_tokens=torch.arange(9),
                                    block_size_tokens=BS, enable_prefix_caching=False)
    assert plain.precomputed_block_hashes == []
