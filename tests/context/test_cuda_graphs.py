"""The CUDA graph ladder and the per-step graph choice (context/graph_ladder.py), on their own.

Hand-worked cases and properties; the equality with megatron-core 0.16.1 is checked in
test_cuda_graphs_megatron.py.
"""

from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch

from dynctx.context.batch_dimensions import InferenceBatchDimensions as Dims
from dynctx.context.graph_ladder import (
    attention_batch_dimensions,
    build_cuda_graph_ladder,
    context_cuda_graph_ladder,
    cuda_graph_token_counts,
    dummy_request_plan,
    eager_padded_dimensions,
    graph_attention_maxima,
    graph_fits_step,
    is_valid_graph_dimensions,
    match_cuda_graph,
    select_step_dimensions,
)


def test_token_counts_worked_examples():
    # Megatron's docstring gives [1000, 752, 504, 256] here; its code (and ours) gives this:
    # the step 250 rounds up to 256.
    assert cuda_graph_token_counts(2, 4, 1000) == [1000, 768, 512, 256]
    assert cuda_graph_token_counts(1, 1, 37) == [37]
    # 64 / 8 = 8 per graph: every multiple of 8.
    assert cuda_graph_token_counts(1, 8, 64) == [64, 56, 48, 40, 32, 24, 16, 8]
    # 100 / 3 = 33 -> rounded up to 40; the top is kept even off the step.
    assert cuda_graph_token_counts(1, 3, 100) == [100, 80, 40]
    # tp 3: step 40 -> 42, the top 100 -> 99.
    assert cuda_graph_token_counts(3, 3, 100) == [99, 84, 42]


def test_token_counts_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_cuda_graphs=9 must be <= cuda_graph_max_tokens=8"):
        cuda_graph_token_counts(1, 9, 8)
    with pytest.raises(ValueError, match="tp_size=0 must be >= 1"):
        cuda_graph_token_counts(0, 2, 8)
    with pytest.raises(TypeError, match="num_cuda_graphs=2.0 must be an int"):
        cuda_graph_token_counts(1, 2.0, 8)
    with pytest.raises(TypeError, match="num_cuda_graphs=True must be an int"):
        build_cuda_graph_ladder(num_cuda_graphs=True, max_requests=8, max_tokens=8,
                                max_sequence_length=16)
    with pytest.raises(ValueError, match="max_requests=0 must be >= 1"):
        build_cuda_graph_ladder(num_cuda_graphs=2, max_requests=0, max_tokens=8,
                                max_sequence_length=16)


def test_no_graphs_without_num_cuda_graphs():
    ladder = build_cuda_graph_ladder(num_cuda_graphs=None, max_requests=64, max_tokens=256,
                                     max_sequence_length=512)
    assert ladder.cuda_graph_batch_dimensions_list == () and ladder.cuda_graph_token_counts is None
    assert match_cuda_graph(Dims(4, 0, 4), ladder) is None


def test_decode_only_ladder_worked_example():
    ladder = context_cuda_graph_ladder(num_cuda_graphs=4, max_requests=64, max_tokens=256,
                                       max_sequence_length=512,
                                       use_cuda_graphs_for_non_decode_steps=False)
    assert ladder.cuda_graph_batch_dimensions_list == (
        Dims(64, 0, 64), Dims(48, 0, 48), Dims(32, 0, 32), Dims(16, 0, 16))
    assert ladder.cuda_graph_token_counts == (64, 48, 32, 16)


def test_mixed_ladder_worked_example():
    # cap = max_requests = 32, 2 graphs: token counts [32, 16]; mixed count 4.
    ladder = context_cuda_graph_ladder(num_cuda_graphs=2, max_requests=32, max_tokens=128,
                                       max_sequence_length=8, cuda_graph_mixed_prefill_count=4)
    # mixed (n, 4, n - 4); prefill-only (n, max(4, ceil(n / 7), n), 0) when max(4, ceil(n / 7))
    # is < 32 requests; decode (n, 0, n). Sorted by prefill tokens, then decode requests,
    # both descending.
    assert list(ladder) == [
        Dims(32, 32, 0), Dims(16, 16, 0), Dims(32, 4, 28), Dims(16, 4, 12), Dims(32, 0, 32),
        Dims(16, 0, 16)]
    assert ladder.cuda_graph_token_counts == (32, 16)
    assert len(ladder) == 6
    # The mixed count is capped at max_requests and the prefill-only shape dropped at the cap.
    small = context_cuda_graph_ladder(num_cuda_graphs=1, max_requests=8, max_tokens=64,
                                      max_sequence_length=64, cuda_graph_mixed_prefill_count=16)
    assert list(small) == [Dims(8, 8, 0), Dims(8, 0, 8)]


