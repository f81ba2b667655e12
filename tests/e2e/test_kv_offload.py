"""KV offload through the engine: evicted requests swap to the host pool and resume from it.

A random Llama and a random NemotronH (its Mamba state goes to the host too) run the pressure
workloads of their own end-to-end tests with ``kv_offload_gb`` on: every request's greedy
tokens equal transformers' ``generate`` for its prompt alone, every step's logits stay within
``FP32_LOGITS_ATOL`` of transformers', the evicted requests were restored (not recomputed), and
the host pool's slots are each free or owned once (docs/SEMANTICS.md §21). A host pool too
small for them drops the oldest copies and the engine recomputes those, with the same tokens.
Suspend and resume keep the tokens in every ``kv_cache_management_mode``.
"""

from __future__ import annotations

import pytest
from e2e_helpers import (
    FP32_LOGITS_ATOL,
    assert_pressure_stats,
    assert_requests_match_greedy,
    build_engine,
    case_engine_sizes,
    gib_for_blocks,
    greedy_requests,
    hf_greedy,
    make_prompts,
    pressure_workload,
    tiny_llama,
    worst_logit_error,
)
from test_llama_engine import BASE_GENS, BASE_LENGTHS, PRESSURE_CASES
from test_nemotron_h import GENS, LENGTHS, tiny_nemotron_h
from test_nemotron_h import build_engine as build_nemotron_engine
from test_nemotron_h import gib_for_blocks as nemotron_gib

LLAMA_CASE = PRESSURE_CASES[0].values[0]


def run_llama(host_blocks: int, record_logits: bool = True, **kwargs):
    hf = tiny_llama()
    prompts, requests, arrivals = pressure_workload(hf, LLAMA_CASE, BASE_LENGTHS, BASE_GENS)
    gib = gib_for_blocks(hf, LLAMA_CASE["block_size"], host_blocks) if host_blocks else 0
    engine = build_engine(hf, **case_engine_sizes(LLAMA_CASE), kernel_backend="torch",
                          record_logits=record_logits, kv_offload_gb=gib, **kwargs)
    results = engine.generate_requests(requests, arrival_steps=arrivals)
    return hf, prompts, requests, engine, results


def check_host_pool(ctx) -> None:
    offload = ctx._parts.offload
    offload.check()
    stats = ctx.get_kv_offload_stats()
    held = sum(e.host_blocks.size + sum(slots.size for _, slots in e.windowed)
               for e in offload.entries.values())
    assert stats["kv_offload_host_blocks_free"] + held == stats["kv_offload_host_blocks"]


