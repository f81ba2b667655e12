"""Prefix caching cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md
"Mutation testing"): a bytes salt, the first-chunk boundary of a hybrid's prompt that ends
on a block boundary (its last block is never matched: its last token is computed), a reset
that forgets the cache, the snapshot count of the arguments, and 0.19's Mamba match count of a
chain whose snapshot lies past the range asked."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import add, make_ctx

from dynctx.context import DynamicInferenceRequest, MambaInferenceStateConfig, SamplingParams
from dynctx.context import prefix_cache as pc

BS = 4
PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks of 4 and one token


def req(rid, tokens, salt=None):
    request = DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(tokens),
                                      sampling_params=SamplingParams(num_tokens_to_generate=4))
    request.prefix_caching_salt = salt
    return request


def test_every_kind_of_salt_roots_its_own_chain():
    digests = [pc.salt_digest(salt) for salt in (None, b"7", "7", 7, b"", "")]
    assert len(set(digests)) == len(digests)
    assert pc.salt_digest(b"7") == pc.salt_digest(b"7")
    tokens = torch.arange(8).numpy()
    assert pc.chain_links(tokens, BS, b"7")[0][1] == pc.salt_digest(b"7")


def test_a_bytes_salt_hits_only_the_same_bytes():
    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
    add(ctx, req(1, PROMPT, salt=b"a"))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True]), torch.tensor([7]))
    assert ctx.prefix_cache_lookup(req(2, PROMPT, salt=b"a")) == 3 * BS
    assert ctx.prefix_cache_lookup(req(3, PROMPT, salt="a")) == 0
    assert ctx.prefix_cache_lookup(req(4, PROMPT, salt=b"b")) == 0


def test_a_hybrid_first_chunk_never_ends_past_the_last_matchable_block():
    per_request = 4 * (6 * 4 + 2 * 3 * 5)
    ctx = make_ctx(num_layers=2, enable_prefix_caching=True,
                   mamba_inference_state_config=MambaInferenceStateConfig(
                       ("M", "*"), (6, 4), (2, 3, 5)),
                   prefix_caching_mamba_gb=2 * per_request / 1024 ** 3)
    add(ctx, req(1, PROMPT))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True]), torch.tensor([7]))
    # Its 3 blocks are cached, no state snapshot is: 13 tokens stop the first chunk after
    # the 3 blocks; 12 tokens (3 whole blocks) after 2, the last token being computed.
    assert ctx.prefix_cache_first_chunk_boundary(req(2, PROMPT)) == 3 * BS
    assert ctx.prefix_cache_first_chunk_boundary(req(3, PROMPT[:12])) == 2 * BS
    assert ctx.prefix_cache_first_chunk_boundary(req(4, PROMPT[:9])) == 2 * BS
    assert ctx.prefix_cache_first_chunk_boundary(req(5, PROMPT[:8])) == BS
    # One whole block: never matched (its last token is computed), so no boundary at all.
    assert ctx.prefix_cache_first_chunk_boundary(req(6, PROMPT[:4])) == 0


def test_a_reset_forgets_every_cached_block():
    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
    add(ctx, req(1, PROMPT))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([False]), torch.tensor([7]))
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 3 * BS
    ctx.reset()
    assert ctx.prefix_cache_lookup(req(2, PROMPT)) == 0
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 0
    add(ctx, req(2, PROMPT))
    assert ctx.request_query_lengths[0] == len(PROMPT)
    # Computed again, its blocks are cached again (no stale entry stands in their way).
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True]), torch.tensor([7]))
    assert ctx.prefix_cache_lookup(req(3, PROMPT)) == 3 * BS
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks"] == 3


def test_snapshot_count_is_minus_one_without_caching_or_mamba_layers():
    hybrid = SimpleNamespace(is_hybrid_model=True, mamba_bytes_per_request=1024)
    plain = SimpleNamespace(is_hybrid_model=False, mamba_bytes_per_request=0)
    assert pc.prefix_snapshot_count((False, "lru", 1.0), hybrid) == -1
    assert pc.prefix_snapshot_count((True, "lru", 1.0), plain) == -1
    assert pc.prefix_snapshot_count((True, "lru", None), hybrid) == 0
    assert pc.prefix_snapshot_count((True, "lru", 3.5 * 1024 / 1024 ** 3), hybrid) == 3


def test_the_mamba_match_count_never_looks_past_the_blocks_asked():
    """0.19's ``_find_mamba_match_count``: a snapshot at the end of block 2 counts for a range
    that includes block 2, never for one that stops before it."""
    per_request = 4 * (6 * 4 + 2 * 3 * 5)
    ctx = make_ctx(num_layers=2, enable_prefix_caching=True,
                   prefix_caching_eviction_policy="lru",
                   mamba_inference_state_config=MambaInferenceStateConfig(
                       ("M", "*"), (6, 4), (2, 3, 5)),
                   prefix_caching_mamba_gb=2 * per_request / 1024 ** 3)
    add(ctx, req(1, PROMPT[:8]))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([False]), torch.tensor([7]))
    # 8 tokens: two blocks cached, the state snapshotted at the end of the second.
    assert len(ctx.prefix_cache.mamba.index) == 1
    longer = req(2, PROMPT)
    assert ctx._find_mamba_match_count(longer, 0, 1) == 0
    assert ctx._find_mamba_match_count(longer, 0, 2) == 2
    assert ctx._find_mamba_match_count(longer, 1, 2) == 1
    assert ctx._find_mamba_match_count(longer, 0, 3) == 2
