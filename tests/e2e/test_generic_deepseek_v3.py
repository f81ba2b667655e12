"""DeepSeek-V3 through the MLA adapter (models/deepseek.py): its sigmoid router with the score
correction bias, grouped top-k and renormalised weights, with or without ``rope_interleave``,
against transformers' greedy ``generate`` under pauses, evictions and chunked prefill."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    assert_matches_transformers,
    assert_pressure_stats,
    case_engine_sizes,
    pressure_workload,
)
from test_deepseek_mla import BASE_GENS, BASE_LENGTHS, build_engine
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from dynctx.models import DeepseekV2Adapter


def tiny_deepseek_v3(*, seed: int = 0, rope_interleave: bool = True, q_lora_rank=None,
                     n_group: int = 1, topk_group: int = 1) -> DeepseekV3ForCausalLM:
    """Layer 0 dense, layer 1 a 4-expert top-2 MoE with one shared expert; the correction
    bias drawn at random (transformers starts it at zero, which would not test it)."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=rope_interleave,
        max_position_embeddings=512, initializer_range=0.2)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("rope_interleave, q_lora_rank, groups", [
    pytest.param(True, None, (1, 1), id="interleave-n_group1"),
    pytest.param(False, 24, (2, 1), id="half_split-q_lora-n_group2"),
])
def test_deepseek_v3_matches_transformers_under_pressure(rope_interleave, q_lora_rank, groups):
    hf = tiny_deepseek_v3(rope_interleave=rope_interleave, q_lora_rank=q_lora_rank,
                          n_group=groups[0], topk_group=groups[1])
    # DeepSeek-V2's pressure case: 14 blocks of 16 (3 paused), 32 tokens a step.
    case = dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32, max_requests=None,
                scale=1)
    prompts, requests, arrivals = pressure_workload(hf, case, BASE_LENGTHS, BASE_GENS)
    engine = build_engine(hf, **case_engine_sizes(case), kernel_backend="torch",
                          record_logits=True)
    assert isinstance(engine.model, DeepseekV2Adapter) and engine.model.path == "dedicated"
    assert engine.model.layers[1].moe.topk_method == "sigmoid_grouped"
    results = engine.generate_requests(requests, arrival_steps=arrivals)
    assert_pressure_stats(engine.stats, results)
    assert_matches_transformers(hf, prompts, BASE_GENS, results)


def test_the_correction_bias_changes_the_routing():
    """The bias only moves the expert choice (not the weights): routing without it picks other
    experts for some tokens, so matching transformers above checks it."""
    hf = tiny_deepseek_v3()
    adapter = DeepseekV2Adapter.from_transformers(hf)
    moe = adapter.layers[1].moe
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    _, with_bias = adapter._route_v3(x, moe)
    moe.score_bias = torch.zeros_like(moe.score_bias)
    _, without = adapter._route_v3(x, moe)
    assert not torch.equal(with_bias.sort(dim=-1).values, without.sort(dim=-1).values)
