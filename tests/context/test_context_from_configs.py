"""Megatron-Core 0.19's constructor, ``DynamicInferenceContext(model_config, inference_config)``
(``context/megatron019.py``): what it derives from a megatron-core 0.16.1 ``TransformerConfig``,
0.19's assertions (``ConfigAssertionError``: a ``ValueError`` and an ``AssertionError``), the
argument errors of the two forms, and 0.19's ``MambaInferenceStateConfig``. The ported 0.19
tests (``tests/megatron019``) check the same derivations against 0.19's own numbers."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from dynctx.context import (
    ConfigAssertionError,
    DynamicInferenceContext,
    InferenceConfig,
    MambaInferenceStateConfig,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that Transformer Engine is missing
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

# megatron-core 0.16.1's TransformerConfig warns on every construction (its default scope).
pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")
GIB = 1024 ** 3
CONV, SSM = (544, 4), (8, 64, 16)


def model(**overrides) -> TransformerConfig:
    args = dict(params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2)
    args.update(overrides)
    return TransformerConfig(**args)


def inference(**overrides) -> InferenceConfig:
    args = dict(max_sequence_length=128, buffer_size_gb=0.001, block_size_tokens=16,
                max_tokens=512, unified_memory_level=0)
    args.update(overrides)
    return InferenceConfig(**args)


def build(model_config=None, inference_config=None, **keywords):
    return DynamicInferenceContext(model_config or model(), inference_config or inference(),
                                   device="cpu", **keywords)


def test_transformer_counts_are_0_19s():
    """0.19: blocks = buffer // block bytes (no paused budget when paused_buffer_size_gb is
    None), max_requests = blocks - 1 rounded down to REQUEST_ROUNDER; KV heads per rank from
    num_query_groups."""
    ctx = build(model(num_attention_heads=4, num_query_groups=2))
    block_bytes = 4 * 2 * 2 * 16 * 2 * 8  # fp32, K and V, 2 layers, 16 tokens, 2 heads of 8
    blocks = int(0.001 * GIB) // block_bytes
    assert ctx.block_size_bytes == block_bytes
    assert ctx.num_attention_heads_per_partition == 2
    assert ctx.kv_block_allocator is ctx.block_allocator
    assert (ctx.kv_block_allocator.total_count, ctx.kv_block_allocator.paused_count) == \
        (blocks, 0)
    assert ctx.max_requests == (blocks - 1) // ctx.REQUEST_ROUNDER * ctx.REQUEST_ROUNDER
    assert ctx.config.max_sequence_length == 128 and ctx.num_speculative_tokens == 0
    assert ctx.inference_grouped_gemm_backend == "vllm"  # 0.19's default; 0.16.1 lacks it


def test_the_0_19_form_sizes_as_the_0_16_form_with_the_same_budgets():
    ctx19 = build(inference_config=inference(paused_buffer_size_gb=0.0002, max_requests=8))
    ctx16 = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
        max_sequence_length=128, buffer_size_gb=0.001, paused_buffer_size_gb=0.0002,
        block_size_tokens=16, max_tokens=512, max_requests=8, unified_memory_level=0,
        device="cpu")
    for name in ("total_count", "paused_count", "active_count"):
        assert getattr(ctx19.block_allocator, name) == getattr(ctx16.block_allocator, name)
    assert (ctx19.max_requests, ctx19.max_tokens, ctx19.max_kv_block_count) == \
        (ctx16.max_requests, ctx16.max_tokens, ctx16.max_kv_block_count)
    assert ctx16.config is None


def test_hybrid_with_max_requests_gets_exactly_that_many_mamba_states():
    """0.19 gives a hybrid with an explicit max_requests exactly its Mamba states and the rest
    of the budget to KV blocks (one state per block would give fewer blocks)."""
    mamba = MambaInferenceStateConfig(["M", "*"], CONV, SSM, torch.float32, torch.float32)
    config = InferenceConfig(max_sequence_length=512, buffer_size_gb=0.05,
                             paused_buffer_size_gb=0.01, block_size_tokens=256, max_tokens=2048,
                             mamba_inference_state_config=mamba, max_requests=8,
                             unified_memory_level=0)
    ctx = build(model(num_layers=2, kv_channels=64, num_attention_heads=8), config)
    per_request = 4 * (math.prod(CONV) + math.prod(SSM))
    ratio = 8 * per_request / (0.06 * GIB)
    block_bytes = 4 * 2 * 1 * 256 * 8 * 64
    assert ctx.block_allocator.total_count == int(int(0.05 * GIB) * (1 - ratio)) // block_bytes
    assert ctx.block_allocator.total_count > int(0.05 * GIB) // (block_bytes + per_request)
    assert ctx.max_requests == 8 and ctx.mamba_chunk_size == 128
    assert ctx.max_mamba_intermediate_states_per_step == min(math.ceil(2048 / 256), 3 * 8)


def test_mamba_memory_ratio_caps_max_requests():
    mamba = MambaInferenceStateConfig(["M", "*"], CONV, SSM, torch.float32, torch.float32)
    config = inference(buffer_size_gb=0.05, block_size_tokens=256, max_sequence_length=512,
                       max_tokens=4096, mamba_inference_state_config=mamba,
                       mamba_memory_ratio=0.5)
    ctx = build(model(), config)  # KV blocks of 4 * 2 * 2 * 256 * 2 * 8 bytes
    per_request = 4 * (math.prod(CONV) + math.prod(SSM))
    cap = int(int(0.05 * GIB) * 0.5 // per_request)
    blocks = int(int(0.05 * GIB) * 0.5) // (4 * 2 * 1 * 256 * 2 * 8)
    assert cap < blocks - 1
    assert ctx.block_allocator.total_count == blocks
    assert ctx.max_requests == cap // ctx.REQUEST_ROUNDER * ctx.REQUEST_ROUNDER


def test_mla_caches_the_latent_with_block_size_64():
    mla = MLATransformerConfig(params_dtype=torch.float32, num_layers=2, num_attention_heads=2,
                               kv_lora_rank=16, qk_pos_emb_head_dim=8, kv_channels=8,
                               cache_mla_latents=True)
    ctx = build(mla, inference(block_size_tokens=64))
    assert ctx.cache_mla_latent and ctx.kv_reduced_dim == 24
    with pytest.raises(AssertionError, match="Flash MLA requires a block size of 64"):
        build(mla, inference(block_size_tokens=16))


@pytest.mark.parametrize("overrides, config, match", [
    (dict(tensor_model_parallel_size=2, num_attention_heads=8), dict(max_requests=1),
     r"max_requests must be divisible by tp_size \(2\), but got 1"),
    ({}, dict(max_requests=64, max_tokens=32), r"max_tokens \(32\) must be >= max_requests"),
    ({}, dict(num_speculative_tokens=16), r"num_speculative_tokens \(16\) must be < "
     r"block_size_tokens \(16\)"),
    ({}, dict(mamba_memory_ratio=0.5), "mamba_memory_ratio=0.5 needs a hybrid model"),
])
def test_0_19_assertions_raise_config_assertion_errors(overrides, config, match):
    with pytest.raises(ConfigAssertionError, match=match) as error:
        build(model(**overrides), inference(**config))
    assert isinstance(error.value, ValueError) and isinstance(error.value, AssertionError)


def test_hybrid_mamba_budget_larger_than_the_buffer_is_refused():
    mamba = MambaInferenceStateConfig(["M", "*"], CONV, SSM, torch.float32, torch.float32)
    with pytest.raises(ConfigAssertionError, match="Not enough memory for 4096 mamba requests"):
        build(inference_config=inference(mamba_inference_state_config=mamba, max_requests=4096,
                                         max_tokens=8192))


def test_speculative_tokens_reach_the_speculative_steps():
    ctx = build(inference_config=inference(num_speculative_tokens=2))
    assert ctx.num_speculative_tokens == 2 and ctx.config.num_speculative_tokens == 2
    assert ctx.max_kv_block_count == math.ceil(ctx.max_sequence_length
                                               / ctx.block_size_tokens) + 1


def test_argument_errors_of_the_two_forms():
    with pytest.raises(TypeError, match="needs both"):
        DynamicInferenceContext(model_config=model())
    with pytest.raises(TypeError, match="takes no 0.16 keyword arguments.*max_requests"):
        build(max_requests=8)
    with pytest.raises(TypeError, match="kv_channels, num_attention_heads"):
        DynamicInferenceContext(params_dtype=torch.float32, num_layers=2,
                                max_sequence_length=64, buffer_size_gb=0.01)


@pytest.mark.parametrize("configs, error, match", [
    pytest.param(lambda: (model(), {"block_size_tokens": 16}), TypeError,
                 r"inference_config=dict lacks block_size_tokens, buffer_size_gb", id="dict"),
    pytest.param(lambda: (SimpleNamespace(num_layers=2), inference()), TypeError,
                 r"model_config=SimpleNamespace lacks kv_channels", id="model-fields"),
    pytest.param(lambda: (model(), inference(num_speculative_tokens="2")), TypeError,
                 r"inference_config.num_speculative_tokens='2' must be an int", id="k-str"),
    pytest.param(lambda: (model(), inference(num_speculative_tokens=None)), TypeError,
                 r"num_speculative_tokens=None must be an int", id="k-None"),
    pytest.param(lambda: (model(), inference(block_size_tokens="16")), TypeError,
                 r"inference_config.block_size_tokens='16' must be an int", id="block-str"),
    pytest.param(lambda: (model(), inference(max_requests=4.5)), TypeError,
                 r"inference_config.max_requests=4.5 must be an int or None", id="requests"),
    pytest.param(lambda: (model(), inference(buffer_size_gb=float("nan"))), ValueError,
                 r"inference_config.buffer_size_gb=nan must be finite", id="buffer-nan"),
    pytest.param(lambda: (model(), inference(paused_buffer_size_gb="1")), TypeError,
                 r"inference_config.paused_buffer_size_gb='1' must be a number or None",
                 id="paused-str"),
])
def test_config_fields_are_checked_before_0_19s_derivation(configs, error, match):
    """A config without 0.19's fields, or a field 0.19 computes with that is no number, is
    refused naming the config and the field (before: AttributeError, or Python's comparison
    errors naming nothing, or ``int(nan)``)."""
    with pytest.raises(error, match=match):
        DynamicInferenceContext(*configs(), device="cpu")


@pytest.mark.parametrize("fields, error, match", [
    (dict(mamba_chunk_size=0), ValueError, "mamba_chunk_size=0 must be an int >= 1"),
    (dict(mamba_chunk_size=12.5), ValueError, "mamba_chunk_size=12.5 must be an int >= 1"),
    (dict(conv_states_dtype="fp32"), TypeError,
     "conv_states_dtype='fp32' must be a torch.dtype or None"),
])
def test_mamba_config_fields_are_checked_at_construction(fields, error, match):
    """A Mamba chunk size of 0 divided by zero at the first prefix-cached add; a dtype name
    reached ``torch.empty``'s TypeError naming nothing."""
    mamba = MambaInferenceStateConfig(["M", "*"], CONV, SSM, **fields)
    with pytest.raises(error, match=f"mamba_inference_state_config.{match}"):
        build(model(), inference(mamba_inference_state_config=mamba, max_requests=4))


