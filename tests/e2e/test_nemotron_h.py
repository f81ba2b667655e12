"""A random NemotronH (Mamba2 + attention hybrid) through the hybrid context and the engine,
against transformers.

The workload pauses, evicts and chunks (asserted), and a continuation chunk resumes from the
Mamba state its first chunk left in its slot (asserted through the step's Mamba metadata).
Every request's greedy tokens equal transformers' ``generate`` for that prompt alone, and every
step's last-token logits equal transformers' full forward over the same prefix (fp32: max abs
diff <= 1e-4; transformers runs a chunked scan of the same recurrence with chunk_size 16, so
the longer prefixes also cross its chunk boundaries).
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    FP32_LOGITS_ATOL,
    assert_matches_transformers,
    assert_pressure_stats,
    assert_requests_match_greedy,
    greedy_requests,
    hf_greedy,
    make_prompts,
    refuse_torch_references,
    worst_logit_error,
)
from e2e_helpers import build_engine as build_engine_in_blocks
from e2e_helpers import gib_for_blocks as gib_for_blocks_of
from transformers import NemotronHConfig, NemotronHForCausalLM
from triton_marks import needs_triton

from dynctx.engine import Engine
from dynctx.models import NemotronHAdapter


def tiny_nemotron_h(*, seed: int = 0, pattern: str = "M*-M", vocab: int = 128, hidden: int = 64,
                    mamba_heads: int = 4, mamba_head_dim: int = 8, groups: int = 2,
                    state: int = 8, max_positions: int = 256,
                    kv_heads: int = 2) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    config = NemotronHConfig(
        vocab_size=vocab, hidden_size=hidden, hybrid_override_pattern=pattern,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
        intermediate_size=2 * hidden,
        mamba_num_heads=mamba_heads, mamba_head_dim=mamba_head_dim, n_groups=groups,
        ssm_state_size=state, conv_kernel=4, chunk_size=16, max_position_embeddings=max_positions)
    return NemotronHForCausalLM(config).eval()


def block_bytes(hf: NemotronHForCausalLM, block_size: int) -> int:
    """KV bytes of one block plus one request's Mamba state (the context budgets both)."""
    c = hf.config
    types = c.layers_block_type
    item = next(hf.parameters()).element_size()
    kv = item * 2 * types.count("full_attention") * block_size * c.num_key_value_heads * c.head_dim
    conv_dim = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
    ssm = c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size
    return kv + item * types.count("linear_attention") * (conv_dim * c.conv_kernel + ssm)


def gib_for_blocks(hf: NemotronHForCausalLM, block_size: int, blocks: int) -> float:
    return gib_for_blocks_of(hf, block_size, blocks, block_bytes)


def build_engine(hf, **kwargs) -> Engine:
    return build_engine_in_blocks(hf, gib=gib_for_blocks, **kwargs)


def record_mamba_steps(engine: Engine) -> list:
    """Wrap the model's forward to record, per step, (decode rows, regular prefills, continuation
    slot or None) from the context's Mamba metadata."""
    steps = []
    forward = engine.model.forward

    def recording(ctx, **kwargs):
        meta = ctx.mamba_metadata
        chunked = meta.batch_indices_chunked_prefill
        steps.append((*meta.device_decode_prefill,
                      None if chunked is None else int(chunked[0])))
        return forward(ctx, **kwargs)

    engine.model.forward = recording
    return steps


LENGTHS = [1, 5, 17, 40, 3, 33, 16, 48, 2, 9, 31, 12, 20, 7, 45, 15]
GENS = [40, 24, 40, 16, 40, 32, 40, 24, 40, 12, 40, 28, 36, 40, 20, 40]


