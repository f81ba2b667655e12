"""Prefix caching over KV groups (context/kv_groups.py, docs/SEMANTICS.md §22): a windowed
group keeps, idle, its copies of cached group-0 blocks that no window reads, until its pool
needs them (least recently idle first); a hit needs only the copies each window reads from the
hit's end (full layers: every block). The state machine's ``kvg-pc-*``/``kvw-pc-*``
configurations check every step, the data included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import add, make_ctx

from dynctx.context import DynamicInferenceRequest, SamplingParams

PROMPT = list(range(10, 50))    # 40 tokens: ten blocks of 4


def req(rid, tokens, gen=4):
    return DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(tokens),
                                   sampling_params=SamplingParams(num_tokens_to_generate=gen))


def step(ctx, keep=True):
    ctx.initialize_attention_state()
    n = ctx.total_request_count - ctx.paused_request_count
    ctx.update_requests(torch.full((n,), keep, dtype=torch.bool),
                        torch.zeros(n, dtype=torch.int64))


def cached_then_finished(windows, policy="lru", **overrides):
    """Request 1 (PROMPT) computed and published, then finished: its ten prompt blocks cached
    (idle under "lru"), and its window's copies of them idle."""
    ctx = make_ctx(kv_layer_windows=windows, enable_prefix_caching=True,
                   prefix_caching_eviction_policy=policy, **overrides)
    add(ctx, req(1, PROMPT))
    step(ctx)
    step(ctx, keep=False)
    return ctx


@pytest.mark.parametrize("windows", [[None, 6], [6, 6]], ids=["mixed", "all-windowed"])
def test_idle_copies_serve_a_hit(windows):
    """The window's copies of the ten cached blocks stay, idle, after their request finished;
    a request with the same prompt and more hits all ten (its chunk covers 44 tokens) and
    reads the two its window needs."""
    ctx = cached_then_finished(windows)
    group = ctx._kv.groups[0]
    usage = ctx.kv_group_usage()
    assert usage["held"][1] == usage["idle"][1] == 10 and usage["idle"][0] == 10
    assert ctx.prefix_cache_lookup(req(2, PROMPT + [1, 2, 3, 4])) == 40
    add(ctx, req(2, PROMPT + [1, 2, 3, 4]))
    ctx.initialize_attention_state()
    stats = ctx.get_prefix_cache_stats()
    assert stats["prefix_cache_hits"] == 1 and stats["prefix_cache_blocks_matched"] == 10
    table = ctx.active_attn_metadata.kv_group_block_tables
    main = table[0][0, :11].numpy()
    # Positions 35..39 (the window of position 40) lie in blocks 8 and 9: read, not idle.
    assert np.array_equal(table[1][0, 8:10].numpy(), group.map[main[8:10]])
    assert np.all(group.idle_since[group.map[main[8:10]]] == -1)
    assert np.all(group.idle_since[group.map[main[:8]]] >= 0)    # still idle, for later hits


@pytest.mark.parametrize("windows", [[None, 6], [6, 6]], ids=["mixed", "all-windowed"])
def test_a_hit_needs_only_the_blocks_the_window_reads(windows):
    """Copies the pool gave up (as it does under pressure): a hit ending at block k needs the
    copies of the blocks its window reads from position 4k, not the earlier ones."""
    ctx = cached_then_finished(windows)
    group, cache = ctx._kv.groups[0], ctx.prefix_cache
    blocks = [cache.entries[link[0]][0] for link in cache._links(req(9, PROMPT), 9)]
    assert len(blocks) == 10
    group._free(group.map[[blocks[3]]])            # before every window of interest
    assert ctx.prefix_cache_lookup(req(2, PROMPT + [1])) == 40
    group._free(group.map[[blocks[9]]])            # the window of position 40 reads block 9
    # A hit of 9 blocks (window of position 36: blocks 7 and 8) is the longest left.
    assert ctx.prefix_cache_lookup(req(2, PROMPT + [1])) == 36
    group._free(group.map[[blocks[7]]])
    # Hits of 9 and 8 blocks need block 7 (positions 31..35, 27..31); 7 blocks: 5 and 6.
    assert ctx.prefix_cache_lookup(req(2, PROMPT + [1])) == 28
    add(ctx, req(2, PROMPT + [1]))
    assert int(ctx.request_kv_length_offsets[0]) == 28
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks_matched"] == 7