@pytest.mark.parametrize("args, match", [
    ((512, 0, 8), "block_size_tokens=0 must be an int >= 1"),
    ((512, 16, -1), "max_requests=-1 must be an int >= 0"),
    ((512.5, 16, 8), "max_tokens=512.5 must be an int >= 0"),
])
def test_max_mamba_intermediate_states_per_step_checks_its_counts(args, match):
    from dynctx.context.megatron019 import max_mamba_intermediate_states_per_step
    assert max_mamba_intermediate_states_per_step(512, 16, 8) == min(32, 3 * 8)
    with pytest.raises(ValueError, match=match):
        max_mamba_intermediate_states_per_step(*args)


def test_mamba_inference_state_config_has_0_19s_fields_and_0_16s_names():
    config = MambaInferenceStateConfig(["M", "*"], CONV, SSM, conv_states_dtype=torch.float16,
                                       ssm_states_dtype=torch.float32, mamba_chunk_size=64)
    assert config.conv_states_shape == config.mamba_conv_states_shape == CONV
    assert config.ssm_states_shape == config.mamba_ssm_states_shape == SSM
    assert config.mamba_chunk_size == 64
    assert MambaInferenceStateConfig(["*"], CONV, SSM).mamba_chunk_size == 128


def test_mamba_inference_state_config_from_model():
    mixer = SimpleNamespace(chunk_size=32)
    decoder = SimpleNamespace(layer_type_list=["*", "M"],
                              layers=[SimpleNamespace(), SimpleNamespace(mixer=mixer)],
                              mamba_state_shapes_per_request=lambda: (CONV, SSM))
    hybrid = SimpleNamespace(decoder=decoder, config=SimpleNamespace(params_dtype=torch.bfloat16))
    config = MambaInferenceStateConfig.from_model(SimpleNamespace(module=hybrid))
    assert (config.conv_states_shape, config.ssm_states_shape) == (CONV, SSM)
    assert config.conv_states_dtype == config.ssm_states_dtype == torch.bfloat16
    assert config.mamba_chunk_size == 32
    decoder.layer_type_list = ["*", "*"]
    assert MambaInferenceStateConfig.from_model(hybrid) is None


