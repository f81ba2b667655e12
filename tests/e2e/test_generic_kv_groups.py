"""The generic path on KV groups (context/kv_groups.py, docs/SEMANTICS.md §22): Gemma 3 (five
sliding layers per full one), gpt-oss (alternating, sinks) and Mistral (every layer windowed)
generate transformers' greedy tokens with their windowed layers' blocks released, under pauses,
evictions and chunked prefill (torch path), with a windowed pool smaller than group 0's, and
through the Triton kernels under the interpreter. The windows (6 tokens) are shorter than the
prompts, so a block released too early, or a window ignored, gives other tokens."""

from __future__ import annotations

import math

import pytest
import torch
from e2e_helpers import assert_pressure_stats, greedy_requests, make_prompts
from generic_families import VOCAB, WINDOW, tiny_family
from test_generic_families import GENS, LENGTHS, assert_all_match, engine_for, run_workload
from triton_marks import needs_triton


class ReleaseSpy:
    """Wraps the context's group hook: counts, at each step, the entries a windowed group
    released (-1 where group 0 holds a block) and those before a row's window (released, or
    an idle copy of a cached block), and checks each row's bound on the blocks it reads."""

    def __init__(self, ctx):
        self.ctx, self.released, self.outside, self.steps = ctx, 0, 0, 0
        kv = ctx._kv
        self.begin = kv.begin
        kv.begin = self

    def __call__(self, step, table, device, attention):
        self.begin(step, table, device, attention)
        self.steps += 1
        main = attention.kv_group_block_tables[0]
        block = self.ctx.block_size_tokens
        queries = self.ctx.request_query_lengths[step.paused:step.total]
        offsets = self.ctx.request_kv_length_offsets[step.paused:step.total].long()
        for group, window in enumerate(attention.kv_group_windows[1:], start=1):
            windowed = attention.kv_group_block_tables[group][:step.active]
            self.released += int(((windowed == -1) & (main[:step.active] >= 0)).sum())
            # The blocks a row reads (before its window: released, or an idle copy kept for
            # the prefix cache).
            first = torch.clamp(offsets - window + 1, min=0) // block
            columns = torch.arange(windowed.shape[1])
            read = columns[None, :] >= first[:, None]
            self.outside += int((~read & (main[:step.active] >= 0)).sum())
            held = ((windowed >= 0) & read).sum(dim=1)
            bound = torch.div(queries + window - 1 + block - 1, block,
                              rounding_mode="floor") + 1
            assert torch.all(held <= bound), (held.tolist(), bound.tolist())


# gemma3: 6 layers (5 sliding, 1 full); gpt_oss: 2 layers (sliding, full).
FAMILIES = [("gemma3", 6), ("gpt_oss", 2)]
GEMMA3_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def family_model(family: str, layers: int):
    types = GEMMA3_TYPES if layers == 6 else ["sliding_attention", "full_attention"]
    return tiny_family(family, num_hidden_layers=layers, layer_types=types)