def test_llama_swaps_instead_of_recomputing():
    hf, prompts, requests, engine, results = run_llama(host_blocks=64)
    ctx = engine.context
    stats = ctx.get_kv_offload_stats()
    assert_pressure_stats(engine.stats, results)
    assert stats["kv_offload_offloaded_requests"] == engine.stats.evictions
    assert stats["kv_offload_restored_requests"] == engine.stats.evictions
    assert stats["kv_offload_restored_tokens"] > 0 and stats["kv_offload_dropped_requests"] == 0
    check_host_pool(ctx)
    assert stats["kv_offload_requests_held"] == 0
    assert not ctx.has_unfinished_requests()
    assert ctx.block_allocator.total_avail == LLAMA_CASE["blocks"] - 1
    assert_requests_match_greedy(hf, requests, prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"
    # Without offload the same workload computes more prompt tokens (its recomputes), for
    # the same tokens (the schedules differ, so the counts are not simply offset).
    _, _, _, off, results_off = run_llama(host_blocks=0, record_logits=False)
    assert off.context.get_kv_offload_stats() == {}
    assert off.stats.evictions > 0
    assert ctx.lifetime_prefill_token_count < off.context.lifetime_prefill_token_count
    assert ({r.request_id: r.generated_tokens for r in results}
            == {r.request_id: r.generated_tokens for r in results_off})


def test_llama_host_pool_too_small_recomputes_the_oldest():
    # Three host blocks: an evicted request of three blocks fills the pool, so the next
    # eviction drops it (that request recomputes), and a larger request is not saved at all.
    hf, prompts, requests, engine, results = run_llama(host_blocks=3, record_logits=False)
    stats = engine.context.get_kv_offload_stats()
    assert stats["kv_offload_host_blocks"] == 3
    assert stats["kv_offload_dropped_requests"] + stats["kv_offload_unsaved_requests"] > 0
    check_host_pool(engine.context)
    assert_requests_match_greedy(hf, requests, prompts, results)


def test_nemotron_h_swaps_kv_and_mamba_state():
    hf = tiny_nemotron_h()
    prompts = make_prompts(LENGTHS, hf.config.vocab_size)
    requests = greedy_requests(prompts, GENS)
    engine = build_nemotron_engine(hf, block_size=16, blocks=12, paused_blocks=2,
                                   max_tokens=32, kernel_backend="torch",
                                   attention_backend="torch", record_logits=True,
                                   kv_offload_gb=nemotron_gib(hf, 16, 64))
    ctx = engine.context
    assert ctx._parts.offload.pool.states.count > 0
    arrivals = [i // 2 for i in range(len(prompts))]
    results = engine.generate_requests(requests, arrival_steps=arrivals)
    stats = ctx.get_kv_offload_stats()
    assert_pressure_stats(engine.stats, results)
    assert stats["kv_offload_restored_requests"] > 0
    check_host_pool(ctx)
    assert ctx._mamba_slots.free_count == ctx.max_requests
    assert_requests_match_greedy(hf, requests, prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


SUSPEND_PROMPTS, SUSPEND_GENS = [12, 40, 3, 27, 8], [16, 10, 16, 12, 16]


@pytest.mark.parametrize("mode", ["recompute", "offload", "persist"])
@pytest.mark.parametrize("model", ["llama", "nemotron_h"])
def test_suspend_and_resume_in_each_kv_cache_management_mode(model, mode):
    if model == "llama":
        hf = tiny_llama(seed=9)
        build, gib = build_engine, gib_for_blocks
    else:
        hf = tiny_nemotron_h()
        build, gib = build_nemotron_engine, nemotron_gib
    prompts = make_prompts(SUSPEND_PROMPTS, hf.config.vocab_size, seed=10)
    engine = build(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=24,
                   kernel_backend="torch", kv_offload_gb=gib(hf, 16, 32),
                   kv_cache_management_mode=mode)
    for request in greedy_requests(prompts, SUSPEND_GENS):
        engine.add_request(request)
    finished = []
    for _ in range(6):
        finished += engine.step().finished
    ctx = engine.context
    live = ctx.total_request_count
    assert live > 0
    prefill_before = ctx.lifetime_prefill_token_count
    engine.suspend()
    assert ctx.is_tensor_state_allocated == (mode == "persist")
    if mode == "offload":
        assert ctx.get_kv_offload_stats()["kv_offload_requests_held"] == live
    engine.resume()
    finished += engine.run()
    by_id = {r.request_id: r.generated_tokens for r in finished}
    for i, (prompt, gen) in enumerate(zip(prompts, SUSPEND_GENS)):
        assert by_id[i] == hf_greedy(hf, prompt, gen), f"request {i}"
    stats = ctx.get_kv_offload_stats()
    if mode == "offload":
        assert stats["kv_offload_restored_requests"] >= live
    if mode == "persist":
        assert engine.stats.suspends == 1 and ctx.lifetime_prefill_token_count >= prefill_before
    check_host_pool(ctx)


def test_llama_swaps_under_async_scheduling():
    """The tokens read one step late (docs/SEMANTICS.md §11) re-add an evicted request with
    the same tokens: its restore is exact there too."""
    hf, prompts, requests, engine, results = run_llama(host_blocks=64, record_logits=False,
                                                         async_scheduling=True)
    stats = engine.context.get_kv_offload_stats()
    assert engine.stats.evictions > 0
    assert stats["kv_offload_restored_requests"] == engine.stats.evictions
    check_host_pool(engine.context)
    assert_requests_match_greedy(hf, requests, prompts, results)


def test_speculative_steps_swap_and_equal_transformers():
    """KV offload with speculative steps (the speculative tests' pressure workload, a host pool
    of 32 blocks): evicted requests, whose KV may end mid-block after a rewind, swap to the
    host and resume from it; Llama (drafts accepted in part, wholly and not at all) and
    NemotronH (its Mamba state after the accepted tokens swaps too) give transformers' greedy
    tokens."""
    from test_nemotron_h import gib_for_blocks as hybrid_gib
    from test_speculative_engine import GENS as SPEC_GENS
    from test_speculative_engine import LENGTHS as SPEC_LENGTHS
    from test_speculative_engine import OracleDrafter, _pressure, _references

    for hf, gib in ((tiny_llama(), gib_for_blocks), (tiny_nemotron_h(), hybrid_gib)):
        prompts = make_prompts(SPEC_LENGTHS, hf.config.vocab_size)
        references = _references(hf, prompts, SPEC_GENS)   # prompt + transformers' tokens
        oracle = OracleDrafter(references, hf.config.vocab_size)
        extra = {} if gib is gib_for_blocks else dict(gib=gib, attention_backend="torch")
        engine, prompts, requests, results = _pressure(hf, 2, oracle,
                                                       kv_offload_gb=gib(hf, 16, 32), **extra)
        stats = engine.context.get_kv_offload_stats()
        assert_pressure_stats(engine.stats, results)
        assert stats["kv_offload_restored_requests"] == engine.stats.evictions > 0, stats
        assert 0 < engine.stats.speculative["acceptance_rate"] < 1
        check_host_pool(engine.context)
        for request, result in zip(requests, results):
            prompt = prompts[request.request_id]
            assert result.generated_tokens == references[request.request_id][len(prompt):]