@pytest.mark.parametrize("mixed,non_decode", [(None, True), (0, True), (-3, True), (16, False)])
def test_decode_only_when_mixed_graphs_are_off(mixed, non_decode):
    ladder = context_cuda_graph_ladder(num_cuda_graphs=3, max_requests=24, max_tokens=64,
                                       max_sequence_length=64, cuda_graph_mixed_prefill_count=mixed,
                                       use_cuda_graphs_for_non_decode_steps=non_decode)
    assert len(ladder) and all(d.prefill_req_count == 0 for d in ladder)


def test_num_cuda_graphs_is_clamped_as_megatron():
    kw = dict(max_requests=16, max_tokens=64, max_sequence_length=64,
              use_cuda_graphs_for_non_decode_steps=False)
    one = context_cuda_graph_ladder(num_cuda_graphs=1, **kw)
    for n in (0, -5):
        assert context_cuda_graph_ladder(num_cuda_graphs=n, **kw) == one
    # More graphs than tokens: one per token count, 8 apart.
    assert context_cuda_graph_ladder(num_cuda_graphs=1000, **kw).cuda_graph_token_counts == (
        16, 8)


def test_cuda_graph_max_tokens_out_of_range_means_max_tokens():
    kw = dict(num_cuda_graphs=2, max_requests=64, max_tokens=128, max_sequence_length=256)
    full = build_cuda_graph_ladder(**kw)
    for cap in (None, 0, -1, 129):
        assert build_cuda_graph_ladder(**kw, cuda_graph_max_tokens=cap) == full
    assert build_cuda_graph_ladder(**kw, cuda_graph_max_tokens=64).cuda_graph_token_counts[0] == 64