def test_pressure_workload_matches_transformers():
    hf = tiny_nemotron_h()
    prompts = make_prompts(LENGTHS, hf.config.vocab_size)
    requests = greedy_requests(prompts, GENS)
    # 12 blocks of 16 (2 paused), 32 tokens a step: 16 requests pause, get evicted and chunk.
    engine = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
                          kernel_backend="torch", attention_backend="torch", record_logits=True)
    ctx = engine.context
    assert isinstance(engine.model, NemotronHAdapter)
    assert ctx.is_hybrid_model and (ctx.num_attention_layers, ctx.num_mamba_layers) == (1, 2)
    assert tuple(ctx.mamba_conv_states_shape) == (32 + 2 * 2 * 8, 4)
    assert tuple(ctx.mamba_ssm_states_shape) == (4, 8, 8)
    assert ctx.block_allocator.total_count == 12
    steps = record_mamba_steps(engine)
    arrivals = [i // 2 for i in range(len(prompts))]
    results = engine.generate_requests(requests, arrival_steps=arrivals)

    assert_pressure_stats(engine.stats, results)
    continuations = [s for s in steps if s[2] is not None]
    assert continuations, "a continuation chunk should resume from its saved Mamba state"
    assert any(d and p for d, p, _ in steps), "a step should mix decode rows and prefills"
    assert not ctx.has_unfinished_requests()
    assert ctx._mamba_slots.free_count == ctx.max_requests

    assert_requests_match_greedy(hf, requests, prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


def test_continuation_from_zero_state_would_be_caught():
    """Negative control: a continuation chunk that restarts from zero Mamba state (the
    reference's bug) moves the logits far beyond the tolerance, so the tests above see it."""
    hf = tiny_nemotron_h(seed=2)
    prompts = make_prompts([45, 3], hf.config.vocab_size, seed=3)

    def run(drop_state: bool):
        engine = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=16,
                              kernel_backend="torch", attention_backend="torch",
                              record_logits=True)
        ctx = engine.context
        if drop_state:
            gather = ctx.gather_mamba_states

            def zero_continuation(layer_number, slots):
                conv, ssm = gather(layer_number, slots)
                chunked = ctx.mamba_metadata.batch_indices_chunked_prefill
                if chunked is not None and slots.numel() and int(slots[-1]) == int(chunked[0]):
                    conv[-1], ssm[-1] = 0, 0
                return conv, ssm

            ctx.gather_mamba_states = zero_continuation
        results = engine.generate_requests(greedy_requests(prompts, [4, 4]))
        assert results[0].num_prefill_chunks >= 3
        return worst_logit_error(hf, results)

    assert run(drop_state=False) <= FP32_LOGITS_ATOL
    assert run(drop_state=True) > 100 * FP32_LOGITS_ATOL


def test_three_line_api_and_context_defaults():
    hf = tiny_nemotron_h(seed=4, pattern="*M-M*")
    prompts = make_prompts([3, 30, 1, 17], hf.config.vocab_size, seed=5)
    engine = Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.01,
                                      max_tokens=64)
    ctx = engine.context
    assert ctx.layer_types == ["*", "M", "-", "M", "*"] and ctx.num_layers == 5
    assert (ctx.kv_channels, ctx.num_attention_heads, ctx.max_sequence_length) == (16, 2, 256)
    eos = hf.generation_config.eos_token_id
    assert engine.default_termination_id == eos
    outputs = engine.generate(prompts, max_new_tokens=12, arrival_steps=[0, 2, 2, 5])
    assert outputs == [hf_greedy(hf, p, 12, eos=eos) for p in prompts]


def test_unsupported_nemotron_h_variants_raise():
    with pytest.raises(NotImplementedError, match="MoE"):
        NemotronHAdapter.from_transformers(tiny_nemotron_h(pattern="M*E"))
    with pytest.raises(NotImplementedError, match="attention"):
        NemotronHAdapter.from_transformers(tiny_nemotron_h(pattern="M-M"))
    hf = tiny_nemotron_h()
    adapter = NemotronHAdapter.from_transformers(hf)
    engine = Engine.from_transformers(tiny_nemotron_h(pattern="MM*-"), buffer_size_gb=0.001)
    with pytest.raises(ValueError, match="layer types"):
        adapter.check_context(engine.context)


@pytest.mark.interpreter
@needs_triton
def test_triton_state_kernels_through_the_engine(monkeypatch):
    """``kernel_backend="triton"``: the Mamba state gather/scatter (and every other context
    kernel) run as Triton; their torch references are made to raise."""
    refuse_torch_references(monkeypatch, [("dynctx.kernels.mamba_state", "mamba_state_gather_ref"),
                         ("dynctx.kernels.mamba_state", "mamba_state_scatter_ref"),
                         ("dynctx.kernels.kv_append", "kv_append_ref"),
                         ("dynctx.kernels.step_metadata", "step_metadata_ref"),
                         ("dynctx.kernels.last_token_logits", "last_token_logits_ref")])
    hf = tiny_nemotron_h(seed=6, pattern="M*", hidden=32, mamba_heads=2, state=4,
                         max_positions=64)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = hf.to(device)
    prompts = make_prompts([20, 2], hf.config.vocab_size, seed=7)
    gens = [3, 4]
    engine = build_engine(hf, block_size=16, blocks=6, paused_blocks=1, max_tokens=16,
                          max_requests=4, kernel_backend="triton", attention_backend="torch",
                          record_logits=True)
    assert engine.context.kernel_backend == "triton"
    steps = record_mamba_steps(engine)
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 1])
    assert any(s[2] is not None for s in steps), "the second chunk should resume its state"
    hf = hf.cpu()
    assert_matches_transformers(hf, prompts, gens, results)