@pytest.mark.parametrize("family, layers", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_groups_match_transformers_under_pressure(family, layers):
    hf = family_model(family, layers)
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = engine_for(hf, record_logits=True)
    ctx = engine.context
    usage = ctx.kv_group_usage()
    assert ctx.kv_groups and usage["windows"] == [None, WINDOW]
    assert sum(usage["layers"]) == layers and usage["layers"][0] == 1
    spy = ReleaseSpy(ctx)
    results = run_workload(engine, prompts, GENS)
    assert_pressure_stats(engine.stats, results)
    assert spy.released > 0 and spy.steps > 0
    assert_all_match(hf, prompts, GENS, results)
    assert ctx.kv_group_usage()["held"] == [0, 0]


def test_every_layer_windowed_matches_transformers_under_pressure():
    """Mistral (every layer of window 6): group 0 holds no layers; eight rows are more than the
    window's worst case fits, so group 0 keeps the buffer's budgets and the workload pauses,
    evicts and chunks, while the windowed group releases what its window passed."""
    hf = tiny_family("mistral")
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = engine_for(hf, record_logits=True)
    ctx = engine.context
    usage = ctx.kv_group_usage()
    assert usage["windows"] == [None, WINDOW] and usage["layers"] == [0, 2]
    assert usage["block_bytes"][0] == 0 and usage["blocks"] == [10, 10]
    spy = ReleaseSpy(ctx)
    results = run_workload(engine, prompts, GENS)
    assert_pressure_stats(engine.stats, results)
    assert spy.released > 0
    assert_all_match(hf, prompts, GENS, results)
    assert ctx.kv_group_usage()["held"] == [0, 0]


def test_every_layer_windowed_past_the_buffer():
    """Mistral with two rows, whose window's worst case (9 blocks) fits the 10-block buffer:
    group 0's blocks cost nothing and never pause a request, prompts of up to 40 tokens run in
    chunks of 16 past what the buffer holds of every layer, tokens equal transformers'."""
    hf = tiny_family("mistral")
    prompts = make_prompts(LENGTHS[:6], VOCAB, seed=3)
    gens = [24, 16, 24, 50, 24, 20]
    engine = engine_for(hf, max_requests=2, record_logits=True)
    ctx = engine.context
    usage = ctx.kv_group_usage()
    assert usage["blocks"][1] == 9 and usage["blocks"][0] > 10
    spy = ReleaseSpy(ctx)
    results = run_workload(engine, prompts, gens)
    assert engine.stats.pauses == 0 and engine.stats.chunked_prefills > 0
    assert max(len(p) + g for p, g in zip(prompts, gens)) > 10 * 8
    assert spy.released > 0
    assert_all_match(hf, prompts, gens, results)


def test_a_windowed_pool_smaller_than_group_zero():
    """A buffer larger than the windowed group's worst case: the windowed layers' pool is
    smaller than group 0's, and group 0 has more blocks than the context without groups."""
    hf = family_model("gemma3", 6)
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = engine_for(hf, blocks=24, paused_blocks=4, max_requests=4, record_logits=True)
    plain = engine_for(hf, blocks=24, paused_blocks=4, max_requests=4, kv_groups=False)
    usage = engine.context.kv_group_usage()
    assert plain.context.kv_group_usage() is None
    windowed, main = usage["blocks"][1], usage["blocks"][0]
    assert windowed < main and main > plain.context.block_allocator.total_count
    assert usage["held_bytes"] == 0
    spy = ReleaseSpy(engine.context)
    results = run_workload(engine, prompts, GENS)
    assert spy.released > 0
    assert_all_match(hf, prompts, GENS, results)
    bound = math.ceil(WINDOW / 8) + 1
    assert bound * 4 < windowed   # decode rows alone never fill it


@pytest.mark.parametrize("family, layers", [("gemma3", 6), ("mistral", 2)])
def test_kv_offload_on_groups_matches_transformers(family, layers):
    """KV offload on groups (Gemma 3; Mistral, every layer windowed): an evicted request's
    group-0 blocks and each window's last blocks go to the host, and its re-add restores them
    instead of recomputing; tokens and step logits equal transformers'."""
    from e2e_helpers import gib_for_blocks
    from generic_families import kv_block_bytes
    from test_kv_offload import check_host_pool

    hf = family_model(family, layers) if family != "mistral" else tiny_family(family)
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = engine_for(hf, record_logits=True,
                        kv_offload_gb=gib_for_blocks(hf, 8, 64, kv_block_bytes(hf)))
    ctx = engine.context
    assert ctx.kv_group_usage()["layers"][0] == (family == "gemma3")
    results = run_workload(engine, prompts, GENS)
    assert_pressure_stats(engine.stats, results)
    stats = ctx.get_kv_offload_stats()
    assert stats["kv_offload_offloaded_requests"] == engine.stats.evictions
    assert stats["kv_offload_restored_requests"] > 0 and stats["kv_offload_restored_tokens"] > 0
    check_host_pool(ctx)
    assert_all_match(hf, prompts, GENS, results)


SHARED = [("gemma3", 6), ("gpt_oss", 2), ("mistral", 2)]


@pytest.mark.parametrize("family, layers", SHARED, ids=[f for f, _ in SHARED])
def test_prefix_caching_on_groups_matches_transformers(family, layers):
    """Prefix caching on KV groups: prompts sharing a 20-token prefix (windows of 6), the
    second wave arriving after the first finished (its hits read the windows' idle copies),
    under pauses and evictions: hits, windowed blocks released, tokens and step logits equal
    transformers'."""
    hf = family_model(family, layers) if family != "mistral" else tiny_family(family)
    prefix = make_prompts([20], VOCAB, seed=11)[0]
    prompts = [prefix + s for s in make_prompts([9, 1, 14, 3, 6, 11], VOCAB, seed=12)]
    prompts += [list(prompts[0])] + make_prompts([5], VOCAB, seed=13)
    gens = [16, 12, 16, 10, 8, 6, 16, 12]
    engine = engine_for(hf, enable_prefix_caching=True, record_logits=True)
    ctx = engine.context
    assert ctx.kv_groups and ctx.kv_group_usage()["layers"][0] == (layers == 6 or
                                                                    family == "gpt_oss")
    spy = ReleaseSpy(ctx)
    requests = greedy_requests(prompts, gens)
    results = engine.generate_requests(requests, arrival_steps=[0, 0, 1, 1, 2, 2, 30, 30])
    stats = engine.stats.prefix_cache
    assert stats["prefix_cache_hits"] >= 4, stats
    assert engine.stats.pauses > 0 and engine.stats.evictions > 0
    assert spy.released > 0
    assert_all_match(hf, prompts, gens, results)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])