def _random_ladders(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        max_requests = rng.choice([1, 3, 8, 16, 24, 64, 100])
        yield dict(
            num_cuda_graphs=rng.choice([1, 2, 3, 5, 8, 16, 64]),
            max_requests=max_requests,
            max_tokens=max_requests * rng.choice([1, 2, 4]) + rng.choice([0, 5]),
            max_sequence_length=rng.choice([1, 2, 7, 64, 4096]),
            tp_size=rng.choice([1, 1, 2, 4]),
            use_cuda_graphs_for_non_decode_steps=rng.random() < 0.7,
            cuda_graph_mixed_prefill_count=rng.choice([None, 1, 2, 4, 16]),
        )


def test_ladder_properties():
    """Every shape is valid, unique, within the request budget and the token cap, never
    chunked; the list is sorted as documented; the token counts are its own, descending."""
    for kw in _random_ladders(0, 300):
        ladder = context_cuda_graph_ladder(**kw)
        dims = list(ladder)
        assert dims, kw
        assert len(set(dims)) == len(dims)
        for d in dims:
            assert is_valid_graph_dimensions(d, kw["max_requests"], kw["max_sequence_length"])
            assert d.token_count <= kw["max_requests"] and not d.has_explicit_chunked_prefill_req
        keys = [(d.token_count - d.decode_req_count, d.decode_req_count) for d in dims]
        assert keys == sorted(keys, reverse=True)
        assert list(ladder.cuda_graph_token_counts) == sorted({d.token_count for d in dims},
                                                              reverse=True)
        if not kw["use_cuda_graphs_for_non_decode_steps"] or not kw[
                "cuda_graph_mixed_prefill_count"]:
            assert all(d.prefill_req_count == 0 for d in dims)


def test_fits_rules():
    g = Dims(32, 4, 28)
    assert graph_fits_step(g, Dims(20, 2, 10))
    assert not graph_fits_step(g, Dims(33, 2, 10))  # tokens
    assert not graph_fits_step(g, Dims(20, 5, 1))  # prefill slots
    # Non-strict: prefill slots take decode requests (4 + 28 >= 2 + 30).
    assert graph_fits_step(g, Dims(32, 2, 30))
    assert not graph_fits_step(g, Dims(32, 2, 30), strict=True)
    assert not graph_fits_step(g, Dims(32, 2, 31))  # 33 requests
    # Decode-only steps take decode-only graphs only.
    assert not graph_fits_step(g, Dims(8, 0, 8))
    assert graph_fits_step(Dims(8, 0, 8), Dims(5, 0, 5))
    assert not graph_fits_step(Dims(8, 0, 8), Dims(2, 1, 1))
    # A chunked-prefill step never takes an unchunked graph.
    assert not graph_fits_step(g, Dims(20, 2, 10, True))


def test_match_takes_the_smallest_fitting_graph():
    ladder = context_cuda_graph_ladder(num_cuda_graphs=4, max_requests=64, max_tokens=256,
                                       max_sequence_length=512, cuda_graph_mixed_prefill_count=8)
    rng = random.Random(1)
    for _ in range(500):
        prefill = rng.choice([0, 0, 1, 3, 8, 9])
        decode = rng.randint(0 if prefill else 1, 60)
        tokens = decode + prefill * rng.randint(1, 6)
        step = Dims(tokens, prefill, decode, rng.random() < 0.1 and prefill > 0)
        best = match_cuda_graph(step, ladder.cuda_graph_batch_dimensions_list)
        fitting = [g for g in ladder if graph_fits_step(g, step)]
        assert best == (min(fitting) if fitting else None)
        # The ladder's remembered matching (twice: computed, then looked up) agrees.
        for _ in range(2):
            assert match_cuda_graph(step, ladder) == best == ladder.match(step)
        strict_fitting = [g for g in ladder if graph_fits_step(g, step, strict=True)]
        assert ladder.match(step, strict=True) == (min(strict_fitting) if strict_fitting
                                                   else None)
        if best is not None:
            assert best.token_count >= tokens and best.req_count >= step.req_count


def test_eager_padding():
    kw = dict(max_requests=48, max_tokens=100)
    assert eager_padded_dimensions(Dims(5, 0, 5), **kw) == Dims(48, 0, 48)
    assert eager_padded_dimensions(Dims(5, 0, 5), max_requests=256, max_tokens=512) == Dims(
        64, 0, 64)
    # Prefill: tokens rounded to 64 and capped at max_tokens; requests rounded to 4.
    assert eager_padded_dimensions(Dims(70, 2, 3), **kw) == Dims(100, 5, 3)
    assert eager_padded_dimensions(Dims(10, 1, 0, True), **kw) == Dims(64, 4, 0, True)
    # tp 3: rounders 66 and 6.
    assert eager_padded_dimensions(Dims(10, 1, 0), max_requests=48, max_tokens=200,
                                   tp_size=3) == Dims(66, 6, 0)


def test_select_and_attention_dimensions():
    ladder = context_cuda_graph_ladder(num_cuda_graphs=2, max_requests=32, max_tokens=128,
                                       max_sequence_length=8, cuda_graph_mixed_prefill_count=4)
    kw = dict(max_requests=32, max_tokens=128)
    # 2 prefills + 20 decodes, 30 tokens: (32, 4, 28) fits; the decodes fit its decode slots.
    choice = select_step_dimensions(Dims(30, 2, 20), ladder, strict=False, **kw)
    assert choice.using_cuda_graph_this_step and choice.padded_batch_dimensions == Dims(32, 4, 28)
    assert choice.padded_active_token_count == 32 and choice.padded_active_request_count == 32
    assert choice.attn_batch_dimensions == Dims(30, 2, 20)
    # 1 prefill + 14 decodes, 16 tokens: (16, 4, 12) is the smallest fit (15 requests in 16
    # slots); 14 decodes are more than its 12 decode slots, so attention counts 2 as prefills.
    choice = select_step_dimensions(Dims(16, 1, 14), ladder, strict=False, **kw)
    assert choice.padded_batch_dimensions == Dims(16, 4, 12)
    assert choice.attn_batch_dimensions == Dims(16, 3, 12)
    # Strict (hybrid): prefill slots cannot take decodes -> (32, 4, 28).
    choice = select_step_dimensions(Dims(16, 1, 14), ladder, strict=True, **kw)
    assert choice.padded_batch_dimensions == Dims(32, 4, 28)
    # Too many tokens for any graph: eager.
    choice = select_step_dimensions(Dims(40, 2, 20), ladder, strict=False, **kw)
    assert not choice.using_cuda_graph_this_step
    assert choice.padded_batch_dimensions == Dims(64, 4, 20)
    assert choice.attn_batch_dimensions == Dims(40, 2, 20)
    assert attention_batch_dimensions(Dims(5, 0, 5), None) == Dims(5, 0, 5)


@pytest.mark.parametrize("graph,plan", [
    (Dims(16, 0, 16), (16, [])),
    (Dims(16, 4, 12), (12, [1, 1, 1, 1])),
    (Dims(32, 3, 20), (20, [4, 4, 4])),
    (Dims(30, 4, 0), (0, [8, 8, 7, 7])),
])
def test_dummy_request_plan(graph, plan):
    assert dummy_request_plan(graph) == plan
    decode, prefills = plan
    assert decode + sum(prefills) == graph.token_count


def test_dummy_request_plan_errors():
    with pytest.raises(ValueError, match="explicit chunked prefill"):
        dummy_request_plan(Dims(16, 4, 12, True))
    with pytest.raises(ValueError, match="3 prefill tokens for 4 prefill requests"):
        dummy_request_plan(Dims(15, 4, 12))
    with pytest.raises(ValueError, match="decode-only graph needs token_count == decode"):
        dummy_request_plan(Dims(16, 0, 12))


def test_every_context_graph_has_a_dummy_plan():
    for kw in itertools.islice(_random_ladders(2, 200), 200):
        for graph in context_cuda_graph_ladder(**kw):
            if graph.token_count == 0:
                continue
            decode, prefills = dummy_request_plan(graph)
            assert decode + sum(prefills) == graph.token_count
            assert all(0 < n <= kw["max_sequence_length"] for n in prefills)


def test_graph_attention_maxima():
    assert graph_attention_maxima(Dims(16, 0, 16), 4096) == (1, 4096)
    assert graph_attention_maxima(Dims(16, 4, 12), 4096) == (16, 4096)
    assert graph_attention_maxima(Dims(1, 1, 0), 64) == (2, 64)


# ------------------------------------------------------------------------------------------
# The context: the ladder at construction, the choice in initialize_attention_state
# ------------------------------------------------------------------------------------------


def _small_context(**overrides):
    from helpers import make_ctx

    return make_ctx(**overrides)


def _small_hybrid(**overrides):
    from helpers import GIB

    from dynctx.context import DynamicInferenceContext, MambaInferenceStateConfig

    block_bytes = 4 * 2 * 1 * 4 * 2 * 8 + 4 * (24 + 30)  # one KV block + one Mamba state
    args = dict(params_dtype=torch.float32, num_layers=4, kv_channels=8, num_attention_heads=2,
                max_sequence_length=64, buffer_size_gb=40 * block_bytes / GIB,
                paused_buffer_size_gb=8 * block_bytes / GIB, block_size_tokens=4,
                max_tokens=64, max_requests=8, unified_memory_level=0, device="cpu",
                mamba_inference_state_config=MambaInferenceStateConfig(
                    ("M", "-", "*", "-"), (6, 4), (2, 3, 5)))
    args.update(overrides)
    return DynamicInferenceContext(**args)


def test_context_builds_the_ladder_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = _small_context(num_cuda_graphs=2, cuda_graph_mixed_prefill_count=2,
                             max_requests=16)
    assert ctx.num_cuda_graphs == 2
    # Capped at max_requests = 16 tokens, 2 graphs: token counts 16 and 8.
    assert ctx.cuda_graph_batch_dimensions_list == [
        Dims(16, 16, 0), Dims(8, 8, 0), Dims(16, 2, 14), Dims(8, 2, 6), Dims(16, 0, 16),
        Dims(8, 0, 8)]
    assert ctx.cuda_graph_token_counts == [16, 8]
    plain = _small_context()
    assert plain.cuda_graph_batch_dimensions_list == [] and plain.cuda_graph_token_counts is None
    with pytest.raises(TypeError, match="num_cuda_graphs=2.5 must be an int"):
        _small_context(num_cuda_graphs=2.5)


def _one_prefill_seven_decodes(ctx):
    """Step 1: seven 1-token prefills; step 2: one 1-token prefill and seven decodes."""
    from helpers import add, request, step

    for rid in range(7):
        add(ctx, request(rid, 1))
    step(ctx)
    add(ctx, request(7, 1))
    ctx.initialize_attention_state()


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_context_step_runs_in_the_matching_graph(hybrid):
    make = _small_hybrid if hybrid else _small_context
    ctx = make(num_cuda_graphs=2, cuda_graph_mixed_prefill_count=2, max_requests=16)
    _one_prefill_seven_decodes(ctx)
    assert ctx.batch_dimensions == Dims(8, 1, 7)
    assert ctx.using_cuda_graph_this_step()
    # Non-strict: (8, 2, 6) takes the seventh decode in a prefill slot; a hybrid's decodes need
    # decode slots (strict), so it runs in (16, 2, 14).
    want = Dims(16, 2, 14) if hybrid else Dims(8, 2, 6)
    assert ctx.padded_batch_dimensions == want
    assert ctx.padded_active_token_count == want.token_count
    assert ctx.padded_active_request_count == want.req_count
    ids, pos = ctx.current_input_and_position_ids()
    assert ids.shape == pos.shape == (1, want.token_count)
    # Padding tokens write to the dummy block at position 0; padding rows have no tokens.
    pad = slice(8, want.token_count)
    assert torch.all(ctx.token_to_block_idx[pad] == ctx.block_allocator.dummy_block_idx)
    assert torch.all(ctx.token_to_pos_ids[pad] == 0)
    meta = ctx.active_attn_metadata
    assert meta.query_lengths.tolist() == [1] * 8 + [0] * (want.req_count - 8)
    assert meta.cu_query_seq_lengths.tolist()[-1] == 8
    if hybrid:
        mamba = ctx.mamba_metadata
        assert mamba.batch_indices_decode.shape[0] == want.decode_req_count
        assert mamba.batch_indices_prefill.shape[0] == want.prefill_req_count
        assert mamba.batch_indices_decode[7:].tolist() == [-1] * 7


def test_context_without_graphs_pads_eagerly():
    ctx = _small_context(max_requests=16)
    _one_prefill_seven_decodes(ctx)
    assert not ctx.using_cuda_graph_this_step()
    assert ctx.padded_batch_dimensions == Dims(64, 1, 7)
    assert ctx.padded_active_request_count == 8


def test_docs_semantics_worked_examples():
    """Megatron-Core 0.16.1's behaviour as worked out by hand from its source: the 42-entry
    ladder at max_requests 448, the ladders its engine test expects at max_requests 80, and
    matching examples on the 42-entry ladder."""
    ladder = context_cuda_graph_ladder(num_cuda_graphs=16, max_requests=448, max_tokens=8192,
                                       max_sequence_length=512)
    assert ladder.cuda_graph_token_counts == tuple(range(448, 0, -32))
    assert len(ladder) == 42
    sizes = range(32, 449, 32)
    assert set(ladder) == ({Dims(s, s, 0) for s in sizes} | {Dims(s, 16, s - 16) for s in sizes}
                           | {Dims(s, 0, s) for s in sizes})
    decode_only = context_cuda_graph_ladder(num_cuda_graphs=16, max_requests=448,
                                            max_tokens=8192, max_sequence_length=512,
                                            use_cuda_graphs_for_non_decode_steps=False)
    assert list(decode_only) == [Dims(s, 0, s) for s in reversed(sizes)]
    for n, counts in ((0, [80]), (1, [80]), (2, [80, 40]), (4, [80, 72, 48, 24]),
                      (8, [80, 64, 48, 32, 16]), (16, list(range(80, 0, -8))),
                      (32, list(range(80, 0, -8)))):
        got = context_cuda_graph_ladder(num_cuda_graphs=n, max_requests=80, max_tokens=8192,
                                        max_sequence_length=512)
        assert list(got.cuda_graph_token_counts) == counts, n
    graphs = ladder.cuda_graph_batch_dimensions_list
    assert match_cuda_graph(Dims(37, 0, 37), graphs) == Dims(64, 0, 64)
    assert match_cuda_graph(Dims(100, 2, 30), graphs) == Dims(128, 16, 112)
    assert match_cuda_graph(Dims(40, 20, 10), graphs) == Dims(64, 64, 0)
    assert match_cuda_graph(Dims(40, 20, 10), graphs, strict=True) is None
    assert match_cuda_graph(Dims(449, 0, 449), graphs) is None
    assert match_cuda_graph(Dims(449, 3, 10), graphs) is None
