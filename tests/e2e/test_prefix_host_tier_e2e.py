"""The prefix cache's host tier through the engine (docs/SEMANTICS.md §21): Llama and NemotronH
against transformers, under pressure.

Two 48-token "system prompts" alternate over ten requests in a device pool of 12 blocks of 16
tokens (each prompt's 3 shared blocks are pushed out of the device by the other's and by the
running requests), with prefix caching ("lru") and a host pool of 16 blocks: the cached blocks
spill to the host and later hits copy them back (asserted from the counters), while requests
pause, get evicted (and swap) and get chunked. On NemotronH the one Mamba snapshot the budget
holds is replaced by the other prompt's: replaced snapshots spill and hits resume from them.
Every request's greedy tokens equal transformers' ``generate`` for its prompt alone and every
step's logits equal transformers' full forward (fp32: within ``FP32_LOGITS_ATOL``); the host
pool's slots are each free or owned once at the end.
"""

from __future__ import annotations

from e2e_helpers import (
    assert_matches_transformers,
    build_engine,
    gib_for_blocks,
    greedy_requests,
    make_prompts,
    tiny_llama,
)
from test_nemotron_h import build_engine as build_hybrid_engine
from test_nemotron_h import gib_for_blocks as hybrid_gib
from test_nemotron_h import tiny_nemotron_h


def alternating_prefix_workload(vocab: int):
    """Ten prompts: one of two 48-token prefixes (alternating) + a suffix of 2..20 tokens."""
    first, second = make_prompts([48, 48], vocab, seed=31)
    suffixes = make_prompts([9, 5, 20, 3, 14, 6, 17, 2, 11, 7], vocab, seed=32)
    prompts = [(first if i % 2 == 0 else second) + s for i, s in enumerate(suffixes)]
    gens = [24, 20, 24, 16, 24, 22, 20, 24, 18, 24]
    arrivals = [0, 0, 2, 3, 5, 6, 8, 9, 11, 12]
    return prompts, gens, arrivals


def run(engine, prompts, gens, arrivals):
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=arrivals)
    ctx = engine.context
    ctx._parts.offload.check()
    assert not ctx.has_unfinished_requests()
    return results, ctx.get_kv_offload_stats(), engine.stats


def test_llama_prefix_host_tier_under_pressure_matches_transformers():
    hf = tiny_llama(seed=5)
    prompts, gens, arrivals = alternating_prefix_workload(hf.config.vocab_size)
    engine = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
                          kernel_backend="torch", record_logits=True,
                          enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                          kv_offload_gb=gib_for_blocks(hf, 16, 16))
    results, tier, stats = run(engine, prompts, gens, arrivals)
    assert stats.pauses > 0 and stats.evictions > 0 and stats.chunked_prefills > 0
    assert tier["kv_offload_prefix_spilled_blocks"] > 0, tier
    assert tier["kv_offload_prefix_restored_blocks"] > 0, tier
    assert stats.prefix_cache["prefix_cache_hits"] >= 5, stats.prefix_cache
    assert_matches_transformers(hf, prompts, gens, results)


def mamba_state_bytes(hf) -> int:
    """One request's Mamba states (conv and SSM of every Mamba layer), in bytes."""
    c = hf.config
    item = next(hf.parameters()).element_size()
    conv_dim = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
    ssm = c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size
    return item * c.layers_block_type.count("linear_attention") * (conv_dim * c.conv_kernel + ssm)


def test_nemotron_h_snapshots_spill_and_come_back():
    """The snapshot budget holds one snapshot, which the two prompts keep replacing. Tier on:
    the replaced snapshot (and the blocks) spill and hits resume from them, tokens and logits
    equal transformers'; tier off, the same tokens with fewer hits."""
    hf = tiny_nemotron_h(seed=3)
    prompts, gens, arrivals = alternating_prefix_workload(hf.config.vocab_size)
    runs = {}
    for host_tier in (False, True):
        engine = build_hybrid_engine(
            hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
            kernel_backend="torch", attention_backend="torch", record_logits=host_tier,
            enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
            prefix_caching_mamba_gb=mamba_state_bytes(hf) / 1024 ** 3,
            kv_offload_gb=hybrid_gib(hf, 16, 16), prefix_caching_host_tier=host_tier)
        assert engine.context.prefix_cache.mamba.count == 1
        runs[host_tier] = run(engine, prompts, gens, arrivals)
    (off, _, off_stats), (results, tier, stats) = runs[False], runs[True]
    assert stats.evictions > 0 and stats.chunked_prefills > 0
    assert tier["kv_offload_prefix_spilled_snapshots"] > 0, tier
    assert tier["kv_offload_prefix_restored_snapshots"] > 0, tier
    assert tier["kv_offload_prefix_restored_blocks"] > 0, tier
    hits = stats.prefix_cache["prefix_cache_hits"]
    assert hits > off_stats.prefix_cache["prefix_cache_hits"], (hits, off_stats.prefix_cache)
    assert [r.generated_tokens for r in off] == [r.generated_tokens for r in results]
    assert_matches_transformers(hf, prompts, gens, results)
