"""The FP8 KV cache through the context (``kv_cache_dtype``, ``kv_scales``; docs/SEMANTICS.md
§20): sizing in the KV dtype, the options refused naming the argument, given and dynamic
scales (the calibration rule), and scales kept over reset and suspend/resume."""

from __future__ import annotations

import pytest
import torch
from helpers import add, context_args, make_ctx, request, step

from dynctx.context import DynamicInferenceContext
from dynctx.context.kv_scales import DYNAMIC_HEADROOM
from dynctx.kernels.fp8 import FP8_FORMATS, quantize_ref

E4M3 = torch.float8_e4m3fn


def test_default_is_the_params_dtype_cache_unchanged():
    plain, explicit = make_ctx(), make_ctx(kv_cache_dtype=torch.float32)
    for ctx in (plain, explicit):
        assert ctx.memory_buffer.dtype == torch.float32
        assert ctx.key_value_cache_scales(1) == (None, None)
        assert ctx.kv_cache_dtype == torch.float32
    assert plain.memory_buffer.shape == explicit.memory_buffer.shape
    assert plain.block_size_bytes == explicit.block_size_bytes


@pytest.mark.parametrize("name, dtype", [("fp8", E4M3), (E4M3, E4M3),
                                         ("float8_e5m2", torch.float8_e5m2),
                                         (torch.float8_e5m2, torch.float8_e5m2)])
def test_fp8_buffer_holds_more_blocks_in_the_same_bytes(name, dtype):
    bf16 = make_ctx(params_dtype=torch.bfloat16)
    fp8 = make_ctx(params_dtype=torch.bfloat16, kv_cache_dtype=name)
    assert fp8.memory_buffer.dtype == dtype and fp8.kv_cache_dtype == dtype
    assert fp8.block_size_bytes * 2 == bf16.block_size_bytes
    # The same buffer_size_gb (and paused_buffer_size_gb) holds twice the blocks.
    assert fp8.block_allocator.total_count == 2 * bf16.block_allocator.total_count
    key_scale, value_scale = fp8.key_value_cache_scales(2)
    assert key_scale.shape == (2,) and key_scale.dtype == torch.float32
    assert key_scale.device == fp8.memory_buffer.device


@pytest.mark.parametrize("overrides, name, message", [
    (dict(kv_cache_dtype=torch.float16), "kv_cache_dtype", "must be None or params_dtype"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype", "'int8'"),
    (dict(kv_cache_dtype=torch.int8), "kv_cache_dtype", "torch.int8"),
    (dict(kv_scales=torch.ones(2, 2)), "kv_scales", "needs an FP8 kv_cache_dtype"),
    (dict(kv_cache_dtype="fp8", kv_scales="static"), "kv_scales", "'static'"),
    (dict(kv_cache_dtype="fp8", kv_scales=torch.ones(2, 3)), "kv_scales", r"\(2, 3\)"),
    (dict(kv_cache_dtype="fp8", kv_scales=torch.ones(2, 2, 5)), "kv_scales", r"\[2, 2, 2\]"),
    (dict(kv_cache_dtype="fp8", kv_scales=[[1.0, 0.0], [1.0, 1.0]]), "kv_scales",
     r"kv_scales\[0, 1\]=0.0"),
    (dict(kv_cache_dtype="fp8", kv_scales=[[1.0, 1.0], [float("nan"), 1.0]]), "kv_scales",
     "nan must be positive and finite"),
    (dict(kv_cache_dtype="fp8", kv_scales=[[1.0, float("inf")], [1.0, 1.0]]), "kv_scales",
     "inf must be positive and finite"),
    (dict(kv_cache_dtype="fp8", kv_scales=[[1.0, -2.0], [1.0, 1.0]]), "kv_scales", "-2.0"),
    (dict(kv_cache_dtype="fp8", kv_scales=object()), "kv_scales", "must be 'dynamic'"),
    (dict(kv_cache_dtype="fp8", kv_scales=torch.ones(2, 2, dtype=torch.complex64)), "kv_scales",
     "must hold real numbers, got dtype torch.complex64"),
])
def test_bad_options_are_refused_naming_the_argument(overrides, name, message):
    error = TypeError if "object" in repr(overrides.get("kv_scales")) or \
        "real numbers" in message else ValueError
    with pytest.raises(error, match=message) as info:
        DynamicInferenceContext(**context_args(**overrides))
    assert name in str(info.value)


def test_mla_scales_are_per_layer_for_latent_and_rope():
    args = dict(cache_mla_latent=True, kv_lora_rank=6, qk_pos_emb_head_dim=2,
                kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="dynamic_per_head"):
        DynamicInferenceContext(**context_args(**args, kv_scales="dynamic_per_head"))
    with pytest.raises(ValueError, match=r"expected \[2, 2\]"):
        DynamicInferenceContext(**context_args(**args, kv_scales=torch.ones(2, 2, 2)))
    ctx = make_ctx(**args, kv_scales=torch.tensor([[0.5, 0.25], [2.0, 4.0]]))
    assert ctx.memory_buffer.dtype == E4M3
    latent, rope = ctx.key_value_cache_scales(2)
    assert latent.tolist() == [0.25] and rope.tolist() == [4.0]


def _prefill(ctx, lengths, seed=0):
    """One step of prompts ``lengths``: K/V appended for every layer; returns (key, value) per
    layer, padding rows filled with huge values (which must not reach the scales)."""
    for rid, length in enumerate(lengths):
        add(ctx, request(rid, length))
    ctx.initialize_attention_state()
    n, real = ctx.padded_active_token_count, ctx.active_token_count
    gen = torch.Generator().manual_seed(seed)
    written = []
    for layer in (1, 2):
        key = torch.randn(n, 2, 8, generator=gen) * torch.tensor([1.0, 3.0])[:, None]
        value = torch.randn(n, 2, 8, generator=gen) * 0.1
        key[real:], value[real:] = 1e6, -1e6
        ctx.append_key_value_cache(layer, key, value)
        written.append((key[:real], value[:real]))
    return written


def _amax_scale(x, per_head):
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax().expand(x.shape[1])
    return amax * DYNAMIC_HEADROOM / FP8_FORMATS[E4M3].max


@pytest.mark.parametrize("mode", ["dynamic", "dynamic_per_head"])
def test_dynamic_scales_come_from_the_first_prefill_and_are_kept(mode):
    ctx = make_ctx(kv_cache_dtype="fp8", kv_scales=mode)
    written = _prefill(ctx, [5, 3])
    assert ctx.padded_active_token_count > ctx.active_token_count   # padding was there
    for layer, (key, value) in enumerate(written, start=1):
        key_scale, value_scale = ctx.key_value_cache_scales(layer)
        torch.testing.assert_close(key_scale, _amax_scale(key, mode != "dynamic"))
        torch.testing.assert_close(value_scale, _amax_scale(value, mode != "dynamic"))
        # The cache holds the quantized values at those scales.
        key_cache, _ = ctx.key_value_cache(layer)
        blocks = ctx.token_to_block_idx[:ctx.active_token_count].long()
        slots = ctx.token_to_local_position_within_kv_block[:ctx.active_token_count].long()
        assert torch.equal(key_cache[blocks, slots].view(torch.uint8),
                           quantize_ref(key, key_scale[:, None], E4M3).view(torch.uint8))
    kept = [s.clone() for s in ctx.key_value_cache_scales(1)]
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([7, 8]))
    ctx.initialize_attention_state()     # a decode step with other values: no recalibration
    ctx.append_key_value_cache(1, torch.full((ctx.padded_active_token_count, 2, 8), 50.0),
                               torch.zeros(ctx.padded_active_token_count, 2, 8))
    assert all(torch.equal(a, b) for a, b in zip(kept, ctx.key_value_cache_scales(1)))
    # Reset and suspend/resume keep them too.
    ctx.reset()
    ctx.deallocate_all_tensors()
    ctx.allocate_all_tensors(is_init=False)
    assert all(torch.equal(a, b) for a, b in zip(kept, ctx.key_value_cache_scales(1)))
    assert ctx.memory_buffer.dtype == E4M3