@pytest.mark.parametrize("graph, prefill, padded_prefill, expected", [
    (False, 0, 1, True), (False, 1, 0, False), (True, 1, 0, True), (True, 0, 1, False)])
def test_is_decode_only_follows_the_padded_step_under_a_cuda_graph(graph, prefill,
                                                                  padded_prefill, expected):
    """0.19 reads the padded step under a CUDA graph; a bare instance (``__new__``) takes the
    counts by hand, as 0.19's test builds it."""
    ctx = DynamicInferenceContext.__new__(DynamicInferenceContext)
    ctx._using_cuda_graph_this_step = graph
    ctx.num_prefill_requests = prefill
    ctx.padded_batch_dimensions = SimpleNamespace(prefill_req_count=padded_prefill)
    assert ctx.is_decode_only() is expected


def _lru_context_with_a_cached_prefix():
    """Prefix caching ("lru", block 4): request 1 (9 tokens) forwarded and finished, so its
    two full blocks are cached and idle."""
    from helpers import add, make_ctx

    from dynctx.context import DynamicInferenceRequest, SamplingParams

    ctx = make_ctx(enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
    prompt = torch.tensor([5, 9, 13, 17, 21, 25, 29, 33, 37])

    def request(rid):
        return DynamicInferenceRequest(request_id=rid, prompt_tokens=prompt.clone(),
                                       sampling_params=SamplingParams(num_tokens_to_generate=4))

    add(ctx, request(1))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([0]), torch.tensor([3]))
    return ctx, request


