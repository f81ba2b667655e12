"""Prefix caching in the context (docs/SEMANTICS.md §17): construction checks, matching and its
caps, publishing, the two eviction policies and the allocator's idle section, collision
safety, salts, requests that need every prompt logit, hybrids, and the Triton path (under the
interpreter) of a step whose queries start after the matched blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, assert_same, check_invariants, make_ctx, snapshot
from triton_marks import needs_triton

from dynctx.context import (
    BlockAllocator,
    DynamicInferenceRequest,
    MambaInferenceStateConfig,
    PrefixCachingEvictionPolicy,
    SamplingParams,
    prefix_digests,
)
from dynctx.context import prefix_cache as pc

BS = 4


def req(rid, tokens, gen=4, **sampling):
    return DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(tokens),
                                   sampling_params=SamplingParams(num_tokens_to_generate=gen,
                                                                  **sampling))


def cached_ctx(policy="lru", **overrides):
    return make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy=policy,
                    **overrides)


def step(ctx, keep=None):
    """One step; ``keep``: the ids kept (default all)."""
    ctx.initialize_attention_state()
    P, T = ctx.paused_request_count, ctx.total_request_count
    ids = ctx.host_request_ids()[P:T].tolist()
    mask = torch.tensor([keep is None or i in keep for i in ids], dtype=torch.bool)
    ctx.update_requests(mask, torch.tensor([7] * len(ids)))


PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks of 4 and one token


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching='yes'"),
    (dict(enable_prefix_caching=True, prefix_caching_eviction_policy="fifo"), ValueError,
     "prefix_caching_eviction_policy='fifo' must be one of 'ref_zero', 'lru'"),
    (dict(prefix_caching_eviction_policy=None), ValueError, "prefix_caching_eviction_policy"),
    (dict(prefix_caching_mamba_gb=-1.0), ValueError, "prefix_caching_mamba_gb=-1.0"),
    (dict(prefix_caching_mamba_gb=float("nan")), ValueError, "prefix_caching_mamba_gb"),
    (dict(prefix_caching_mamba_gb="1"), ValueError, "prefix_caching_mamba_gb='1'"),
])
def test_constructor_checks_the_prefix_caching_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_ctx(**kwargs)


def test_off_by_default_and_policy_names_are_case_insensitive():
    ctx = make_ctx()
    assert ctx.enable_prefix_caching is False and ctx.prefix_cache is None
    assert ctx.get_prefix_cache_stats() == {} and ctx.prefix_cache_lookup(req(1, PROMPT)) == 0
    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="LRU")
    assert ctx.prefix_caching_eviction_policy == "lru"
    assert ctx.block_allocator.keeps_idle_blocks
    # Megatron-Core 0.19's enum works too.
    ctx = make_ctx(enable_prefix_caching=True,
                   prefix_caching_eviction_policy=PrefixCachingEvictionPolicy.REF_ZERO)
    assert ctx.prefix_caching_eviction_policy == "ref_zero"
    assert not ctx.block_allocator.keeps_idle_blocks


# ---------------------------------------------------------------- matching
@pytest.mark.parametrize("policy", ["ref_zero", "lru"])
def test_hit_maps_cached_blocks_and_queries_start_after_them(policy):
    ctx = cached_ctx(policy)
    add(ctx, req(1, PROMPT))
    step(ctx)
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 3
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 12
    add(ctx, req(2, PROMPT + [40, 41]))
    table = ctx.block_table_host
    assert table[1, :3].tolist() == table[0, :3].tolist()      # shared
    assert table[1, 3] not in table[0, :4]                      # its own last block
    assert ctx.block_allocator.ref_counts[table[0, :3]].tolist() == [2, 2, 2]
    ctx.initialize_attention_state()
    n = ctx.active_token_count
    assert n == 1 + 3                                          # decode of 1, tokens 12..14 of 2
    assert ctx.token_to_pos_ids[:n].tolist() == [13, 12, 13, 14]
    assert ctx.token_to_input_ids[1:n].tolist() == [22, 40, 41]
    assert ctx.request_kv_length_offsets[:2].tolist() == [13, 12]
    stats = ctx.get_prefix_cache_stats()
    assert (stats["prefix_cache_hits"], stats["prefix_cache_blocks_matched"],
            stats["prefix_cache_prefill_skipped_tokens"],
            stats["prefix_cache_prefill_computed_tokens"]) == (1, 3, 12, 13 + 3)
    check_invariants(ctx)


def test_last_prompt_token_and_the_chunk_are_always_computed():
    ctx = cached_ctx()
    add(ctx, req(1, PROMPT[:8]))   # exactly two blocks
    step(ctx)
    # The whole prompt is cached, but its last token must be computed (its logits): 1 block.
    assert ctx.prefix_cache_lookup(req(2, PROMPT[:8])) == 4
    add(ctx, req(2, PROMPT[:12]), chunk_length=6)   # a first chunk of 6: at most 1 block
    assert ctx.request_kv_length_offsets[1] == 4 and ctx.request_query_lengths[1] == 2
    ctx.chunked_prefill_request_id = 2
    step(ctx)
    r = req(2, PROMPT[:12])
    r.remaining_prompt_tokens, r.finished_chunk_token_count = r.prompt_tokens[6:], 6
    add(ctx, r)                    # the continuation matches nothing more
    ctx.chunked_prefill_request_id = -1
    assert ctx.request_kv_length_offsets[1] == 6 and ctx.request_query_lengths[1] == 6
    step(ctx)
    check_invariants(ctx)


def test_requests_needing_prompt_log_probs_compute_every_token_but_publish():
    ctx = cached_ctx()
    add(ctx, req(1, PROMPT))
    step(ctx)
    wants = req(2, PROMPT, return_log_probs=True)
    assert ctx.prefix_cache_lookup(wants) == 0
    add(ctx, wants)
    assert ctx.request_query_lengths[1] == 13
    skip = req(3, PROMPT, return_log_probs=True, skip_prompt_log_probs=True)
    assert ctx.prefix_cache_lookup(skip) == 12


def test_salts_separate_requests():
    ctx = cached_ctx()
    add(ctx, req(1, PROMPT))
    step(ctx)
    salted = req(2, PROMPT)
    salted.prefix_caching_salt = "tenant"
    assert ctx.prefix_cache_lookup(salted) == 0
    add(ctx, salted)
    step(ctx)
    again = req(3, PROMPT)
    again.prefix_caching_salt = "tenant"
    assert ctx.prefix_cache_lookup(again) == 12
    assert ctx.prefix_cache_lookup(req(4, PROMPT)) == 12
    with pytest.raises(TypeError, match="prefix_caching_salt"):
        pc.salt_digest(1.5)


def test_a_digest_collision_costs_a_miss_never_a_wrong_block(monkeypatch):
    class Constant:
        def __init__(self, *args, **kwargs):
            pass

        def digest(self):
            return b"\0" * 16

    monkeypatch.setattr(prefix_digests.hashlib, "blake2b", Constant)
    ctx = cached_ctx()
    add(ctx, req(1, PROMPT))
    step(ctx)
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 1  # one digest, one entry
    other = [t + 1 for t in PROMPT]
    assert ctx.prefix_cache_lookup(req(2, other)) == 0           # same digest, other tokens
    assert ctx.prefix_cache_lookup(req(3, PROMPT)) == 4


# ---------------------------------------------------------------- eviction
def test_ref_zero_drops_a_block_at_its_last_reference():
    ctx = cached_ctx("ref_zero")
    add(ctx, req(1, PROMPT))
    step(ctx)
    add(ctx, req(2, PROMPT))
    step(ctx, keep={2})                         # 1 finishes: the blocks stay (2 holds them)
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 3
    step(ctx, keep=set())                       # 2 finishes: last references gone
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 0
    assert ctx.block_allocator.idle_count == 0
    assert ctx.prefix_cache_lookup(req(3, PROMPT)) == 0


def test_lru_keeps_idle_blocks_until_allocation_needs_them():
    ctx = cached_ctx("lru", buffer_size_gb=ctx_blocks(12), paused_buffer_size_gb=ctx_blocks(2))
    alloc = ctx.block_allocator
    free = alloc.total_avail
    add(ctx, req(1, PROMPT))
    step(ctx, keep=set())
    assert alloc.idle_count == 3 and alloc.total_avail == free       # idle blocks count as free
    idle = alloc.block_bag[:3].tolist()
    # Uncached free blocks are handed out first: a 4-block request keeps the cache whole.
    add(ctx, req(2, [99] * 16))
    assert alloc.idle_count == 3 and ctx.prefix_cache_lookup(req(3, PROMPT)) == 12
    # A hit revives idle blocks out of the stack.
    add(ctx, req(3, PROMPT))
    assert alloc.idle_count == 0 and ctx.block_table_host[1, :3].tolist() == idle
    step(ctx)
    check_invariants(ctx)
    step(ctx, keep=set())
    # Both finish: request 3's 3 matched blocks and request 2's 4 published blocks are idle.
    assert alloc.idle_count == 7 == ctx.get_prefix_cache_stats()["prefix_cache_blocks"]
    check_invariants(ctx)


def ctx_blocks(n):
    from helpers import BLOCK, GIB
    return n * BLOCK / GIB


def test_lru_allocator_evicts_least_recently_released_first():
    alloc = BlockAllocator(total_count=8, paused_count=1)
    evicted = []
    alloc.keeps_idle_blocks, alloc.on_evict = True, lambda b: evicted.extend(b.tolist())
    a = alloc.allocate_memory_blocks_host(3)
    b = alloc.allocate_memory_blocks_host(2)
    alloc.cached[np.concatenate([a, b])] = True
    alloc.release_memory_blocks(a)        # released first: least recently used
    alloc.release_memory_blocks(b)
    assert alloc.idle_count == 5 and alloc.total_avail == 7
    assert alloc.block_bag[:5].tolist() == b.tolist() + a.tolist()
    assert set(alloc.allocate_memory_blocks_host(2).tolist()).isdisjoint(np.r_[a, b])
    assert evicted == []                  # two uncached free blocks were left
    got = alloc.allocate_memory_blocks_host(2)
    # The least recently released request (a) goes first, its tail blocks first.
    assert got.tolist() == a[1:].tolist() and sorted(evicted) == sorted(got.tolist())
    assert not alloc.cached[got].any() and alloc.idle_count == 3
    with pytest.raises(RuntimeError, match="not idle cached"):
        alloc.revive(np.array([got[0]]))
    alloc.revive(b[:1])
    assert alloc.ref_counts[b[0]] == 1 and alloc.idle_count == 2 and alloc.total_avail == 2


def test_total_avail_lowered_by_hand_keeps_the_taken_cached_blocks_evictable():
    """Lowering ``total_avail`` by hand (0.19's tests empty the free pool so) takes the idle
    cached blocks out of the free stack but keeps them cached without a reference, evictable
    outside it as 0.19's are: they still hit, and an allocation that needs a block evicts the
    least recently used leaf."""
    ctx = cached_ctx("lru")
    add(ctx, req(1, PROMPT))
    step(ctx, keep=set())
    alloc = ctx.block_allocator
    assert alloc.idle_count == 3
    alloc.total_avail = 0
    assert alloc.idle_count == 0 and ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 3
    assert int(alloc.get_evictable_block_count()) == 3
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 12
    assert alloc.allocate_memory_blocks(1) is not None
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 2
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 8


@pytest.mark.parametrize("policy", ["ref_zero", "lru"])
def test_allocator_reset_by_hand_forgets_the_cached_blocks(policy):
    """Megatron-Core code resets the allocator by hand (``block_allocator.reset()``): the
    blocks it frees must leave the cache, or a later request would map a block that
    allocation has handed to another prompt since."""
    ctx = cached_ctx(policy)
    add(ctx, req(1, PROMPT))
    step(ctx)
    step(ctx, keep=set())
    alloc = ctx.block_allocator
    ctx.block_allocator.reset()
    assert not alloc.cached.any() and alloc.idle_count == 0
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 0
    add(ctx, req(2, [99] * 16))                 # takes the formerly cached block ids
    assert ctx.prefix_cache_lookup(req(3, PROMPT)) == 0
    add(ctx, req(3, PROMPT))
    assert set(ctx.block_table_host[1, :4].tolist()).isdisjoint(ctx.block_table_host[0, :4])
    step(ctx)
    check_invariants(ctx)


def test_reset_and_suspend_forget_the_cache():
    ctx = cached_ctx("lru")
    add(ctx, req(1, PROMPT))
    step(ctx)
    ctx.reset()
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 0 and not ctx.block_allocator.cached.any()
    add(ctx, req(1, PROMPT))
    step(ctx)
    ctx.deallocate_all_tensors()
    ctx.allocate_all_tensors(is_init=False)
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 0
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 0


# ---------------------------------------------------------------- budgets (§17.4)
@pytest.mark.parametrize("policy", ["ref_zero", "lru"])
def test_budgets_count_each_shared_block_once(policy):
    """Four requests share 3 prompt blocks (active budget 12, paused 4). Caching off, each
    holds its own copy: request 1 pauses at once and request 4 is evicted. Caching on, the
    budgets count distinct blocks: nothing pauses until the active rows hold 12 distinct
    blocks; then the request left paused weighs only its own 2 blocks."""
    shared = list(range(10, 22))
    events = {}
    for enable in (False, True):
        ctx = make_ctx(enable_prefix_caching=enable, prefix_caching_eviction_policy=policy,
                       buffer_size_gb=17 * BLOCK / GIB, paused_buffer_size_gb=4 * BLOCK / GIB,
                       max_sequence_length=32)
        alloc = ctx.block_allocator
        assert (alloc.active_count, alloc.paused_count) == (12, 4)
        add(ctx, req(1, shared + [50, 51, 52], gen=16))
        for n in range(7):
            if n == 1:
                for rid in (2, 3, 4):
                    add(ctx, req(rid, shared + [10 * rid, 10 * rid + 1, 10 * rid + 2], gen=16))
            step(ctx)
            P, T = ctx.paused_request_count, ctx.total_request_count
            events[enable, n] = (ctx.host_request_ids()[:P].tolist(),
                                 ctx.evicted_request_ids.tolist(), alloc.get_active_used(),
                                 alloc.get_paused_used())
            assert alloc.get_active_used() + alloc.get_paused_used() == alloc.get_total_used()
            check_invariants(ctx)
            if enable and n == 6:
                # Per holder, the active rows would count 3 x 6 blocks and the paused row 5.
                counts = ctx.kv_block_counts_host
                assert int(counts[P:T].sum()) == 18 and int(counts[:P].sum()) == 5
                assert ctx.get_kvcache_utilization_stats()["paused_blocks"] == 2
                assert alloc.get_paused_avail() == 2 and alloc.get_active_avail() == 0
    # Caching off (unchanged): request 1 pauses as the others arrive, request 4 is evicted.
    assert events[False, 1] == ([1], [], 12, 4)
    assert events[False, 2] == ([1], [4], 10, 4)
    # Caching on: 3 shared + 5 own blocks, nothing paused, until the others fill their 5th
    # blocks together: two resume (3 blocks each) and request 4 stays paused with 2 blocks.
    assert events[True, 1] == ([], [], 8, 0)
    assert all(events[True, n][:2] == ([], []) for n in range(6))
    assert events[True, 6] == ([4], [], 12, 2)


def hybrid_ctx(**overrides):
    layers, conv, ssm = ("M", "*"), (6, 4), (2, 3, 5)
    return make_ctx(num_layers=2, enable_prefix_caching=True,
                    mamba_inference_state_config=MambaInferenceStateConfig(layers, conv, ssm),
                    **overrides)


def test_hybrid_without_a_state_snapshot_never_hits(caplog):
    with caplog.at_level("WARNING", logger="dynctx.context"):
        ctx = hybrid_ctx()
    assert "no Mamba state snapshot fits" in caplog.text
    add(ctx, req(1, PROMPT))
    step(ctx)
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 0
    assert ctx.prefix_cache_first_chunk_boundary(req(2, PROMPT)) == 0
    add(ctx, req(2, PROMPT))
    assert ctx.request_query_lengths[1] == 13


def test_hybrid_hit_resumes_from_the_snapshot_at_its_boundary():
    per_request = 4 * (6 * 4 + 2 * 3 * 5)
    ctx = hybrid_ctx(prefix_caching_mamba_gb=2 * per_request / 1024 ** 3)
    snaps = ctx.prefix_cache.mamba
    assert snaps.count == 2
    add(ctx, req(1, PROMPT))
    step(ctx)                        # ends at 13: not a block boundary, no snapshot
    assert len(snaps.index) == 0
    # The blocks are cached, the state at their end is not: the first chunk ends there.
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 0
    assert ctx.prefix_cache_first_chunk_boundary(req(2, PROMPT)) == 12
    r2 = req(2, PROMPT)
    add(ctx, r2, chunk_length=12)
    ctx.chunked_prefill_request_id = 2
    conv, ssm = ctx.mamba_states_cache(1)
    ctx.initialize_attention_state()
    slot = int(ctx.mamba_metadata.request_to_mamba_state_idx[1])
    conv[slot].fill_(3.0)            # "the forward": the state after 12 tokens
    ssm[slot].fill_(4.0)
    ctx.update_requests(torch.tensor([True, True]), torch.tensor([7, 7]))
    assert len(snaps.index) == 1     # the state at 12 tokens, under block 3's digest
    add(ctx, _continued(PROMPT, 2, 12))
    ctx.chunked_prefill_request_id = -1
    step(ctx)
    # A third request resumes from the snapshot: 12 tokens skipped, its row the continuation.
    assert ctx.prefix_cache_lookup(req(3, PROMPT)) == 12
    add(ctx, req(3, PROMPT))
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="hybrid"):
        ctx.add_request(req(4, [1, 2, 3]))
    assert_same(before, snapshot(ctx))
    ctx.initialize_attention_state()
    meta = ctx.mamba_metadata
    slot = int(meta.request_to_mamba_state_idx[ctx.total_request_count - 1])
    assert meta.batch_indices_chunked_prefill.tolist() == [slot]
    assert bool((conv[slot] == 3.0).all()) and bool((ssm[slot] == 4.0).all())


def _continued(prompt, rid, done):
    r = req(rid, prompt)
    r.remaining_prompt_tokens, r.finished_chunk_token_count = r.prompt_tokens[done:], done
    return r


def test_mamba_snapshots_replace_the_least_recently_used():
    snaps = pc.MambaSnapshots(2, (1, 2), (1, 3), torch.float32, torch.float32, "cpu")
    snaps.allocate()
    conv = torch.arange(4 * 2, dtype=torch.float32).reshape(1, 4, 2)
    ssm = torch.arange(4 * 3, dtype=torch.float32).reshape(1, 4, 3)
    snaps.save([(0, b"a"), (1, b"b")], conv, ssm)
    snaps.index.move_to_end(b"a")    # a hit on "a"
    snaps.save([(2, b"c"), (3, b"a")], conv, ssm)
    assert list(snaps.index) == [b"a", b"c"]          # "b" went; "a" kept its state
    out_conv, out_ssm = torch.zeros_like(conv), torch.zeros_like(ssm)
    snaps.restore([(3, snaps.index[b"a"]), (1, snaps.index[b"c"])], out_conv, out_ssm)
    assert torch.equal(out_conv[0, 3], conv[0, 0]) and torch.equal(out_ssm[0, 1], ssm[0, 2])



def test_mamba_snapshots_of_one_update_beyond_the_budget_copy_each_index_once(monkeypatch):
    """More snapshots in one ``save`` than the budget holds: an index replaced within the call
    is copied once, from the slot its digest names at the end (``index_copy_`` with a repeated
    index keeps either source, on CUDA nondeterministically)."""
    snaps = pc.MambaSnapshots(2, (1, 2), (1, 3), torch.float32, torch.float32, "cpu")
    snaps.allocate()
    conv = torch.arange(6 * 2, dtype=torch.float32).reshape(1, 6, 2)
    ssm = torch.arange(6 * 3, dtype=torch.float32).reshape(1, 6, 3)
    copies = []
    index_copy = torch.Tensor.index_copy_

    def recording(self, dim, index, source):
        copies.append(index.tolist())
        return index_copy(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", recording)
    snaps.save([(slot, bytes([97 + slot])) for slot in range(5)], conv, ssm)
    assert copies and all(len(set(c)) == len(c) for c in copies), copies
    assert list(snaps.index) == [b"d", b"e"]
    for digest, slot in ((b"d", 3), (b"e", 4)):
        assert torch.equal(snaps.conv[0, snaps.index[digest]], conv[0, slot])
        assert torch.equal(snaps.ssm[0, snaps.index[digest]], ssm[0, slot])


# ---------------------------------------------------------------- the Triton path
@pytest.mark.interpreter
@needs_triton
def test_triton_step_of_a_hit_writes_only_its_own_blocks():
    """kernel_backend="triton" (interpreter): the step metadata of a hit and the K/V append
    leave the shared blocks' bytes as they were."""
    ctx = cached_ctx(kernel_backend="triton")
    add(ctx, req(1, PROMPT))
    ctx.initialize_attention_state()
    for layer in (1, 2):
        kv = torch.arange(ctx.padded_active_token_count * 16, dtype=torch.float32)
        ctx.append_key_value_cache(layer, kv.reshape(-1, 2, 8), kv.reshape(-1, 2, 8) + 0.5)
    ctx.update_requests(torch.tensor([True]), torch.tensor([7]))
    shared = ctx.block_table_host[0, :3].tolist()
    before = ctx.memory_buffer[:, :, shared].clone()
    add(ctx, req(2, PROMPT + [30]))
    ctx.initialize_attention_state()
    n = ctx.padded_active_token_count
    assert ctx.token_to_pos_ids[:3].tolist() == [13, 12, 13]
    assert ctx.token_to_block_idx[1] == ctx.block_table_host[1, 3]
    for layer in (1, 2):
        kv = torch.full((n, 2, 8), -3.0)
        ctx.append_key_value_cache(layer, kv, kv)
    assert torch.equal(ctx.memory_buffer[:, :, shared], before)
    assert snapshot(ctx)["counts"][1] == 2


def test_distinct_block_counts_equal_a_plain_python_count():
    """``distinct_blocks`` and ``first_holder_counts`` (the budgets' distinct counts, linear in
    the entries) against the definitions written as plain Python, over random tables with
    shared ids, the -1 padding, empty shapes and exclusions beyond the largest id."""
    from dynctx.context.plan_scratch import distinct_blocks, first_holder_counts

    rng = np.random.default_rng(0)
    for _ in range(500):
        rows, width, ids = (int(rng.integers(0, 6)), int(rng.integers(0, 6)),
                            int(rng.integers(1, 30)))
        held = rng.integers(-1, ids, (rows, width)).astype(np.int64)
        exclude = np.unique(rng.integers(0, ids + 5, int(rng.integers(0, 5)))).astype(np.int64)
        assert distinct_blocks(held).tolist() == sorted({b for b in held.ravel() if b >= 0})
        seen, expected = set(exclude.tolist()), []
        for row in held.tolist():
            new = {b for b in row if b >= 0 and b not in seen}
            expected.append(len(new))
            seen |= new
        assert first_holder_counts(held, exclude).tolist() == expected


def test_metrics_writer_receives_the_prefix_cache_counters():
    """With caching on, ``update_requests`` logs the prefix cache's counters beside the KV
    utilisation stats (``inference/prefix_cache_*``); without caching, none of them."""
    logged = []

    class Writer:
        def log(self, data):
            logged.append(dict(data))

    ctx = cached_ctx(metrics_writer=Writer())
    ctx.add_request(req(1, PROMPT))
    step(ctx, keep=())  # computes and publishes the three full blocks, then finishes
    ctx.add_request(req(2, PROMPT))
    step(ctx)
    last = logged[-1]
    assert last["inference/prefix_cache_hits"] == 1
    assert last["inference/prefix_cache_blocks_matched"] == 3
    assert last["inference/prefix_cache_prefill_skipped_tokens"] == 12
    assert last["inference/allocated_blocks"] == ctx.get_kvcache_utilization_stats()[
        "allocated_blocks"]
    plain = []

    class PlainWriter:
        def log(self, data):
            plain.append(dict(data))

    off = make_ctx(metrics_writer=PlainWriter())
    off.add_request(req(1, PROMPT))
    step(off)
    assert plain and not any(k.startswith("inference/prefix_cache") for k in plain[-1])
