"""Prefix caching end to end where the same block content follows different prefixes
(docs/SEMANTICS.md §17): a prompt whose first block equals another prompt's second block, and
one whose second block follows another first block, must hit nothing of those blocks and still
generate transformers' greedy tokens; a prompt sharing the whole two-block prefix hits both."""

from __future__ import annotations

import pytest
from e2e_helpers import build_engine, greedy_requests, hf_greedy, make_prompts, tiny_llama

BS = 16


@pytest.mark.parametrize("policy", ["ref_zero", "lru"])
def test_equal_blocks_after_different_prefixes_are_not_shared(policy):
    hf = tiny_llama(seed=8, max_positions=128)
    x, y, z, tail_a, tail_b, tail_c, tail_d = make_prompts([BS, BS, BS, 3, 5, 2, 7],
                                                           hf.config.vocab_size, seed=9)
    prompts = [x + y + tail_a,      # computes X and XY
               y + tail_b,          # Y first: not XY's second block
               z + y + tail_c,      # Y after Z: neither
               x + y + tail_d]      # XY: both blocks from the cache
    gens = [12, 6, 6, 6]
    engine = build_engine(hf, block_size=BS, blocks=16, paused_blocks=2, max_tokens=64,
                          max_requests=4, kernel_backend="torch", enable_prefix_caching=True,
                          prefix_caching_eviction_policy=policy)
    # The first request runs alone until its prefill published its blocks (and, under
    # ref_zero, stays so that they stay cached).
    results = engine.generate_requests(greedy_requests(prompts, gens),
                                       arrival_steps=[0, 2, 2, 2])
    for prompt, gen, result in zip(prompts, gens, results):
        assert result.generated_tokens == hf_greedy(hf, prompt, gen), result.request_id
    stats = engine.stats.prefix_cache
    assert stats["prefix_cache_hits"] == 1, stats
    assert stats["prefix_cache_prefill_skipped_tokens"] == 2 * BS, stats