def test_given_scales_are_used_as_given():
    scales = torch.tensor([[[0.5, 0.25], [1.0, 2.0]], [[4.0, 8.0], [0.125, 1.0]]])
    ctx = make_ctx(kv_cache_dtype="fp8", kv_scales=scales)
    written = _prefill(ctx, [6])
    for layer, (key, value) in enumerate(written, start=1):
        key_scale, value_scale = ctx.key_value_cache_scales(layer)
        assert key_scale.tolist() == scales[0, layer - 1].tolist()
        assert value_scale.tolist() == scales[1, layer - 1].tolist()
        _, value_cache = ctx.key_value_cache(layer)
        blocks = ctx.token_to_block_idx[:ctx.active_token_count].long()
        slots = ctx.token_to_local_position_within_kv_block[:ctx.active_token_count].long()
        assert torch.equal(value_cache[blocks, slots].view(torch.uint8),
                           quantize_ref(value, value_scale[:, None], E4M3).view(torch.uint8))
    per_layer = make_ctx(kv_cache_dtype="fp8", kv_scales=[[0.5, 0.25], [1.0, 2.0]])
    assert per_layer.key_value_cache_scales(2)[0].tolist() == [0.25, 0.25]


def test_capture_steps_do_not_calibrate_and_a_calibrating_step_runs_eagerly():
    ctx = make_ctx(kv_cache_dtype="fp8", num_cuda_graphs=2, max_requests=8)
    dims = ctx.cuda_graph_batch_dimensions_list[0]
    ctx.initialize_attention_state(construct_graph_dimensions=dims)
    n = ctx.padded_active_token_count
    ctx.append_key_value_cache(1, torch.full((n, 2, 8), 1000.0), torch.ones(n, 2, 8))
    assert ctx.key_value_cache_scales(1)[0].tolist() == [1.0, 1.0]    # untouched
    ctx.reset()
    add(ctx, request(0, 1))
    ctx.initialize_attention_state()
    assert not ctx.using_cuda_graph_this_step()
    ctx.append_key_value_cache(1, torch.full((ctx.padded_active_token_count, 2, 8), 3.0),
                               torch.ones(ctx.padded_active_token_count, 2, 8))
    torch.testing.assert_close(ctx.key_value_cache_scales(1)[0],
                               torch.full((2,), 3.0 * DYNAMIC_HEADROOM / 448.0))


def test_fp8_context_runs_the_usual_steps():
    ctx = make_ctx(kv_cache_dtype=torch.float8_e5m2)
    for rid, length in enumerate([3, 9, 1]):
        add(ctx, request(rid, length, gen=3))
    for _ in range(4):
        if ctx.total_request_count == 0:
            break
        step(ctx)
    assert ctx.memory_buffer.dtype == torch.float8_e5m2
