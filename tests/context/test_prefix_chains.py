"""Prefix caching matches chains, not blocks (docs/SEMANTICS.md §17): a cached block stands for
its whole prefix, so the same block content after different prefixes is different cache
entries, and a request whose first block equals another prompt's second block hits nothing.

The property test checks matching against a brute-force oracle: a new request takes the longest
run of full blocks from the start that some earlier request with the same salt also had, at most
``(prompt - 1) // block_size`` blocks (its last prompt token is computed), and each matched
block is the block of the first request that computed that prefix."""

from __future__ import annotations

from typing import List

import torch
from helpers import BLOCK, GIB, add, make_ctx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynctx.context import DynamicInferenceRequest, SamplingParams

BS = 4
# Room for every block of an example without eviction (the oracle knows no eviction).
BLOCKS = 72
X, Y, Z, W = ([base + i for i in range(BS)] for base in (10, 20, 30, 40))


def cached_ctx():
    return make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                    buffer_size_gb=BLOCKS * BLOCK / GIB, max_requests=8)


def req(rid: int, tokens: List[int], salt=None) -> DynamicInferenceRequest:
    request = DynamicInferenceRequest(
        request_id=rid, prompt_tokens=torch.tensor(tokens),
        sampling_params=SamplingParams(num_tokens_to_generate=4))
    request.prefix_caching_salt = salt
    return request


def step(ctx, finish=False):
    """One step: every active request samples token 7; ``finish``: and leaves."""
    ctx.initialize_attention_state()
    active = ctx.total_request_count - ctx.paused_request_count
    ctx.update_requests(torch.full((active,), not finish, dtype=torch.bool),
                        torch.full((active,), 7))


