"""Megatron-Core's order of calls and hand-written states, on dynctx (docs/SEMANTICS.md §16):
lazy step arrays, counts and limits set by hand."""

from __future__ import annotations

import pytest
import torch

from dynctx.context import RequestOverflowError

from helpers import add, make_ctx, request

STEP_ARRAYS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
               "token_to_block_idx", "token_to_position_in_request",
               "token_to_local_position_within_kv_block")


def _arrays(ctx, n):
    return {name: getattr(ctx, name)[:n].clone() for name in STEP_ARRAYS}


def test_step_arrays_read_before_initialize_attention_state_are_the_steps():
    lazy, eager = make_ctx(), make_ctx()
    for ctx in (lazy, eager):
        add(ctx, request(1, 5))
        add(ctx, request(2, 3))
    eager.initialize_attention_state()
    expected = _arrays(eager, 8)
    assert lazy._step is None
    got = _arrays(lazy, 8)  # the first read builds the step
    assert lazy._step is not None
    for name in STEP_ARRAYS:
        assert torch.equal(got[name], expected[name]), name
    assert got["token_to_input_ids"].tolist() == list(range(101, 106)) + list(range(102, 105))
    # The model's own initialize_attention_state rebuilds the same step.
    lazy.initialize_attention_state()
    for name in STEP_ARRAYS:
        assert torch.equal(getattr(lazy, name)[:8], expected[name]), name
    # After an update the arrays are the next (decode) step's, read before its initialize.
    for ctx in (lazy, eager):
        ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([7, 9]))
    eager.initialize_attention_state()
    assert lazy.token_to_input_ids[:2].tolist() == [7, 9]
    assert lazy.token_to_pos_ids[:2].tolist() == eager.token_to_pos_ids[:2].tolist() == [5, 3]


def test_hot_path_reads_do_not_rebuild_the_step():
    ctx = make_ctx()
    add(ctx, request(1, 5))
    ctx.initialize_attention_state()
    step = ctx._step
    for name in STEP_ARRAYS:
        getattr(ctx, name)
    assert ctx._step is step


def test_calculate_log_probs_before_initialize_attention_state():
    lazy, eager = make_ctx(), make_ctx()
    for ctx in (lazy, eager):
        add(ctx, request(1, 4))
    eager.initialize_attention_state()
    logits = torch.randn(1, eager.padded_active_token_count, 300)
    new_tokens = torch.tensor([11])
    expected, _ = eager.calculate_log_probs(logits, new_tokens)
    got, _ = lazy.calculate_log_probs(logits, new_tokens)
    assert got == expected and len(got[0]) == 4


def test_empty_context_reads_do_not_build_a_step():
    ctx = make_ctx()
    assert torch.all(ctx.token_to_request_idx == -1) and ctx._step is None


def test_counts_and_max_requests_set_by_hand():
    ctx = make_ctx()
    ctx.max_requests = 2
    add(ctx, request(1, 2))
    add(ctx, request(2, 2))
    with pytest.raises(RequestOverflowError):
        ctx.add_request(request(3, 2))
    for value, error, match in ((9, ValueError, r"max_requests=9 .*, 8\] \(the rows allocated\)"),
                                (1, ValueError, "total_request_count=2"),
                                (2.5, TypeError, "max_requests=2.5")):
        with pytest.raises(error, match=match):
            ctx.max_requests = value
    ctx.max_requests = 8
    add(ctx, request(3, 2))
    with pytest.raises(ValueError, match=r"paused_request_count=9 must lie in \[0, "
                                         r"_request_rows=8\]"):
        ctx.paused_request_count = 9
    with pytest.raises(TypeError, match="active_token_count"):
        ctx.active_token_count = "1"
    # A state written by hand is taken as forwarded: update_requests runs without a step.
    ctx.num_prefill_requests = 0
    ctx.active_token_count = 3
    ctx.update_requests(torch.tensor([1, 0, 1]), torch.tensor([5, 6, 7]))
    assert ctx.host_request_ids().tolist() == [1, 3]


def test_mamba_metadata_lives_with_the_context():
    from dynctx.context import MambaInferenceStateConfig

    config = MambaInferenceStateConfig(["M", "*"], (6, 4), (2, 4, 3))
    ctx = make_ctx(mamba_inference_state_config=config, max_requests=4, max_tokens=32)
    assert make_ctx().mamba_metadata is None  # not a hybrid
    meta = ctx.mamba_metadata
    assert meta is not None and meta.mamba_state_free_slot_count == 4
    assert meta.request_to_mamba_state_idx.tolist() == [-1] * 4
    assert all(getattr(meta, name) is None for name in meta.STEP_FIELDS)
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    assert ctx.mamba_metadata is meta and meta.batch_indices_prefill[:1].tolist() == [3]
    assert meta.request_to_mamba_state_idx[:1].tolist() == [3]
    assert meta.mamba_state_free_slot_count == 3
    ctx.update_requests(torch.tensor([False]), torch.tensor([5]))
    assert ctx.mamba_metadata is meta and meta.batch_indices_prefill is None
    assert meta.mamba_state_free_slot_count == 4
    assert meta.allocate_slot() == 3 and meta.mamba_state_free_slot_count == 3
    meta.mamba_state_free_slot_count = 4
    for value, error in ((5, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="mamba_state_free_slot_count"):
            meta.mamba_state_free_slot_count = value
    ctx.reset()
    assert ctx.mamba_metadata is meta and meta.mamba_state_free_slot_count == 4


def test_paused_tokens_set_by_hand():
    ctx = make_ctx()
    ctx.paused_tokens = None  # Megatron's reset value: nothing changes
    for rid in range(3):
        add(ctx, request(rid, 2))
    ctx.paused_request_count = 2
    ctx.paused_tokens = torch.tensor([41, 42], dtype=torch.int32)
    assert ctx.paused_tokens.tolist() == [41, 42]
    with pytest.raises(ValueError, match="paused_request_count=2"):
        ctx.paused_tokens = torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match="paused_tokens"):
        ctx.paused_tokens = torch.tensor([1.0])


def test_float_masks_and_assertion_compatible_errors():
    from dynctx.context import NotHybridError, StepShapeError

    ctx = make_ctx()
    for rid in range(3):
        add(ctx, request(rid, 2))
    ctx.initialize_attention_state()
    # Megatron code asserts these shapes: our errors are ValueErrors and AssertionErrors.
    for mask, tokens in ((torch.ones(2), torch.tensor([1, 2, 3])),
                         (torch.ones(3), torch.tensor([1, 2]))):
        with pytest.raises(StepShapeError) as info:
            ctx.update_requests(mask, tokens)
        assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)
    ctx.update_requests(torch.Tensor([1, 0, 1]), torch.tensor([7, 8, 9]))  # float 0/1 mask
    assert ctx.host_request_ids().tolist() == [0, 2]
    with pytest.raises(NotHybridError, match="hybrid") as info:
        ctx.mamba_states_cache(1)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, AssertionError)
