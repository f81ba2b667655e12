"""Hybrid (Mamba + attention) models: sizes, layer maps, Mamba slots and the step's Mamba
metadata, and the state gather/scatter through the context."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import GIB, add, request, step
from sizing_warning import built

from dynctx.context import DynamicInferenceContext, MambaInferenceStateConfig

LAYERS = ("M", "-", "*", "-")  # global layer 1 is Mamba, layer 3 attention
CONV, SSM = (6, 4), (2, 3, 5)
BYTES_PER_BLOCK = 4 * 2 * 1 * 4 * 2 * 8 + 4 * (24 + 30)  # KV block + one request's Mamba state


def make_hybrid(**overrides) -> DynamicInferenceContext:
    """fp32, 1 attention layer (2 heads of 8, block 4) and 1 Mamba layer with small states."""
    block_bytes = 4 * 2 * 1 * 4 * 2 * 8  # fp32, K and V, 1 attention layer, 4 tokens, 2x8
    mamba_bytes = 4 * (24 + 30)
    args = dict(params_dtype=torch.float32, num_layers=4, kv_channels=8, num_attention_heads=2,
                max_sequence_length=64, buffer_size_gb=40 * (block_bytes + mamba_bytes) / GIB,
                paused_buffer_size_gb=8 * (block_bytes + mamba_bytes) / GIB,
                block_size_tokens=4, max_tokens=64, max_requests=8, unified_memory_level=0,
                device="cpu",
                mamba_inference_state_config=MambaInferenceStateConfig(LAYERS, CONV, SSM))
    args.update(overrides)
    return built(lambda: DynamicInferenceContext(**args))


@pytest.mark.parametrize("kv,heads,gb,total,paused,active", [
    pytest.param(8, 2, 0.03, 556, 111, 444, id="0.03GB"),
    pytest.param(64, 8, 1.0, 1897, 379, 1517, id="1GB"),
])
def test_hybrid_block_counts_match_the_reference_examples(kv, heads, gb, total, paused, active):
    """docs/SEMANTICS.md §2.5: a block also budgets one request's Mamba state."""
    ctx = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=4, kv_channels=kv, num_attention_heads=heads,
        max_sequence_length=512, buffer_size_gb=gb, paused_buffer_size_gb=0.2 * gb,
        block_size_tokens=128, unified_memory_level=0, device="cpu", max_tokens=None,
        mamba_inference_state_config=MambaInferenceStateConfig(LAYERS, (544, 4), (8, 64, 16)))
    alloc = ctx.block_allocator
    assert (alloc.total_count, alloc.paused_count, alloc.active_count) == (total, paused, active)
    assert ctx.mamba_bytes_per_request == 4 * (544 * 4 + 8 * 64 * 16)
    assert (ctx.num_attention_layers, ctx.num_mamba_layers) == (1, 1)
    assert ctx.memory_buffer.shape[1] == 1


def test_hybrid_sizes_equal_megatron():
    import megatron_oracle as mo
    from megatron.core.inference.contexts.attention_context.mamba_metadata import (
        MambaInferenceStateConfig as MegatronConfig,
    )

    common = dict(params_dtype=torch.float32, num_layers=4, kv_channels=8, num_attention_heads=2,
                  max_sequence_length=256, buffer_size_gb=0.01, paused_buffer_size_gb=0.002,
                  block_size_tokens=16, max_tokens=512)
    ours = DynamicInferenceContext(
        **common, unified_memory_level=0, device="cpu",
        mamba_inference_state_config=MambaInferenceStateConfig(LAYERS, (544, 4), (8, 64, 16)))
    ref = mo.make_megatron_context(
        **common, mamba_inference_state_config=MegatronConfig(list(LAYERS), (544, 4), (8, 64, 16)))
    for name in ("total_count", "paused_count", "active_count"):
        assert getattr(ours.block_allocator, name) == getattr(ref.block_allocator, name), name
    assert ours.max_requests == ref.max_requests
    assert tuple(ours.mamba_conv_states.shape) == tuple(ref.mamba_conv_states.shape)
    assert tuple(ours.mamba_ssm_states.shape) == tuple(ref.mamba_ssm_states.shape)


def test_layer_types_are_checked():
    ctx = make_hybrid()
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    n = ctx.padded_active_token_count
    kv = torch.zeros(n, 1, 2, 8)
    ctx.append_key_value_cache(3, kv, kv)
    with pytest.raises(ValueError, match="Mamba layer"):
        ctx.append_key_value_cache(1, kv, kv)
    with pytest.raises(ValueError, match="MLP layer"):
        ctx.key_value_cache(2)
    with pytest.raises(ValueError, match="attention layer"):
        ctx.mamba_states_cache(3)
    conv, ssm = ctx.mamba_states_cache(1)
    assert conv.shape == (8, *CONV) and ssm.shape == (8, *SSM)
    with pytest.raises(ValueError, match="unknown symbols"):
        make_hybrid(mamba_inference_state_config=MambaInferenceStateConfig(("M", "X", "*"), CONV,
                                                                           SSM))
    with pytest.raises(NotImplementedError, match="attention"):
        make_hybrid(mamba_inference_state_config=MambaInferenceStateConfig(("M", "-"), CONV, SSM))
    with pytest.raises(ValueError, match="mamba_ssm_states_shape"):
        make_hybrid(mamba_inference_state_config=MambaInferenceStateConfig(LAYERS, CONV, (0, 2)))


