"""CUDA graph batch dimensions against megatron-core 0.16.1 (the oracle), on the CPU.

1. The ladder: ``build_cuda_graph_ladder`` equals ``CUDAGraphBatchDimensionBuilder.
   generate_cuda_graph_batch_dimensions_list`` (list, order included, and token counts) over a
   grid of configurations and a random sample; ``context_cuda_graph_ladder`` and our context's
   ``cuda_graph_batch_dimensions_list`` / ``cuda_graph_token_counts`` equal those of
   megatron's context built with the same arguments.
2. The per-step choice: ``match_cuda_graph`` equals ``match_graph_config`` (strict and not) on
   random step dimensions; and megatron's context, driven through random workloads with
   ``num_cuda_graphs`` set, makes at every step the choice (``using_cuda_graph_this_step()``,
   ``padded_batch_dimensions``, ``padded_active_token_count``, ``padded_active_request_count``)
   that ``select_step_dimensions`` makes from that step's counts; our context makes the same
   choices on the same workloads, and the rest of the step-by-step comparison still holds.
"""

from __future__ import annotations

import functools
import itertools
import random
import warnings

import megatron_oracle as mo  # noqa: E402
import pytest

from dynctx.context import (  # noqa: E402
    DynamicInferenceContext,
    DynamicInferenceRequest,
    MambaInferenceStateConfig,
    RequestOverflowError,
    SamplingParams,
    TokenOverflowError,
)
from dynctx.context.batch_dimensions import InferenceBatchDimensions as Dims  # noqa: E402
from dynctx.context.graph_ladder import (  # noqa: E402
    build_cuda_graph_ladder,
    context_cuda_graph_ladder,
    graph_attention_maxima,
    match_cuda_graph,
    select_step_dimensions,
)

OURS_FACTORY = mo.make_request_factory(DynamicInferenceRequest, SamplingParams)


@functools.lru_cache(maxsize=None)
def _megatron_batch_dimensions():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.inference import batch_dimensions_utils as mbd
    return mbd


def _t(dims):
    """Fields of an InferenceBatchDimensions (ours or megatron's) as a tuple."""
    if dims is None:
        return None
    return (dims.token_count, dims.prefill_req_count, dims.decode_req_count,
            dims.has_explicit_chunked_prefill_req)


def _megatron_ladder(kw):
    mbd = _megatron_batch_dimensions()
    dims, tokens = mbd.CUDAGraphBatchDimensionBuilder.generate_cuda_graph_batch_dimensions_list(
        tp_size=kw["tp_size"], num_cuda_graphs=kw["num_cuda_graphs"],
        cuda_graph_max_tokens=kw["cuda_graph_max_tokens"],
        cuda_graph_mixed_prefill_count=kw["cuda_graph_mixed_prefill_count"],
        max_requests=kw["max_requests"], max_tokens=kw["max_tokens"],
        max_sequence_length=kw["max_sequence_length"],
        use_cuda_graphs_for_non_decode_steps=kw["use_cuda_graphs_for_non_decode_steps"])
    return [_t(d) for d in dims], tokens


def _ours_ladder(kw):
    ladder = build_cuda_graph_ladder(**kw)
    tokens = ladder.cuda_graph_token_counts
    return [_t(d) for d in ladder], (None if tokens is None else list(tokens))


def _grid():
    for (tp, n, max_requests, tokens_mult, seq, non_decode, mixed, cap) in itertools.product(
            (1, 2, 3, 8), (None, 0, 1, 2, 5, 16, 300), (1, 4, 13, 64, 256), (1, 3),
            (1, 2, 100, 4096), (True, False), (None, 0, 1, 16, 48), ("reqs", None, 50)):
        if not non_decode and mixed not in (None, 16):
            continue  # mixed counts are ignored without non-decode graphs
        max_tokens = max_requests * tokens_mult
        yield dict(tp_size=tp, num_cuda_graphs=n, max_requests=max_requests,
                   max_tokens=max_tokens, max_sequence_length=seq,
                   use_cuda_graphs_for_non_decode_steps=non_decode,
                   cuda_graph_mixed_prefill_count=mixed,
                   cuda_graph_max_tokens=max_requests if cap == "reqs" else cap)


