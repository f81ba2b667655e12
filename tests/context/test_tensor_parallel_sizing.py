"""Tensor-parallel sizing of one rank's context, in one process (the 2-rank runs over gloo are
tests/test_distributed.py): KV heads per rank, the MLA latent, Mamba shards, ``max_requests``."""

from __future__ import annotations

import pytest
import torch
from helpers import BLOCK, GIB, make_ctx

from dynctx.context import MambaInferenceStateConfig


@pytest.mark.parametrize("kv_heads,tp,per_rank", [(4, 2, 2), (2, 2, 1), (2, 4, 1), (1, 8, 1)])
def test_kv_heads_per_rank_are_divided_or_replicated(kv_heads, tp, per_rank):
    ctx = make_ctx(num_attention_heads=kv_heads, tensor_model_parallel_size=tp)
    assert ctx.num_attention_heads_per_partition == per_rank
    assert ctx.memory_buffer.shape[-2:] == (per_rank, 8)
    assert ctx.block_size_bytes == 4 * 2 * 2 * 4 * per_rank * 8


@pytest.mark.parametrize("kv_heads,tp", [(3, 2), (2, 3), (6, 4)])
def test_kv_heads_and_tp_must_divide_one_another(kv_heads, tp):
    with pytest.raises(ValueError, match=rf"num_attention_heads={kv_heads} .*"
                                         rf"tensor_model_parallel_size={tp}"):
        make_ctx(num_attention_heads=kv_heads, tensor_model_parallel_size=tp)


def test_mla_latent_is_not_divided():
    one = make_ctx(cache_mla_latent=True, kv_lora_rank=16, qk_pos_emb_head_dim=8)
    two = make_ctx(cache_mla_latent=True, kv_lora_rank=16, qk_pos_emb_head_dim=8,
                   tensor_model_parallel_size=2)
    assert one.memory_buffer.shape == two.memory_buffer.shape
    assert one.block_size_bytes == two.block_size_bytes


def test_mamba_shapes_are_the_ranks_own():
    config = MambaInferenceStateConfig(["M", "*"], (6, 4), (1, 4, 3))   # one of two heads
    ctx = make_ctx(mamba_inference_state_config=config, tensor_model_parallel_size=2)
    conv, ssm = ctx.mamba_states_cache(1)
    assert conv.shape[1:] == (6, 4) and ssm.shape[1:] == (1, 4, 3)


def test_max_requests_must_be_divisible_by_tp():
    with pytest.raises(ValueError, match="max_requests=7 must be divisible by "
                                         "tensor_model_parallel_size=2"):
        make_ctx(max_requests=7, tensor_model_parallel_size=2)
    derived = make_ctx(max_requests=None, max_tokens=1024, tensor_model_parallel_size=4,
                       buffer_size_gb=80 * BLOCK / GIB, paused_buffer_size_gb=None)
    assert derived.max_requests % 4 == 0


def test_tp_without_torch_distributed_sizes_one_shard():
    assert not torch.distributed.is_initialized()
    ctx = make_ctx(tensor_model_parallel_size=2)
    assert ctx.tensor_parallel_group is None and ctx.tensor_model_parallel_size == 2


def test_bad_parallel_sizes_are_named():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=0"):
        make_ctx(tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=True"):
        make_ctx(pipeline_model_parallel_size=True)