def test_slots_follow_requests_and_new_states_start_at_zero():
    ctx = make_hybrid()
    ctx.mamba_conv_states.fill_(7.0)
    ctx.mamba_ssm_states.fill_(7.0)
    for rid in range(3):
        add(ctx, request(rid, 3))
    slots = ctx._h_req[7, :3].tolist()
    assert slots == [7, 6, 5]  # the reference hands out max_requests - 1 first
    ctx.initialize_attention_state()
    conv, ssm = ctx.mamba_states_cache(1)
    assert torch.all(conv[[7, 6, 5]] == 0) and torch.all(ssm[[7, 6, 5]] == 0)
    assert torch.all(conv[:5] == 7)  # other slots untouched
    meta = ctx.mamba_metadata
    assert meta.request_to_mamba_state_idx[:3].tolist() == [7, 6, 5]
    # Request 0 finishes: request 2 moves into its row and keeps its slot; slot 7 is free.
    ctx.update_requests(torch.tensor([False, True, True]), torch.tensor([1, 2, 3]))
    assert ctx.host_request_ids().tolist() == [2, 1]
    assert ctx._h_req[7, :2].tolist() == [5, 6]
    add(ctx, request(9, 2))
    assert ctx._h_req[7, 2] == 7  # the freed slot is reused first
    ctx.mamba_conv_states[0, 7].fill_(3.0)
    ctx.initialize_attention_state()
    assert torch.all(ctx.mamba_states_cache(1)[0][7] == 0)


def test_step_metadata_splits_decode_prefill_and_chunked():
    ctx = make_hybrid(max_tokens=32)
    for rid in (1, 2):
        add(ctx, request(rid, 2))
    long = request(5, 30, gen=4)
    add(ctx, long, chunk_length=10)
    ctx.chunked_prefill_request_id = 5
    ctx.initialize_attention_state()
    meta = ctx.mamba_metadata
    # First step: three fresh prefills (a first chunk starts from zero state: regular prefill).
    assert meta.batch_indices_decode is None and meta.batch_indices_chunked_prefill is None
    assert meta.batch_indices_prefill[:3].tolist() == [7, 6, 5]
    assert meta.cu_seqlens[:4].tolist() == [0, 2, 4, 14]
    assert meta.seq_idx[0, :14].tolist() == [0, 0, 1, 1] + [2] * 10
    assert meta.device_decode_prefill == (0, 3)
    ctx.update_requests(torch.tensor([True, True, True]), torch.tensor([11, 21, 51]))
    # Second step: two decodes, a new request, then the continuation chunk of request 5.
    add(ctx, long, chunk_length=8)
    ctx.initialize_attention_state()
    assert ctx.batch_dimensions.has_explicit_chunked_prefill_req
    meta = ctx.mamba_metadata
    padded = ctx.padded_batch_dimensions
    assert meta.batch_indices_decode.tolist() == [7, 6]
    assert meta.batch_indices_prefill.shape[0] == padded.prefill_req_count
    assert set(meta.batch_indices_prefill.tolist()) == {-1}  # no regular prefill this step
    assert meta.batch_indices_chunked_prefill.tolist() == [5]
    assert meta.device_decode_prefill == (2, 0)
    assert meta.device_chunked_prefill == (0, 8)
    assert set(meta.seq_idx[0].tolist()) == {-1}
    with pytest.raises(RuntimeError, match="live requests"):
        ctx.reset_mamba_state()


def test_gather_and_scatter_states_through_the_context():
    ctx = make_hybrid(kernel_backend="torch")
    for rid in range(2):
        add(ctx, request(rid, 2))
    step(ctx)
    ctx.initialize_attention_state()
    slots = ctx.mamba_metadata.batch_indices_decode[:2]  # the rest is padding (-1)
    assert set(ctx.mamba_metadata.batch_indices_decode[2:].tolist()) == {-1}
    conv = torch.arange(2 * 24, dtype=torch.float32).view(2, *CONV)
    ssm = -torch.arange(2 * 30, dtype=torch.float32).view(2, *SSM)
    ctx.scatter_mamba_states(1, slots, conv, ssm)
    got_conv, got_ssm = ctx.gather_mamba_states(1, slots)
    assert torch.equal(got_conv, conv) and torch.equal(got_ssm, ssm)
    padded = torch.tensor([int(slots[0]), -1], dtype=torch.int32)
    got_conv, _ = ctx.gather_mamba_states(1, padded)
    assert torch.equal(got_conv[0], conv[0]) and torch.all(got_conv[1] == 0)


def test_finish_evict_and_suspend_free_every_slot():
    ctx = make_hybrid(buffer_size_gb=13 * BYTES_PER_BLOCK / GIB,
                      paused_buffer_size_gb=1 * BYTES_PER_BLOCK / GIB, max_sequence_length=32)
    for rid in range(4):
        add(ctx, request(rid, 8))
    evicted = []
    for _ in range(8):
        step(ctx)
        evicted += ctx.evicted_request_ids.tolist()
        live = ctx._h_req[7, :ctx.total_request_count]
        assert np.all(live >= 0) and len(set(live.tolist())) == live.size
        assert ctx._mamba_slots.free_count + live.size == ctx.max_requests
        if not ctx.has_unfinished_requests():
            break
    assert evicted, "the workload must evict"
    ctx.deallocate_all_tensors()
    ctx.allocate_all_tensors(is_init=False)
    assert ctx._mamba_slots.free_count == ctx.max_requests
