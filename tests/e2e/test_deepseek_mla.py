"""A random DeepSeek-V2 (multi-head latent attention) through the context's MLA latent cache and
the reference engine, against transformers.

The context caches one ``[kv_lora_rank + rope]`` latent row per token and layer
(``cache_mla_latent=True``); the adapter (``dynctx.models.deepseek``) decompresses it with
``kv_b_proj`` in its paged attention. The workload pauses, evicts and chunks (asserted); every
request's greedy tokens equal transformers' ``generate`` for that prompt alone and every step's
last-token logits equal transformers' full forward over the same prefix (fp32: max abs diff
<= 1e-4). The model mixes a dense layer and a small MoE layer.

The weights are drawn with ``initializer_range=0.2`` (transformers' default, 0.02, gives nearly
uniform attention, which would hide rope or masking errors under the 1e-4 bound);
``test_the_check_catches_a_wrong_rope`` shows the comparison is sensitive to the rope.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    FP32_LOGITS_ATOL,
    PrefixLogits,
    assert_matches_transformers,
    assert_pressure_stats,
    assert_requests_match_greedy,
    case_engine_sizes,
    greedy_requests,
    hf_greedy,
    make_prompts,
    pressure_workload,
    refuse_torch_references,
    worst_logit_error,
)
from e2e_helpers import build_engine as build_engine_in_blocks
from e2e_helpers import gib_for_blocks as gib_for_blocks_of
from sizing_warning import built
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
from triton_marks import needs_triton

from dynctx.engine import Engine
from dynctx.models import DeepseekV2Adapter
from dynctx.models.deepseek import mla_block_bytes


def tiny_deepseek(*, seed: int = 0, vocab: int = 128, hidden: int = 64, layers: int = 2,
                  heads: int = 4, q_lora_rank=None, kv_lora_rank: int = 32, rope: int = 16,
                  nope: int = 16, v: int = 16, moe: bool = True, max_positions: int = 512,
                  init: float = 0.2) -> DeepseekV2ForCausalLM:
    """Layer 0 dense; with ``moe`` the other layers are a 4-expert top-2 MoE with one shared
    expert, else dense too."""
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope,
        qk_nope_head_dim=nope, v_head_dim=v, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2, n_shared_experts=1,
        first_k_dense_replace=1 if moe else layers, max_position_embeddings=max_positions,
        initializer_range=init)
    return DeepseekV2ForCausalLM(config).eval()


def gib_for_blocks(hf, block_size: int, blocks: int) -> float:
    """``buffer_size_gb`` that gives exactly ``blocks`` latent blocks."""
    return gib_for_blocks_of(hf, block_size, blocks,
                             lambda hf, block_size: mla_block_bytes(hf.config, block_size))


def build_engine(hf, **kwargs) -> Engine:
    return build_engine_in_blocks(hf, gib=gib_for_blocks, **kwargs)


BASE_LENGTHS = [1, 5, 17, 40, 3, 33, 16, 48, 2, 9]
BASE_GENS = [36, 24, 36, 16, 36, 28, 36, 24, 36, 12]

PRESSURE_CASES = [
    # 14 blocks of 16 (3 paused), 32 tokens a step; prompts up to 3 blocks.
    pytest.param(dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32,
                      max_requests=None, scale=1), id="bs16"),
    # 5 blocks of 64 (1 paused), 64 tokens a step; prompts up to 3 blocks (scale 3).
    pytest.param(dict(block_size=64, blocks=5, paused_blocks=1, max_tokens=64,
                      max_requests=8, scale=3), id="bs64"),
]


@pytest.mark.parametrize("case", PRESSURE_CASES)
def test_mla_pressure_workload_matches_transformers(case):
    hf = tiny_deepseek()
    prompts, requests, arrivals = pressure_workload(hf, case, BASE_LENGTHS, BASE_GENS)
    engine = build_engine(hf, **case_engine_sizes(case), kernel_backend="torch",
                          record_logits=True)
    ctx = engine.context
    assert isinstance(engine.model, DeepseekV2Adapter)
    assert ctx.cache_mla_latent and ctx.kv_lora_rank == 32 and ctx.qk_pos_emb_head_dim == 16
    assert tuple(ctx.memory_buffer.shape) == (2, case["blocks"], case["block_size"], 48)
    results = engine.generate_requests(requests, arrival_steps=arrivals)

    assert_pressure_stats(engine.stats, results)
    assert max(r.first_scheduled_step for r in results) > 0
    assert engine.model.attention_backend == "torch_static"
    assert not ctx.has_unfinished_requests()
    assert ctx.block_allocator.total_avail == case["blocks"] - 1

    assert_requests_match_greedy(hf, requests, prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


@pytest.mark.parametrize("form, rope, q_lora_rank", [("absorbed", "table", None),
                                                      ("decompress", "cos_sin", 24),
                                                      ("absorbed", "cos_sin", 24)],
                         ids=["absorbed", "cos_sin-q_lora", "absorbed-cos_sin-q_lora"])
def test_mla_attention_forms_and_rope_modes(form, rope, q_lora_rank):
    """The absorbed attention form, the cos/sin rope route and a low-rank query projection."""
    hf = tiny_deepseek(seed=3, q_lora_rank=q_lora_rank, moe=False)
    model = DeepseekV2Adapter.from_transformers(hf, rope=rope, attention_form=form)
    prompts = make_prompts([1, 23, 40, 9], hf.config.vocab_size, seed=4)
    gens = [16, 10, 14, 16]
    from dynctx.context import DynamicInferenceContext
    ctx = built(lambda: DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=model.head_dim,
        num_attention_heads=1, max_sequence_length=512, block_size_tokens=16,
        buffer_size_gb=gib_for_blocks(hf, 16, 10), paused_buffer_size_gb=gib_for_blocks(hf, 16, 2),
        max_tokens=32, device="cpu", kernel_backend="torch", **model.context_kwargs))
    engine = Engine(model, ctx, record_logits=True)
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 1, 3])
    assert engine.stats.chunked_prefills > 0
    assert_matches_transformers(hf, prompts, gens, results)


def test_the_check_catches_a_wrong_rope():
    """Interleaved (GPT-J) rope without the MLA de-interleave is wrong for q_pe . k_pe only
    through the pairing of dims: the comparison must see it."""
    hf = tiny_deepseek(seed=5, moe=False)
    engine = build_engine(hf, block_size=16, blocks=8, paused_blocks=1, max_tokens=32,
                          kernel_backend="torch", record_logits=True)
    engine.model.rope_config.multi_latent_attention = False   # half-split pairs: wrong
    prompts = make_prompts([20, 7], hf.config.vocab_size, seed=6)
    results = engine.generate_requests(greedy_requests(prompts, [4, 4]))
    assert worst_logit_error(hf, results) > 100 * FP32_LOGITS_ATOL


def test_mla_three_line_api_and_context_checks():
    hf = tiny_deepseek(seed=7)
    prompts = make_prompts([3, 30, 1], hf.config.vocab_size, seed=8)
    engine = Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.001,
                                      max_tokens=64)
    outputs = engine.generate(prompts, max_new_tokens=8, arrival_steps=[0, 2, 2])
    eos = hf.generation_config.eos_token_id
    assert outputs == [hf_greedy(hf, p, 8, eos=eos) for p in prompts]

    with pytest.raises(ValueError, match="cache_mla_latent"):
        Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.001,
                                 cache_mla_latent=False)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.001,
                                 kv_lora_rank=16)
    with pytest.raises(ValueError, match="fused_rope_kv_append"):
        Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.001,
                                 fused_rope_kv_append=True)
    with pytest.raises(NotImplementedError, match="torch"):
        Engine.from_transformers(hf, attention_backend="flashinfer")


# ---------------------------------------------------------------------- Triton interpreter
REFERENCES = [
    ("dynctx.kernels.mla_latent", "mla_latent_append_ref"),
    ("dynctx.kernels.rope", "fused_qk_rope_ref"),
    ("dynctx.kernels.step_metadata", "step_metadata_ref"),
    ("dynctx.kernels.compaction", "compact_requests_ref"),
    ("dynctx.kernels.last_token_logits", "last_token_logits_ref"),
]


@pytest.mark.interpreter
@needs_triton
def test_mla_triton_kernels_through_the_engine(monkeypatch):
    """kernel_backend="triton": the MLA latent append, the MLA-layout rope and the step
    kernels run as Triton (their torch references are made to raise)."""
    refuse_torch_references(monkeypatch, REFERENCES)
    hf = tiny_deepseek(seed=11, hidden=32, heads=2, kv_lora_rank=16, rope=8, nope=8, v=8,
                       moe=False, max_positions=64)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompts = make_prompts([3, 20], hf.config.vocab_size, seed=12)
    gens = [5, 4]
    engine = build_engine(hf.to(device), block_size=16, blocks=5, paused_blocks=1,
                          max_tokens=16, max_requests=4, kernel_backend="triton",
                          attention_backend="torch", record_logits=True)
    assert engine.context.kernel_backend == "triton"
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 1])
    assert engine.stats.chunked_prefills == 1
    hf = hf.cpu()
    assert_matches_transformers(hf, prompts, gens, results, PrefixLogits(hf))