def test_reset_keeps_the_prefix_cache_and_the_counters_when_asked():
    ctx, request = _lru_context_with_a_cached_prefix()
    assert ctx.lifetime_prefill_token_count == 9 and ctx.prefix_cache_prefill_computed_tokens == 9
    ctx.step_count, ctx.prefix_cache_lru_clock = 5, 7
    ctx.reset(preserve_prefix_cache=True, preserve_counters=True)
    assert (ctx.step_count, ctx.prefix_cache_lru_clock, ctx.lifetime_prefill_token_count) == \
        (5, 7, 9)
    ctx.add_request(request(2), prefill_chunk_length=9)
    assert ctx.prefix_cache_hits == 1 and ctx.prefix_cache_blocks_matched == 2
    assert ctx.prefix_cache_prefill_skipped_tokens == 8
    assert ctx.lifetime_prefill_token_count == 10  # 9 + the one token not cached
    ctx.prefix_cache_hits = 0  # 0.19's engine drains the counters by hand
    assert ctx.get_prefix_cache_stats()["prefix_cache_hits"] == 0
    ctx.reset()
    assert (ctx.step_count, ctx.prefix_cache_lru_clock, ctx.lifetime_prefill_token_count) == \
        (0, 0, 0)
    ctx.add_request(request(3))
    assert ctx.prefix_cache_blocks_matched == 2  # the plain reset forgot the cached blocks


def test_expert_parallel_dummies_are_the_capture_dummies():
    from helpers import make_ctx

    from dynctx.context import InferenceBatchDimensions

    dims = InferenceBatchDimensions(token_count=4, prefill_req_count=0, decode_req_count=4)
    fast, slow = make_ctx(), make_ctx()
    fast.add_dummy_requests_for_expert_parallel_step(dims)
    slow.add_dummy_requests_for_cudagraph_capture(dims)
    fast.initialize_attention_state()
    slow.initialize_attention_state()
    assert (fast.total_request_count, fast.active_token_count) == (4, 4)
    for name in ("request_query_lengths", "request_kv_length_offsets", "request_to_kv_block_ids",
                 "token_to_block_idx", "token_to_local_position_within_kv_block"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