def compute(ctx, rid: int, tokens: List[int], salt=None) -> List[int]:
    """Add a request, run its prefill (which publishes its full blocks) and finish it (its
    blocks stay cached, idle); returns its block ids."""
    add(ctx, req(rid, tokens, salt))
    row = ctx.host_request_ids()[:ctx.total_request_count].tolist().index(rid)
    blocks = ctx.block_table_host[row, :-(-len(tokens) // BS)].tolist()
    step(ctx)
    step(ctx, finish=True)
    return blocks


def test_a_first_block_equal_to_another_prompts_second_block_hits_nothing():
    ctx = cached_ctx()
    compute(ctx, 1, X + Y + [1])
    assert ctx.prefix_cache_lookup(req(2, Y + W + [1])) == 0
    assert ctx.prefix_cache_lookup(req(3, Y + [1])) == 0
    assert ctx.prefix_cache_lookup(req(4, X + W + [1])) == BS
    assert ctx.prefix_cache_lookup(req(5, X + Y + W + [1])) == 2 * BS


def test_the_same_block_after_different_prefixes_is_a_different_entry():
    ctx = cached_ctx()
    first = compute(ctx, 1, X + Y + [1])
    second = compute(ctx, 2, Z + Y + [1])
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 4   # X, XY, Z, ZY
    assert second[1] != first[1]                                       # Y computed twice
    add(ctx, req(3, Z + Y + W + [1]))
    table = ctx.block_table_host
    assert table[0, :2].tolist() == second[:2]     # ZY's blocks, never XY's second
    assert ctx.request_kv_length_offsets[0] == 2 * BS


def test_a_salt_is_part_of_the_chain():
    ctx = cached_ctx()
    compute(ctx, 1, X + Y + [1], salt="a")
    assert ctx.prefix_cache_lookup(req(2, X + Y + [1])) == 0
    assert ctx.prefix_cache_lookup(req(3, X + Y + [1], salt="b")) == 0
    assert ctx.prefix_cache_lookup(req(4, X + Y + [1], salt="a")) == 2 * BS


# ---------------------------------------------------------------- against an oracle
def oracle(done: List[tuple], tokens: List[int], salt) -> List[int]:
    """The blocks a new request of ``tokens`` takes from the cache: the longest run of full
    blocks from the start that an earlier request (``done``: ``(tokens, salt, blocks)`` in
    order) with the same salt had, capped so that the last prompt token is computed; each
    block is the one of the first request that had that prefix."""
    limit = (len(tokens) - 1) // BS
    blocks = []
    for index in range(limit):
        prefix = tokens[:(index + 1) * BS]
        owner = next((b for t, s, b in done
                      if s == salt and len(t) >= len(prefix) and t[:len(prefix)] == prefix),
                     None)
        if owner is None:
            break
        blocks.append(owner[index])
    return blocks


ALPHABET = [X, Y, Z, [10, 11, 12, 14]]   # the last differs from X in its last token only
prompt = st.builds(lambda blocks, tail: [t for b in blocks for t in ALPHABET[b]] + tail,
                   st.lists(st.integers(0, len(ALPHABET) - 1), max_size=4),
                   st.lists(st.integers(50, 52), max_size=BS))
salted = st.tuples(prompt.filter(bool), st.sampled_from([None, "a", 1]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(salted, min_size=1, max_size=7))
def test_matching_equals_the_longest_run_of_equal_full_blocks(requests):
    ctx = cached_ctx()
    done: List[tuple] = []
    for rid, (tokens, salt) in enumerate(requests):
        expected = oracle(done, tokens, salt)
        assert ctx.prefix_cache_lookup(req(rid, tokens, salt)) == len(expected) * BS, \
            (tokens, salt, done)
        blocks = compute(ctx, rid, tokens, salt)
        assert blocks[:len(expected)] == expected, (tokens, salt, done)
        done.append((tokens, salt, blocks))


def test_raising_total_avail_by_hand_uncaches_the_blocks_it_frees():
    """Megatron-Core code moves ``total_avail`` by hand: raising it frees the ids above the top
    of the stack whatever holds them, so a cached block among them leaves the cache (its bytes
    are no longer vouched for) and no later request may hit it."""
    ctx = cached_ctx()
    add(ctx, req(1, X + Y + [1]))
    step(ctx)                                   # publishes X and XY; request 1 still holds them
    assert ctx.prefix_cache_lookup(req(2, X + Y + [1])) == 2 * BS
    alloc = ctx.block_allocator
    alloc.total_avail = alloc.total_avail + 3   # frees request 1's three blocks by hand
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 0
    assert not alloc.cached.any()
    assert ctx.prefix_cache_lookup(req(3, X + Y + [1])) == 0


def test_every_new_request_is_one_lookup_and_a_hit_is_counted_once():
    ctx = cached_ctx()
    compute(ctx, 1, X + Y + [1])
    compute(ctx, 2, X + [1])            # a hit of one block
    compute(ctx, 3, Z + [1])            # a miss
    stats = ctx.get_prefix_cache_stats()
    assert (stats["prefix_cache_lookups"], stats["prefix_cache_hits"]) == (3, 1)
    assert stats["prefix_cache_hit_rate"] == 1 / 3


def test_a_request_that_wants_prompt_log_probs_takes_nothing_and_revives_nothing():
    """It computes every prompt token: no hit, no idle block leaves the free stack, so its
    availability is that of a request without caching."""
    ctx = cached_ctx()
    compute(ctx, 1, X + Y + [1])        # X and XY idle in the cache
    wants = req(2, X + Y + [1])
    wants.sampling_params.return_log_probs = True
    assert ctx.prefix_cache_lookup(wants) == 0
    alloc = ctx.block_allocator
    alloc.total_avail = 3               # exactly its three blocks are free
    assert ctx.check_availability(wants) == (True, True, True)
    alloc.total_avail = 2
    assert ctx.check_availability(wants) == (True, True, False)


def test_a_suspend_frees_the_mamba_snapshots():
    from test_prefix_cache import hybrid_ctx

    per_request = 4 * (6 * 4 + 2 * 3 * 5)
    ctx = hybrid_ctx(prefix_caching_mamba_gb=2 * per_request / 1024 ** 3)
    snapshots = ctx.prefix_cache.mamba
    assert snapshots.conv is not None and snapshots.ssm is not None
    ctx.deallocate_all_tensors()
    assert snapshots.conv is None and snapshots.ssm is None and not snapshots.index
    ctx.allocate_all_tensors(is_init=False)
    assert snapshots.conv.shape[1] == snapshots.ssm.shape[1] == 2