def test_full_layers_need_every_block():
    """With a full layer the group-0 blocks hold every position: a hit of k blocks needs all of
    them cached (group 0's rule), and the window only its own copies."""
    ctx = cached_then_finished([None, 6])
    usage = ctx.kv_group_usage()
    assert usage["layers"] == [1, 1]
    cache = ctx.prefix_cache
    first = cache._links(req(9, PROMPT), 9)[4][0]
    block = cache.entries[first][0]
    ctx.block_allocator._evict(np.asarray([block], dtype=np.int32))  # group 0 loses block 4
    assert ctx.prefix_cache_lookup(req(2, PROMPT + [1])) == 16


def test_the_pool_takes_back_the_least_recently_idle_copies():
    """Every layer windowed, two rows: the pool holds its worst case, 18 blocks (17 and the
    dummy). Request 1's copies of blocks 0..7 went idle at its prefill's update, those of
    blocks 8 and 9 when it finished: a request of ten new blocks finds seven free and takes
    three of the copies that went idle first; a hit then ends before them."""
    ctx = cached_then_finished([6, 6], max_requests=2, max_tokens=40)
    group = ctx._kv.groups[0]
    assert group.blocks == 18 and group.free_count == 7
    cache = ctx.prefix_cache
    blocks = np.asarray([cache.entries[link[0]][0]
                         for link in cache._links(req(9, PROMPT), 9)])
    since = group.idle_since[group.map[blocks]]
    assert np.all(since[:8] < since[8:].min())
    add(ctx, req(3, [200 + i for i in range(40)]))
    ctx.initialize_attention_state()
    lost = np.flatnonzero(group.map[blocks] < 0)
    assert lost.size == 3 and lost.max() < 8 and group.free_count == 0
    assert ctx.kv_group_usage()["idle"][1] == 7
    # A hit ending at block 10 or 9 needs copies 8, 9 (and 7): the longest left ends before
    # the first lost copy's window, or at the lost copies' start.
    expected = max(k for k in range(11) if not any(
        j in lost for j in range(max(0, 4 * k - 5) // 4, k)))
    assert ctx.prefix_cache_lookup(req(4, PROMPT + [1])) == 4 * expected


def test_ref_zero_keeps_copies_while_a_holder_lives():
    """Under "ref_zero" a cached block lives while a request holds it: the window's copies of
    a live request's cached prompt blocks stay idle, and go when it finishes."""
    ctx = make_ctx(kv_layer_windows=[None, 6], enable_prefix_caching=True,
                   prefix_caching_eviction_policy="ref_zero")
    add(ctx, req(1, PROMPT, gen=8))
    step(ctx)
    usage = ctx.kv_group_usage()
    assert usage["idle"] == [0, 8]       # blocks 0..7: cached, before the window of position 40
    add(ctx, req(2, PROMPT + [7]))
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks_matched"] == 10
    step(ctx, keep=False)
    assert ctx.kv_group_usage()["held"] == [0, 0]


def test_host_tier_is_off_with_groups_and_refused_when_asked():
    """The prefix cache's host tier spills group 0's blocks only (docs/SEMANTICS.md §21): with
    KV groups its default turns it off, and asking for it names the two options to change,
    leaving nothing built."""
    ctx = make_ctx(kv_layer_windows=[None, 6], enable_prefix_caching=True, kv_offload_gb=1e-3)
    assert ctx._kv.groups and "kv_offload_prefix_spilled_blocks" not in \
        ctx.get_kv_offload_stats()
    with pytest.raises(ValueError, match=r"prefix_caching_host_tier=True is not supported with "
                       r"KV groups \(kv_layer_windows=\[None, 6\]\): pass kv_groups=False or "
                       r"prefix_caching_host_tier=False"):
        make_ctx(kv_layer_windows=[None, 6], enable_prefix_caching=True, kv_offload_gb=1e-3,
                 prefix_caching_host_tier=True)
    single = make_ctx(kv_layer_windows=[None, 6], kv_groups=False, enable_prefix_caching=True,
                      kv_offload_gb=1e-3, prefix_caching_host_tier=True)
    assert "kv_offload_prefix_spilled_blocks" in single.get_kv_offload_stats()