def test_groups_through_the_triton_kernels(monkeypatch, family):
    """gpt-oss (sliding + full, sinks) and Mistral (every layer windowed: group 0 holds no
    layers, prefix caching on: the last request's prompt repeats the 21-token one, whose
    window's idle copies its hit reads) on the Triton kernels under TRITON_INTERPRET=1, the
    torch references refused: the windowed group's released entries (-1) are never read."""
    from e2e_helpers import assert_matches_transformers, gib_for_blocks, refuse_torch_references
    from generic_families import kv_block_bytes
    from sizing_warning import built
    from test_interpreter import REFERENCES

    from dynctx.engine import Engine

    refuse_torch_references(monkeypatch, list(REFERENCES)
                            + [("dynctx.kernels.paged_attention", "paged_attention_ref")])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = (family_model("gpt_oss", 2) if family == "gpt_oss" else tiny_family(family)).to(device)
    block_bytes = kv_block_bytes(hf)
    engine = built(lambda: Engine.from_transformers(
        hf, block_size_tokens=8, buffer_size_gb=gib_for_blocks(hf, 8, 12, block_bytes),
        paused_buffer_size_gb=gib_for_blocks(hf, 8, 1, block_bytes), max_tokens=16,
        max_requests=4, kernel_backend="triton", attention_backend="triton",
        record_logits=True, enable_prefix_caching=family == "mistral",
        prefix_caching_eviction_policy="lru"))
    assert engine.context.kv_group_usage()["layers"][0] == (family == "gpt_oss")
    spy = ReleaseSpy(engine.context)
    prompts = make_prompts([3, 21, 1], VOCAB, seed=32)
    prompts.append(prompts[1] + [5])
    gens = [4, 3, 4, 2]
    results = engine.generate_requests(greedy_requests(prompts, gens),
                                       arrival_steps=[0, 0, 1, 8])
    assert engine.model.attention_backend == "triton" and spy.outside > 0
    if family == "mistral":
        assert engine.stats.prefix_cache["prefix_cache_blocks_matched"] == 2
    monkeypatch.undo()
    assert_matches_transformers(hf.cpu(), prompts, gens, results)


def test_groups_under_the_graph_stand_in_runner():
    """Gemma 3 (sliding + full) under the CUDA-graph protocol (stand-in runner on a CPU,
    torch_static attention): the groups' tables are gathered into static buffers before each
    replay; tokens equal transformers'."""
    from dynctx.engine.graphs import StandInGraphRunner

    hf = family_model("gemma3", 2)
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = engine_for(hf, num_cuda_graphs=2, max_requests=8, record_logits=True)
    assert engine.context.kv_groups
    assert engine.model.attention_backend_request == "torch_static"
    runner = engine.graph_runner
    assert isinstance(runner, StandInGraphRunner) and runner.captures > 0
    spy = ReleaseSpy(engine.context)
    results = run_workload(engine, prompts, GENS)
    assert sum(runner.replays.values()) > 0 and spy.released > 0
    assert_all_match(hf, prompts, GENS, results)
