"""Every decoder family of the generic transformers path (models/generic.py) against
transformers' own greedy ``generate``: tokens equal, every step's logits within fp32 tolerance,
under pauses, evictions and chunked prefill (asserted), with prefix caching, with the CUDA-graph
stand-in runner, and windows shorter than the prompts (so an ignored window gives other
tokens, checked in transformers itself)."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    FP32_LOGITS_ATOL,
    assert_pressure_stats,
    build_engine,
    gib_for_blocks,
    greedy_requests,
    hf_greedy,
    make_prompts,
    step_logit_errors,
    tiny_llama,
    worst_logit_error,
)
from generic_families import (
    FAMILIES,
    VOCAB,
    WINDOW,
    WINDOWED,
    kv_block_bytes,
    tiny_family,
    without_windows,
)

from dynctx.engine.graphs import StandInGraphRunner
from dynctx.models.generic import layer_windows

# Prompts of 1 to 40 tokens (windows are 6), two arrivals a step, generation budgets that keep
# requests alive across pauses; 10 blocks of 8 tokens (2 paused) and 16 tokens a step force
# pauses, evictions and chunked prefills. Eight request rows (what the context derives for the
# families without windows): more than the windows' worst cases fit in the buffer, so a family
# whose every layer is windowed keeps group 0's budgets (docs/SEMANTICS.md §22) and pauses too.
LENGTHS = [1, 5, 17, 40, 3, 33, 16, 36]
GENS = [24, 16, 24, 12, 24, 20, 16, 12]
PRESSURE = dict(block_size=8, blocks=10, paused_blocks=2, max_tokens=16, max_requests=8)


def engine_for(hf, **kwargs):
    sizes = dict(PRESSURE, **{k: kwargs.pop(k) for k in list(kwargs) if k in PRESSURE})
    block_bytes = kv_block_bytes(hf)
    return build_engine(hf, **sizes, gib=lambda h, bs, n: gib_for_blocks(h, bs, n, block_bytes),
                        kernel_backend="torch", **kwargs)


def run_workload(engine, prompts, gens):
    requests = greedy_requests(prompts, gens)
    return engine.generate_requests(requests, arrival_steps=[i // 2 for i in range(len(gens))])


def assert_all_match(hf, prompts, gens, results):
    """Tokens equal transformers' greedy ``generate`` for each prompt alone (every request),
    and every recorded step's logits equal its full forward within fp32 tolerance."""
    same = [r.generated_tokens == hf_greedy(hf, p, g) for p, g, r in zip(prompts, gens, results)]
    assert all(same), f"requests {[i for i, s in enumerate(same) if not s]} differ"
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers_under_pressure(family):
    hf = tiny_family(family)
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = engine_for(hf, record_logits=True)
    assert engine.model.path == "generic" and engine.model.model_name == type(hf).__name__
    assert set(engine.model.windows) <= {None, WINDOW}
    results = run_workload(engine, prompts, GENS)
    assert_pressure_stats(engine.stats, results)
    assert engine.model.attention_backend == "torch"
    assert hf.config._attn_implementation != "dynctx_paged"  # the model's own is back
    assert_all_match(hf, prompts, GENS, results)
    ctx = engine.context
    assert not ctx.has_unfinished_requests()
    assert ctx.block_allocator.total_avail == ctx.block_allocator.total_count - 1


@pytest.mark.parametrize("family", WINDOWED)
def test_windows_change_the_tokens(family):
    """The windows of the tests matter: transformers' own greedy tokens differ when the same
    weights attend in full, so the equality above holds only if the window is honoured."""
    hf = tiny_family(family)
    assert WINDOW in layer_windows(hf) and WINDOW not in layer_windows(without_windows(hf))
    wide = without_windows(hf)
    # The workload's longest prompts (17, 40, 33, 36 tokens).
    prompts = [p for p in make_prompts(LENGTHS, VOCAB, seed=2) if len(p) > 16]
    differ = sum(hf_greedy(hf, p, 12) != hf_greedy(wide, p, 12) for p in prompts)
    assert differ >= 2, f"only {differ} of {len(prompts)} prompts depend on the window"


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "qwen3_moe"])
def test_prefix_caching_matches_transformers(family):
    hf = tiny_family(family, seed=1)
    prefix = make_prompts([20], VOCAB, seed=11)[0]
    prompts = [prefix + s for s in make_prompts([9, 1, 14, 3], VOCAB, seed=12)]
    prompts += [list(prompts[0])] + make_prompts([5], VOCAB, seed=13)
    gens = [16, 12, 16, 10, 16, 12]
    engine = engine_for(hf, blocks=14, enable_prefix_caching=True, record_logits=True)
    results = run_workload(engine, prompts, gens)
    stats = engine.stats.prefix_cache
    assert stats["prefix_cache_hits"] >= 2, stats
    assert_all_match(hf, prompts, gens, results)


def test_graph_stand_in_runner_with_a_windowed_family():
    """A windowed family under the CUDA-graph protocol (stand-in runner on a CPU): captured,
    replayed, no host sync in the forward, tokens equal transformers'."""
    hf = tiny_family("mistral")
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = engine_for(hf, num_cuda_graphs=2, max_requests=8, record_logits=True)
    assert engine.model.attention_backend_request == "torch_static"
    runner = engine.graph_runner
    assert isinstance(runner, StandInGraphRunner) and runner.captures > 0
    results = run_workload(engine, prompts, GENS)
    assert sum(runner.replays.values()) > 0
    assert_all_match(hf, prompts, GENS, results)


def test_dedicated_adapters_keep_their_models():
    engine = build_engine(tiny_llama(), block_size=16, blocks=6, paused_blocks=1, max_tokens=32)
    assert engine.model.path == "dedicated" and type(engine.model).__name__ == "LlamaAdapter"


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_bf16_within_tolerance(family):
    """bf16 through the generic path against a bf16 transformers run: the same model code, so
    the logits agree within bf16 rounding of the attention."""
    hf = tiny_family(family, dtype=torch.bfloat16)
    prompts = make_prompts([3, 17, 30], VOCAB, seed=3)
    engine = engine_for(hf, blocks=16, record_logits=True)
    results = run_workload(engine, prompts, [8, 8, 8])
    for _, _, ours, theirs in step_logit_errors(hf, results):
        assert float((ours - theirs).abs().max()) <= 2e-2 + 2e-2 * float(theirs.abs().max())