def _random_configs(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        max_requests = rng.randint(1, 600)
        yield dict(
            tp_size=rng.choice([1, 1, 2, 4, 8]), num_cuda_graphs=rng.randint(-2, 80),
            max_requests=max_requests, max_tokens=max_requests + rng.randint(0, 4000),
            max_sequence_length=rng.randint(1, 5000),
            use_cuda_graphs_for_non_decode_steps=rng.random() < 0.8,
            cuda_graph_mixed_prefill_count=rng.choice([None, -1, 0, rng.randint(1, 64)]),
            cuda_graph_max_tokens=rng.choice([None, max_requests, rng.randint(-10, 5000)]))


@pytest.mark.parametrize("source", ["grid", "random"])
def test_ladder_equals_megatron(source):
    configs = list(_grid()) if source == "grid" else list(_random_configs(0, 1500))
    nonempty = mixed = refused = 0
    for kw in configs:
        try:
            ref = _megatron_ladder(kw)
        except ValueError:
            # Megatron's range() gets a zero step when more graphs are asked for than the
            # decode cap min(cuda_graph_max_tokens, max_requests) has tokens; ours refuses too.
            refused += 1
            with pytest.raises(ValueError, match="more than the decode graphs' token cap"):
                _ours_ladder(kw)
            continue
        ours = _ours_ladder(kw)
        assert ours == ref, f"{kw}:\nours     {ours}\nmegatron {ref}"
        nonempty += bool(ref[0])
        mixed += any(d[1] for d in ref[0])
    # The grid really builds ladders, mixed ones included.
    assert nonempty > len(configs) // 2 and mixed > len(configs) // 10
    assert refused < len(configs) // 4


CONTEXT_CASES = [
    dict(num_cuda_graphs=n, max_requests=r, max_tokens=t, use_cuda_graphs_for_non_decode_steps=nd,
         cuda_graph_mixed_prefill_count=m)
    for n, r, t, nd, m in [
        (1, 16, 64, True, 16), (4, 16, 64, True, 4), (16, 16, 64, True, 2), (8, 16, 64, False, 16),
        (3, 24, 100, True, None), (7, 32, 256, True, 8), (1000, 8, 64, True, 1),
        (0, 16, 64, True, 16), (None, 16, 64, True, 16),
    ]
]


@pytest.mark.parametrize("case", CONTEXT_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_context_ladder_equals_megatron_context(case):
    cfg = dict(mo.base_config(total_blocks=65, paused_blocks=8), **case)
    ref = mo.make_megatron_context(**cfg)
    ref_dims = [_t(d) for d in ref.cuda_graph_batch_dimensions_list]
    ladder = context_cuda_graph_ladder(
        num_cuda_graphs=case["num_cuda_graphs"], max_requests=ref.max_requests,
        max_tokens=ref.max_tokens, max_sequence_length=ref.max_sequence_length,
        use_cuda_graphs_for_non_decode_steps=case["use_cuda_graphs_for_non_decode_steps"],
        cuda_graph_mixed_prefill_count=case["cuda_graph_mixed_prefill_count"])
    assert [_t(d) for d in ladder] == ref_dims
    tokens = ladder.cuda_graph_token_counts
    assert (None if tokens is None else list(tokens)) == ref.cuda_graph_token_counts
    ours = DynamicInferenceContext(**cfg, device="cpu")
    assert [_t(d) for d in ours.cuda_graph_batch_dimensions_list] == ref_dims
    assert ours.cuda_graph_token_counts == ref.cuda_graph_token_counts


def test_match_equals_megatron_on_random_steps():
    mbd = _megatron_batch_dimensions()
    rng = random.Random(3)
    kinds = {"graph": 0, "eager": 0, "strict-differs": 0}
    for kw in itertools.islice(_random_configs(5, 10_000), 120):
        kw["cuda_graph_max_tokens"] = kw["max_requests"]  # the context's cap
        ladder = build_cuda_graph_ladder(**kw)
        ref_list = [mbd.InferenceBatchDimensions(*_t(d)) for d in ladder]
        cap = max(1, min(kw["max_requests"], max(kw["max_tokens"], 1)))
        for _ in range(40):
            prefill = rng.choice([0, 0, 1, 2, rng.randint(0, cap)])
            decode = rng.randint(0 if prefill else 1, max(1, cap - prefill))
            tokens = decode + prefill * rng.randint(1, 8)
            chunked = prefill > 0 and rng.random() < 0.1
            step = Dims(tokens, prefill, decode, chunked)
            ref_step = mbd.InferenceBatchDimensions(*_t(step))
            loose = None
            for strict in (False, True):
                ours = match_cuda_graph(step, ladder.cuda_graph_batch_dimensions_list,
                                        strict=strict)
                ref = mbd.CUDAGraphBatchDimensionBuilder.match_graph_config(
                    ref_step, ref_list, strict=strict)
                assert _t(ours) == _t(ref), (kw, step, strict)
                kinds["graph" if ours is not None else "eager"] += 1
                if strict:
                    kinds["strict-differs"] += _t(ours) != loose
                loose = _t(ours)
    assert min(kinds.values()) > 20, kinds


# ------------------------------------------------------------------------------------------
# Random workloads: the per-step choice, as megatron's context makes it
# ------------------------------------------------------------------------------------------


class _Recorder:
    """Forwards everything to a context and records its graph choice after every
    ``initialize_attention_state``."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "choices", [])

    def __getattr__(self, name):
        value = getattr(self._ctx, name)
        if name != "initialize_attention_state":
            return value

        def initialize_attention_state(*args, **kwargs):
            out = value(*args, **kwargs)
            ctx = self._ctx
            self.choices.append(dict(
                batch=_t(ctx.batch_dimensions), padded=_t(ctx.padded_batch_dimensions),
                graph=bool(ctx.using_cuda_graph_this_step()),
                padded_tokens=int(ctx.padded_active_token_count),
                padded_requests=int(ctx.padded_active_request_count)))
            return out

        return initialize_attention_state

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


GRAPH_SETTINGS = {
    "decode-only-4": dict(num_cuda_graphs=4, use_cuda_graphs_for_non_decode_steps=False),
    "mixed2-16": dict(num_cuda_graphs=16, cuda_graph_mixed_prefill_count=2),
    "mixed4-3-r24-t100": dict(num_cuda_graphs=3, cuda_graph_mixed_prefill_count=4,
                              max_requests=24, max_tokens=100),
    "default-mixed16-8": dict(num_cuda_graphs=8),
    "mixed1-1-r32-t128": dict(num_cuda_graphs=1, cuda_graph_mixed_prefill_count=1,
                              max_requests=32, max_tokens=128),
}


def _workloads():
    for i, (name, setting) in enumerate(GRAPH_SETTINGS.items()):
        for seed in (i, 10 + i):
            base = mo.generate_workload(seed, n_requests=18, total_blocks=48, paused_blocks=8,
                                        max_prompt=70, arrival_span=10)
            if seed % 2:
                base = mo.workload_long_prompts(seed)
            yield mo.Workload(f"{name}-{base.name}", dict(base.config, **setting), base.requests,
                              base.stop_per_mille)


def _hybrid_workloads():
    """Hybrid (Mamba) workloads: megatron matches strictly, and runs eager whenever the engine
    flags an explicit chunked prefill (every chunk of a chunked prompt on a hybrid)."""
    from megatron.core.inference.contexts.attention_context.mamba_metadata import (
        MambaInferenceStateConfig as MegatronMambaConfig,
    )

    mamba = dict(num_layers=4, mamba_inference_state_config=MegatronMambaConfig(
        ["M", "-", "*", "-"], (6, 4), (2, 3, 5)))
    # Short prompts arriving over time: prefill steps of a few tokens among many decodes,
    # where strict and non-strict matching part.
    for seed, setting, prompt in ((3, dict(num_cuda_graphs=8, cuda_graph_mixed_prefill_count=2),
                                   70),
                                  (6, dict(num_cuda_graphs=4, cuda_graph_mixed_prefill_count=4),
                                   3)):
        base = mo.generate_workload(seed, n_requests=20, total_blocks=48, paused_blocks=8,
                                    max_prompt=prompt, arrival_span=30)
        yield mo.Workload(f"hybrid-{seed}", dict(base.config, **mamba, **setting), base.requests,
                          base.stop_per_mille)


WORKLOADS = {w.name: w for w in _workloads()}
HYBRID_WORKLOADS = {w.name: w for w in _hybrid_workloads()}


@functools.lru_cache(maxsize=None)
def _run(name, side):
    workload = WORKLOADS.get(name) or HYBRID_WORKLOADS[name]
    if side == "megatron":
        ctx = _Recorder(mo.make_megatron_context(**workload.config))
        factory = mo.megatron_request_factory
    else:
        config = dict(workload.config)
        mamba = config.get("mamba_inference_state_config")
        if mamba is not None:  # megatron's config class -> ours
            config["mamba_inference_state_config"] = MambaInferenceStateConfig(
                tuple(mamba.layer_type_list), tuple(mamba.mamba_conv_states_shape),
                tuple(mamba.mamba_ssm_states_shape))
        ctx = _Recorder(DynamicInferenceContext(**config, device="cpu"))
        factory = OURS_FACTORY
    records = mo.run_workload(ctx, workload, request_factory=factory)
    return ctx, records


def _expected(ctx, choice):
    """``select_step_dimensions`` applied to a recorded step's real counts."""
    return select_step_dimensions(
        Dims(*choice["batch"]), ctx.cuda_graph_batch_dimensions_list,
        strict=bool(ctx.is_hybrid_model), max_requests=int(ctx.max_requests),
        max_tokens=int(ctx.max_tokens), tp_size=1)


@pytest.mark.parametrize("name", list(WORKLOADS) + list(HYBRID_WORKLOADS))
def test_step_choice_equals_megatron_context(name):
    ref, _ = _run(name, "megatron")
    assert ref.choices
    for step, choice in enumerate(ref.choices):
        want = _expected(ref, choice)
        got_padded = want.padded_batch_dimensions
        ref_padded = choice["padded"]
        if not choice["graph"] and ref_padded[1] > 0:
            # Megatron's eager prefill padding is not capped at max_tokens; ours is
            # (docs/SEMANTICS.md §8, test_eager_prefill_padding_capped_at_max_tokens).
            ref_padded = (min(ref_padded[0], int(ref.max_tokens)),) + ref_padded[1:]
        assert (want.using_cuda_graph_this_step, _t(got_padded)) == (choice["graph"], ref_padded), (
            name, step, choice)
        assert want.padded_active_request_count == choice["padded_requests"]
        assert min(want.padded_active_token_count, int(ref.max_tokens)) == min(
            choice["padded_tokens"], int(ref.max_tokens))


def test_workloads_exercise_every_kind_of_choice():
    # No decode-only step runs eager at tp 1: the top decode graph has max_requests slots.
    counts = {"decode-graph": 0, "mixed-graph": 0, "eager-prefill": 0,
              "decodes-in-prefill-slots": 0}
    for name in WORKLOADS:
        ref, _ = _run(name, "megatron")
        for choice in ref.choices:
            batch, padded = choice["batch"], choice["padded"]
            if choice["graph"]:
                counts["mixed-graph" if padded[1] else "decode-graph"] += 1
                counts["decodes-in-prefill-slots"] += batch[2] > padded[2]
            else:
                assert batch[1], (name, choice)
                counts["eager-prefill"] += 1
    assert min(counts.values()) >= 3, counts


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_our_context_chooses_as_megatron(name):
    """Ours, with the same graphs, makes megatron's choice at every step; and the whole
    step-by-step comparison (lengths, positions, blocks, pauses, evictions) still holds."""
    ref, ref_records = _run(name, "megatron")
    ours, our_records = _run(name, "ours")
    assert len(ours.choices) == len(ref.choices)
    for step, (a, b) in enumerate(zip(ours.choices, ref.choices)):
        assert a["batch"] == b["batch"], (name, step)
        assert a["graph"] == b["graph"], (name, step, a, b)
        if a["graph"]:
            assert a == b, (name, step)
        else:
            want = _expected(ours, a)
            assert (a["padded"], a["padded_tokens"], a["padded_requests"]) == (
                _t(want.padded_batch_dimensions), want.padded_active_token_count,
                want.padded_active_request_count), (name, step)
    # max_seqlen_q/k: on graph steps megatron's graphed metadata reports static maxima
    # (graph_attention_maxima); ours still runs eager and reports the real ones.
    fields = tuple(f for f in mo.COMPARED_FIELDS if f not in (
        "newly_paused_ids", "padded_active_token_count", "max_seqlen_q", "max_seqlen_k"))
    diffs = mo.compare_records(our_records, ref_records, fields=fields)
    assert not diffs, "\n".join(map(str, diffs[:12]))
    for a, b, choice in zip(our_records, ref_records, ref.choices):
        assert a.padded_active_token_count == min(b.padded_active_token_count,
                                                  int(ref.max_tokens)), (name, a.step)
        maxima = (b.max_seqlen_q, b.max_seqlen_k)
        if choice["graph"]:
            assert maxima == graph_attention_maxima(Dims(*choice["padded"]),
                                                    int(ref.max_sequence_length)), (name, a.step)
        else:
            assert (a.max_seqlen_q, a.max_seqlen_k) == maxima, (name, a.step)


def test_hybrid_workloads_exercise_the_strict_choice():
    """On the hybrids, megatron's context is strict (``is_hybrid_model``): some steps get a
    bigger graph than the non-strict rule would give, and flagged chunked steps run eager."""
    stricter = chunked_eager = graph = 0
    for name in HYBRID_WORKLOADS:
        ref, _ = _run(name, "megatron")
        assert ref.is_hybrid_model
        for choice in ref.choices:
            batch = Dims(*choice["batch"])
            loose = match_cuda_graph(batch, ref.cuda_graph_batch_dimensions_list, strict=False)
            graph += choice["graph"]
            stricter += choice["graph"] and _t(loose) != choice["padded"]
            chunked_eager += batch.has_explicit_chunked_prefill_req and not choice["graph"]
    assert graph >= 20 and stricter >= 1 and chunked_eager >= 3, (graph, stricter, chunked_eager)


@pytest.mark.parametrize("name", list(HYBRID_WORKLOADS))
def test_our_hybrid_context_chooses_as_megatron(name):
    """Ours, strict as a hybrid, makes megatron's choice wherever the two agree on the step's
    counts. They differ only in the chunked flag of a first chunk: megatron's engine flags
    every chunk of a chunked prompt on a hybrid, ours marks only continuation chunks (the
    first chunk starts from zero state like any prefill; README, Hybrid). There ours applies
    the same rule to its own counts."""
    ref, ref_records = _run(name, "megatron")
    ours, our_records = _run(name, "ours")
    assert len(ours.choices) == len(ref.choices)
    flag_only = 0
    for step, (a, b) in enumerate(zip(ours.choices, ref.choices)):
        if a["batch"] == b["batch"]:
            assert a == b, (name, step, a, b)
            continue
        assert a["batch"][:3] == b["batch"][:3] and b["batch"][3] and not a["batch"][3], (
            name, step)
        flag_only += 1
        want = _expected(ours, a)
        assert (a["graph"], a["padded"]) == (want.using_cuda_graph_this_step,
                                             _t(want.padded_batch_dimensions)), (name, step)
    fields = tuple(f for f in mo.COMPARED_FIELDS if f not in (
        "newly_paused_ids", "padded_active_token_count", "max_seqlen_q", "max_seqlen_k"))
    diffs = mo.compare_records(our_records, ref_records, fields=fields)
    assert not diffs, "\n".join(map(str, diffs[:12]))


# ------------------------------------------------------------------------------------------
# Capture dummies: initialize_attention_state(construct_graph_dimensions=graph)
# ------------------------------------------------------------------------------------------


def _capture_state(ctx):
    """Everything a captured forward reads after ``initialize_attention_state``."""
    T, n = int(ctx.total_request_count), int(ctx.padded_active_token_count)
    ints = mo._ints
    cu_q, max_q = ctx.cu_query_lengths()
    cu_kv, kv_lens, _ = ctx.cu_kv_lengths()
    state = dict(
        batch=_t(ctx.batch_dimensions), padded=_t(ctx.padded_batch_dimensions),
        graph=bool(ctx.using_cuda_graph_this_step()), requests=T,
        active_tokens=int(ctx.active_token_count), prefill=int(ctx.num_prefill_requests),
        padded_tokens=n, padded_requests=int(ctx.padded_active_request_count),
        ids=ints(ctx.request_ids[:T]), query=ints(ctx.request_query_lengths[:T]),
        kv_offsets=ints(ctx.request_kv_length_offsets[:T]),
        output=ints(ctx.request_output_lengths[:T]),
        block_counts=ints(ctx.request_kv_block_counts[:T]),
        last_block=ints(ctx.request_last_kv_block_id[:T]),
        last_offset=ints(ctx.request_last_kv_block_offset[:T]),
        block_table=ints(ctx.request_to_kv_block_ids[:T]),
        input_ids=ints(ctx.token_to_input_ids[:n]), positions=ints(ctx.token_to_pos_ids[:n]),
        token_blocks=ints(ctx.token_to_block_idx[:n]),
        token_slots=ints(ctx.token_to_local_position_within_kv_block[:n]),
        cu_query=ints(cu_q[:T + 1]), cu_kv=ints(cu_kv[:T + 1]), kv_lengths=ints(kv_lens[:T]),
        total_avail=int(ctx.block_allocator.total_avail))
    if ctx.is_hybrid_model:
        state["mamba_slots"] = ints(ctx.mamba_metadata.request_to_mamba_state_idx[:T])
    return state


CAPTURE_SETTINGS = {
    "mixed": dict(num_cuda_graphs=4, cuda_graph_mixed_prefill_count=2),
    "decode-only": dict(num_cuda_graphs=3, use_cuda_graphs_for_non_decode_steps=False),
    "hybrid-mixed": dict(num_cuda_graphs=4, cuda_graph_mixed_prefill_count=3, hybrid=True),
}


@pytest.mark.parametrize("setting", list(CAPTURE_SETTINGS))
def test_capture_dummies_equal_megatron(setting):
    """For every graph of the ladder: the dummies, the step's dimensions (the graph itself),
    the tokens, positions, blocks and lengths equal megatron's; no block is allocated; after
    ``reset()`` both contexts run the same workload identically."""
    options = dict(CAPTURE_SETTINGS[setting])
    hybrid = options.pop("hybrid", False)
    workload = mo.generate_workload(2, n_requests=12, total_blocks=48, paused_blocks=8)
    config = dict(workload.config, max_requests=16, **options)
    if hybrid:
        from megatron.core.inference.contexts.attention_context.mamba_metadata import (
            MambaInferenceStateConfig as MegatronMambaConfig,
        )

        layers, conv, ssm = ("M", "-", "*", "-"), (6, 4), (2, 3, 5)
        config["num_layers"] = 4
        ref = mo.make_megatron_context(**config, mamba_inference_state_config=MegatronMambaConfig(
            list(layers), conv, ssm))
        ours = DynamicInferenceContext(**config, device="cpu",
                                       mamba_inference_state_config=MambaInferenceStateConfig(
                                           layers, conv, ssm))
    else:
        ref = mo.make_megatron_context(**config)
        ours = DynamicInferenceContext(**config, device="cpu")
    graphs = list(ours.cuda_graph_batch_dimensions_list)
    assert [_t(g) for g in graphs] == [_t(g) for g in ref.cuda_graph_batch_dimensions_list]
    assert any(g.prefill_req_count for g in graphs) != (setting == "decode-only")
    free = ours.block_allocator.total_avail
    mbd = _megatron_batch_dimensions()
    # The context's ladder has one token per prefill dummy (no graph holds more tokens than
    # max_requests); shapes given by hand give longer prefills, over several blocks, and the
    # step then runs in whatever graph fits, or eager.
    by_hand = [Dims(40, 3, 5), Dims(64, 2, 0), Dims(30, 1, 15), Dims(7, 0, 7)]
    for graph in graphs + by_hand:
        ours.initialize_attention_state(construct_graph_dimensions=graph)
        ref.initialize_attention_state(
            construct_graph_dimensions=mbd.InferenceBatchDimensions(*_t(graph)))
        a, b = _capture_state(ours), _capture_state(ref)
        assert a == b, (setting, str(graph), {k: (a[k], b[k]) for k in a if a[k] != b[k]})
        assert a["batch"] == _t(graph) and a["total_avail"] == free
        if graph in graphs:
            assert a["graph"] and a["padded"] == _t(graph)
        ours.reset()
        ref.reset()
    if not hybrid:
        records = [mo.run_workload(ctx, workload, request_factory=factory) for ctx, factory in (
            (ours, OURS_FACTORY), (ref, mo.megatron_request_factory))]
        fields = tuple(f for f in mo.COMPARED_FIELDS if f not in (
            "newly_paused_ids", "padded_active_token_count", "max_seqlen_q", "max_seqlen_k"))
        assert not mo.compare_records(*records, fields=fields)


def test_capture_dummies_refuse_what_they_cannot_build():
    ctx = DynamicInferenceContext(**mo.base_config(total_blocks=33, paused_blocks=8),
                                  device="cpu", num_cuda_graphs=2)
    with pytest.raises(ValueError, match="explicit chunked prefill"):
        ctx.add_dummy_requests_for_cudagraph_capture(Dims(8, 2, 6, True))
    with pytest.raises(ValueError, match="prefill tokens for 4 prefill requests"):
        ctx.add_dummy_requests_for_cudagraph_capture(Dims(14, 4, 12))
    with pytest.raises(TypeError, match="must be an InferenceBatchDimensions"):
        ctx.add_dummy_requests_for_cudagraph_capture((8, 0, 8))
    # A float count reached torch.zeros' TypeError; True was taken as one prefill request.
    with pytest.raises(TypeError, match="token_count=8.0 must be an int"):
        ctx.add_dummy_requests_for_cudagraph_capture(Dims(8.0, 1, 6))
    with pytest.raises(TypeError, match="prefill_req_count=True must be an int"):
        ctx.add_dummy_requests_for_cudagraph_capture(Dims(8, True, 6))
    with pytest.raises(RequestOverflowError, match="17 requests > max_requests"):
        ctx.add_dummy_requests_for_cudagraph_capture(Dims(17, 0, 17))
    with pytest.raises(TokenOverflowError, match="80 tokens > max_tokens"):
        ctx.add_dummy_requests_for_cudagraph_capture(Dims(80, 2, 14))
    assert ctx.total_request_count == 0 and ctx.active_token_count == 0
    ctx.add_dummy_requests_for_cudagraph_capture(Dims(8, 0, 8))
    with pytest.raises(RuntimeError, match="needs an empty context, it holds 8 requests"):
        ctx.add_dummy_requests_for_cudagraph_capture(Dims(8, 0, 8))
