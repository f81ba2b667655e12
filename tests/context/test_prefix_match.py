"""Megatron-Core 0.19's prefix-match helpers (``context/prefix_match.py``): pure, and what the
next ``add_request`` then does (docs/SEMANTICS.md §16 row 43)."""

from __future__ import annotations

import pytest
import torch
from helpers import BLOCK, GIB, add, make_ctx

from dynctx.context import DynamicInferenceRequest, SamplingParams, compute_block_hashes_batched

BS = 4


def cached_ctx():
    return make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                    buffer_size_gb=24 * BLOCK / GIB, max_requests=4)


def req(rid, tokens, **params):
    return DynamicInferenceRequest(
        request_id=rid, prompt_tokens=torch.tensor(tokens),
        sampling_params=SamplingParams(num_tokens_to_generate=4, **params))


def step(ctx, finish=False):
    ctx.initialize_attention_state()
    active = ctx.total_request_count - ctx.paused_request_count
    ctx.update_requests(torch.full((active,), not finish, dtype=torch.bool),
                        torch.full((active,), 7))


def computed(ctx, tokens):
    """A finished request whose full blocks are cached (idle); its block ids."""
    add(ctx, req(1, tokens))
    blocks = ctx.block_table_host[0, :len(tokens) // BS].tolist()
    step(ctx)
    step(ctx, finish=True)
    return blocks


def test_compute_prefix_match_says_what_add_request_then_does():
    ctx = cached_ctx()
    tokens = list(range(10, 10 + 3 * BS))
    blocks = computed(ctx, tokens)
    new = req(2, tokens + [1, 2, 3])  # 15 tokens: 4 blocks, the first 3 cached
    before = ctx.kv_block_allocator.ref_counts.copy()
    match = ctx._compute_prefix_match(new, new.remaining_prompt_length)
    assert match == (blocks, 1, 0, 4, 3 * BS, 3)
    assert (ctx.kv_block_allocator.ref_counts == before).all()  # pure
    hashes = compute_block_hashes_batched(torch.tensor(tokens), BS)
    assert ctx._find_kv_match_count(new, 0, 4) == (blocks, hashes[-1])
    assert ctx._find_kv_match_count(new, 1, 2) == (blocks[1:2], hashes[1])
    assert ctx._find_kv_match_count(new, 3, 4) == ([], 0)
    assert ctx._find_mamba_match_count(new, 0, 4) == 0  # not a hybrid
    skipped = ctx.prefix_cache_prefill_skipped_tokens
    add(ctx, new)
    assert ctx.block_table_host[0, :3].tolist() == blocks
    assert ctx.prefix_cache_prefill_skipped_tokens - skipped == 3 * BS


def test_a_prompt_equal_to_cached_blocks_shares_them_and_computes_its_last_block():
    ctx = cached_ctx()
    tokens = list(range(10, 10 + 2 * BS))
    blocks = computed(ctx, tokens)
    # Both blocks are shared (0.19's match); the chunk skips one and recomputes the last
    # block's tokens, their K/V writes discarded.
    match = ctx._compute_prefix_match(req(2, tokens), 2 * BS)
    assert match == (blocks, 0, 0, 2, BS, BS)
    # A shorter first chunk shares the blocks it covers whole and skips none of them.
    assert ctx._compute_prefix_match(req(3, tokens), BS) == (blocks[:1], 0, 0, 1, 0, BS)


def test_no_match_without_caching_for_a_continuation_or_prompt_log_probs():
    plain = make_ctx()
    assert plain._compute_prefix_match(req(1, list(range(9))), 9) == ([], 3, 0, 3, 0, 9)
    ctx = cached_ctx()
    tokens = list(range(10, 10 + 2 * BS))
    computed(ctx, tokens)
    logits = req(2, tokens + [5], return_log_probs=True)
    assert ctx._compute_prefix_match(logits, 9)[0] == []
    later = req(3, tokens + [5])
    later.finished_chunk_token_count = BS
    later.remaining_prompt_tokens = later.remaining_prompt_tokens[BS:]
    assert ctx._compute_prefix_match(later, 5) == ([], 2, 1, 3, 0, 5)


def test_bad_arguments_raise_naming_them():
    ctx = cached_ctx()
    r = req(1, list(range(9)))
    with pytest.raises(ValueError, match=r"prefill_chunk_length=10 must lie in \[1, 9\]"):
        ctx._compute_prefix_match(r, 10)
    with pytest.raises(TypeError, match="prefill_chunk_length=2.0"):
        ctx._compute_prefix_match(r, 2.0)
    with pytest.raises(ValueError, match="start_block=-1"):
        ctx._find_kv_match_count(r, -1, 2)
    with pytest.raises(TypeError, match="end_block=None"):
        ctx._find_mamba_match_count(r, 0, None)


@pytest.mark.parametrize("call, match", [
    (lambda c, r: c._compute_prefix_match(42, 4), "req must be a DynamicInferenceRequest, got int"),
    (lambda c, r: c._find_kv_match_count("x", 0, 2), "got str"),
    (lambda c, r: c._find_mamba_match_count(None, 0, 2), "got NoneType"),
    (lambda c, r: c._compute_prefix_match(r, 4, "no"), "record_mamba_match='no' must be a bool"),
])
def test_the_helpers_refuse_what_is_no_request_or_flag(call, match):
    """Before: AttributeError from inside (no request), or ``"no"`` taken as true."""
    ctx = cached_ctx()
    r = req(1, list(range(9)))
    with pytest.raises(TypeError, match=match):
        call(ctx, r)
    assert not hasattr(r, "_mamba_num_matched_blocks")
