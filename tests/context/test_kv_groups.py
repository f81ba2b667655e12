"""KV groups (context/kv_groups.py, docs/SEMANTICS.md §22): the memory a window frees, measured
(``bench/kv_groups.py``), the budget rule, the single-group default and the refusals. The state
machine's ``kvg-*`` configurations (``tests/context/machine_groups.py``) check every step's
invariants and cached K/V under pauses, evictions, chunks, suspends and resets."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import BLOCK, GIB, context_args, make_ctx

from dynctx.context import DynamicInferenceContext, MambaInferenceStateConfig
from dynctx.context.kv_cache import KVCache
from dynctx.context.kv_groups import GroupedKV, group_block_counts, group_spec, worst_case_blocks

WINDOWS = [None, 6]     # the helpers' two layers: one full, one of window 6


def grouped(**overrides):
    return make_ctx(**dict(dict(kv_layer_windows=WINDOWS), **overrides))


def test_gemma3_figure_within_the_goal():
    """One request driven to 8K tokens on a Gemma-3-shaped context: its KV bytes with groups
    are at most 1/6 + 5/6 (W + block) / 8K of every layer full, the windowed group holding
    ceil(W / block) + 1 blocks."""
    from kv_groups import figure  # bench/ is on the tests' path (pyproject)

    result = figure()
    grouped_usage, full = result["grouped"], result["full"]
    assert grouped_usage["cached_tokens"] == full["cached_tokens"] == 8192
    assert grouped_usage["layers"] == [5, 29] and grouped_usage["windows"] == [None, 1024]
    # Group 0 holds what every layer held without groups; the window its bound.
    assert grouped_usage["held"] == [full["held"][0], math.ceil(1024 / 256) + 1]
    assert result["ratio"] <= result["issue_goal"]
    assert result["ratio"] == pytest.approx((5 * 33 + 29 * 5) / (34 * 33))


def test_budget_rule():
    """A windowed group gets its worst case, capped at group 0's blocks; group 0 the rest of
    the layer-blocks the context would allocate without groups."""
    spec = group_spec([None, 8, 8, None, 8, 8], True, num_attention_layers=6,
                      max_sequence_length=128, speculative=0, mla=False,
                      hybrid=False)
    assert spec.windows == (None, 8) and spec.layers == ((0, 3), (1, 2, 4, 5))
    worst = worst_case_blocks(8, block_size=4, max_requests=4, max_tokens=16)
    assert worst == math.ceil((16 + 4 * 8) / 4) + 2 * 4 + 1
    main, windowed = group_block_counts(spec, 60, block_size=4, max_requests=4, max_tokens=16)
    assert windowed == [worst] and main == (60 * 6 - worst * 4) // 2
    # A buffer too small for the worst case: the group has group 0's count (no saving).
    main, windowed = group_block_counts(spec, 10, block_size=4, max_requests=4, max_tokens=16)
    assert windowed == [main] == [10]


def test_grouped_context_sizes_and_usage():
    ctx = grouped()
    plain = make_ctx()
    usage = ctx.kv_group_usage()
    assert ctx.kv_groups is True and ctx.kv_layer_windows == WINDOWS
    assert usage["windows"] == [None, 6] and usage["layers"] == [1, 1]
    assert usage["held"] == [0, 0] and usage["held_bytes"] == 0
    assert usage["blocks"][0] >= plain.block_allocator.total_count
    kv = ctx._kv
    assert isinstance(kv, GroupedKV)
    assert kv.nbytes() <= plain._kv.nbytes()
    assert ctx.key_value_cache(1)[0].shape[0] == usage["blocks"][0]
    assert ctx.key_value_cache(2)[0].shape[0] == usage["blocks"][1]


@pytest.mark.parametrize("overrides", [dict(), dict(kv_layer_windows=WINDOWS, kv_groups=False),
                                       dict(kv_layer_windows=[6, 6], kv_groups=False),
                                       dict(kv_layer_windows=[None, None]),
                                       dict(kv_layer_windows=[None, 64]),
                                       dict(kv_layer_windows=[64, 80])],
                         ids=["no-windows", "off", "all-windowed-off", "all-full",
                              "window-ge-max", "windows-ge-max"])
def test_single_group_is_todays_context(overrides):
    """No windows, kv_groups=False, or no window shorter than the sequence: the single-group
    context, exactly (its KV cache, its buffer, no group hook in the step)."""
    ctx, plain = make_ctx(**overrides), make_ctx()
    assert type(ctx._kv) is KVCache and ctx._forward.kv_groups is None
    assert ctx.kv_group_usage() is None and ctx.kv_groups is False
    assert ctx.memory_buffer.shape == plain.memory_buffer.shape
    assert ctx.block_allocator.total_count == plain.block_allocator.total_count


@pytest.mark.parametrize("windows, error, match", [
    ([None], ValueError, r"kv_layer_windows has 1 entries; the context has 2 attention layers"),
    ([None, 0], ValueError, r"kv_layer_windows\[1\]=0 must be an int >= 1"),
    ([True, None], ValueError, r"kv_layer_windows\[0\]=True"),
    ([None, 2.5], ValueError, r"kv_layer_windows\[1\]=2.5"),
    ("6", TypeError, r"kv_layer_windows='6' must be a list"),
    (6, TypeError, r"kv_layer_windows=6 must be a list"),
])
def test_bad_windows(windows, error, match):
    with pytest.raises(error, match=match):
        DynamicInferenceContext(**context_args(kv_layer_windows=windows))


def test_bad_kv_groups():
    with pytest.raises(TypeError, match=r"kv_groups=1 must be a bool"):
        DynamicInferenceContext(**context_args(kv_layer_windows=WINDOWS, kv_groups=1))


@pytest.mark.parametrize("overrides, named", [
    (dict(cache_mla_latent=True, kv_lora_rank=8, qk_pos_emb_head_dim=4),
     "cache_mla_latent=True"),
    (dict(mamba_inference_state_config=MambaInferenceStateConfig(["*", "M", "*"], (3, 2),
                                                                 (2, 2, 3))),
     r"a hybrid model \(mamba_inference_state_config\)"),
])
def test_refused_combinations_name_the_argument(overrides, named):
    with pytest.raises(ValueError, match=f"KV groups .* do not support {named}.*kv_groups=False"):
        DynamicInferenceContext(**context_args(kv_layer_windows=WINDOWS, **overrides))
    # kv_groups=False keeps them (the single group).
    ctx = DynamicInferenceContext(**context_args(kv_layer_windows=WINDOWS, kv_groups=False,
                                                 **overrides))
    assert ctx.kv_group_usage() is None


@pytest.mark.parametrize("overrides", [
    dict(enable_prefix_caching=True), dict(num_speculative_tokens=2),
    dict(kv_cache_dtype="fp8"), dict(kv_offload_gb=8 * BLOCK / GIB),
    dict(kv_cache_management_mode="offload")],
    ids=["prefix-caching", "speculative", "fp8", "offload", "offload-mode"])
@pytest.mark.parametrize("windows", [WINDOWS, [6, 9]], ids=["mixed", "all-windowed"])
def test_served_combinations_keep_groups(overrides, windows):
    """Prefix caching, speculative steps, an FP8 cache and KV offload run on groups."""
    ctx = DynamicInferenceContext(**context_args(kv_layer_windows=windows, **overrides))
    usage = ctx.kv_group_usage()
    assert usage is not None and sum(usage["layers"]) == 2
    if "num_speculative_tokens" in overrides:
        assert [group.reach for group in ctx._kv.groups] == [w + 2 for w in usage["windows"][1:]]


def test_a_window_releases_blocks_and_returns_them_all():
    """A request of 30 tokens then decode: the windowed group keeps only the blocks its window
    reads (entries -1 before it), at most ceil(W / block) + 1 once decoding; finishing returns
    every block of every group."""
    from helpers import add, request

    ctx = grouped(buffer_size_gb=60 * BLOCK / GIB)
    req = request(1, 30, gen=12)
    add(ctx, req)
    for _ in range(10):
        ctx.initialize_attention_state()
        meta = ctx.active_attn_metadata
        main, windowed = meta.kv_group_block_tables
        offset = int(ctx.request_kv_length_offsets[0])
        first = max(offset - 5, 0) // 4
        count = int(ctx.request_kv_block_counts[0])
        assert torch.all(main[0, :count] >= 0)
        assert torch.all(windowed[0, :first] == -1) and torch.all(windowed[0, first:count] >= 0)
        if offset >= 30:
            assert ctx.kv_group_usage()["held"][1] <= math.ceil(6 / 4) + 1
        ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))
    assert ctx.kv_group_usage()["held"] == [0, 0]
