"""A random Llama through the context and the reference engine, against transformers.

The workload is sized from the model dimensions so that requests pause, get evicted and get
chunked (asserted). Every request's greedy tokens equal transformers' ``generate`` for that
prompt alone, and every step's last-token logits equal transformers' full forward over the same
prefix (fp32: max abs diff <= 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    BF16_ATOL,
    BF16_RTOL,
    DEVICES,
    FP32_LOGITS_ATOL,
    PrefixLogits,
    assert_matches_transformers,
    assert_pressure_stats,
    assert_requests_match_greedy,
    build_engine,
    case_engine_sizes,
    greedy_requests,
    hf_greedy,
    make_prompts,
    pressure_workload,
    step_logit_errors,
    tiny_llama,
    worst_logit_error,
)

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine

BASE_LENGTHS = [1, 5, 17, 40, 3, 33, 16, 48, 2, 9, 31, 12, 20, 7, 45, 15]
BASE_GENS = [40, 24, 40, 16, 40, 32, 40, 24, 40, 12, 40, 28, 36, 40, 20, 40]

PRESSURE_CASES = [
    # 13 blocks of 16 (3 paused), 32 tokens a step; prompts up to 3 blocks.
    pytest.param(dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32,
                      max_requests=None, scale=1), id="bs16"),
    # 5 blocks of 64 (1 paused), 64 tokens a step; prompts up to 3 blocks.
    pytest.param(dict(block_size=64, blocks=6, paused_blocks=1, max_tokens=64,
                      max_requests=8, scale=3), id="bs64"),
]


def kernel_backend(device: str) -> str:
    """The torch references on a CPU, the compiled Triton kernels on CUDA."""
    return "torch" if device == "cpu" else "triton"


def auto_attention_backend(device: str) -> str:
    """What ``attention_backend="auto"`` runs: the torch paged attention on a CPU, our Triton
    kernels on CUDA (models/paged_attention.py, ``resolve_attention_backend``)."""
    return "torch" if device == "cpu" else "triton"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_expected_attention_backend_is_what_auto_resolves_to(device):
    """The pressure test's expectation on each device is what "auto" picks there (resolution
    reads the device type only: no CUDA device is needed to ask)."""
    from dynctx.models import resolve_attention_backend

    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_attention_backend("auto", torch.device(device), 16, dtype) == \
            auto_attention_backend(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", PRESSURE_CASES)
def test_pressure_workload_matches_transformers(case, device):
    hf = tiny_llama(device=device)
    prompts, requests, arrivals = pressure_workload(hf, case, BASE_LENGTHS, BASE_GENS)
    engine = build_engine(hf, **case_engine_sizes(case),
                          kernel_backend=kernel_backend(device), record_logits=True)
    assert engine.context.block_allocator.total_count == case["blocks"]
    results = engine.generate_requests(requests, arrival_steps=arrivals)

    assert_pressure_stats(engine.stats, results)
    assert max(r.first_scheduled_step for r in results) > 0
    assert engine.model.attention_backend == auto_attention_backend(device)
    assert not engine.context.has_unfinished_requests()
    assert engine.context.block_allocator.total_avail == case["blocks"] - 1

    assert_requests_match_greedy(hf, requests, prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rope", ["table", "cos_sin"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_append"])
def test_rope_paths_match_transformers(rope, fused, device):
    """Every rope route through the context (angle table, cos/sin cache, fused rope + append)."""
    hf = tiny_llama(seed=3, device=device)
    prompts = make_prompts([1, 23, 40, 9], hf.config.vocab_size, seed=4)
    gens = [20, 12, 18, 20]
    engine = build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=32,
                          kernel_backend=kernel_backend(device), rope=rope,
                          fused_rope_kv_append=fused,
                          record_logits=True)
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 1, 3])
    assert engine.stats.chunked_prefills > 0
    assert_matches_transformers(hf, prompts, gens, results)


def test_three_line_api_greedy_and_eos():
    hf = tiny_llama(seed=5)
    prompts = make_prompts([3, 30, 1, 17], hf.config.vocab_size, seed=6)
    engine = Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.01,
                                      max_tokens=64)
    outputs = engine.generate(prompts, max_new_tokens=12, arrival_steps=[0, 2, 2, 5])
    eos = hf.generation_config.eos_token_id
    assert engine.default_termination_id == eos
    assert outputs == [hf_greedy(hf, p, 12, eos=eos) for p in prompts]

    # A termination id the model does produce stops the request there, as in transformers.
    free_run = hf_greedy(hf, prompts[1], 12)
    stop = free_run[4]
    first = free_run.index(stop)
    outputs = engine.generate([prompts[1]], max_new_tokens=12, termination_id=stop)
    assert outputs == [free_run[:first + 1]]
    assert outputs == [hf_greedy(hf, prompts[1], 12, eos=stop)]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_matches_bf16_transformers_within_tolerance(device):
    """bf16 logits within the stated tolerance of a bf16 transformers run; a greedy token may
    differ only at a step whose two best reference logits lie within that tolerance, and no
    later token of that request is compared."""
    hf = tiny_llama(dtype=torch.bfloat16, device=device)
    prompts = make_prompts([1, 5, 17, 40, 3, 33, 16, 48, 2, 9, 31, 12], hf.config.vocab_size)
    gens = [24] * len(prompts)
    engine = build_engine(hf, block_size=16, blocks=14, paused_blocks=3, max_tokens=32,
                          kernel_backend=kernel_backend(device), record_logits=True)
    assert engine.context.params_dtype == torch.bfloat16
    results = engine.generate_requests(greedy_requests(prompts, gens),
                                       arrival_steps=[i // 2 for i in range(len(prompts))])
    assert engine.stats.chunked_prefills > 0 and engine.stats.pauses > 0

    reference = PrefixLogits(hf)
    for request_id, length, ours, theirs in step_logit_errors(hf, results, reference):
        bound = BF16_ATOL + BF16_RTOL * theirs.abs()
        excess = float(((ours - theirs).abs() - bound).max())
        assert excess <= 0, f"request {request_id}, prefix {length}: bf16 logits off by {excess}"

    exact = 0
    for prompt, gen, result in zip(prompts, gens, results):
        expected = hf_greedy(hf, prompt, gen)
        ours = result.generated_tokens
        diverge = next((k for k, (a, b) in enumerate(zip(ours, expected)) if a != b), None)
        if diverge is None:
            assert ours == expected
            exact += 1
            continue
        # Same prefix up to here, so the reference logits of this step are well defined.
        top = torch.topk(reference(prompt + ours[:diverge]), 2).values
        tolerance = BF16_ATOL + BF16_RTOL * float(top[0].abs())
        assert float(top[0] - top[1]) <= tolerance, (
            f"prompt {len(prompt)} tokens diverges at token {diverge} where transformers' top "
            f"two logits differ by {float(top[0] - top[1])} > {tolerance}")
    assert exact >= len(prompts) // 2, f"only {exact} of {len(prompts)} requests match exactly"


def test_log_probs_match_transformers():
    """Prompt log probs (across chunk boundaries) and generated-token log probs."""
    hf = tiny_llama(seed=7)
    prompts = make_prompts([40, 6, 1], hf.config.vocab_size, seed=8)
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=prompt,
        sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True,
                                       skip_prompt_log_probs=(i == 1)))
        for i, prompt in enumerate(prompts)]
    engine = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=24,
                          kernel_backend="torch")
    results = engine.generate_requests(requests)
    assert results[0].num_prefill_chunks >= 2
    for prompt, result in zip(prompts, results):
        sequence = torch.tensor([prompt + result.generated_tokens])
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(sequence).logits[0].float(), dim=-1)
        targets = sequence[0, 1:]
        expected = log_probs[:-1].gather(1, targets[:, None])[:, 0]
        n = len(prompt)
        assert result.generated_log_probs == pytest.approx(expected[n - 1:].tolist(), abs=1e-4)
        if result.request_id == 1:
            assert result.prompt_log_probs is None
        else:
            assert len(result.prompt_log_probs) == n - 1
            assert result.prompt_log_probs == pytest.approx(expected[:n - 1].tolist(), abs=1e-4)


def test_suspend_resume_and_streaming_callback():
    hf = tiny_llama(seed=9)
    prompts = make_prompts([12, 40, 3, 27, 8], hf.config.vocab_size, seed=10)
    gens = [16, 10, 16, 12, 16]
    streamed: dict = {}
    engine = build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=24,
                          kernel_backend="torch",
                          step_callback=lambda step: [streamed.setdefault(rid, []).append(tok)
                                                      for rid, tok in step.new_tokens.items()])
    for request in greedy_requests(prompts, gens):
        engine.add_request(request)
    finished = []
    for _ in range(6):
        finished += engine.step().finished
    assert engine.context.total_request_count > 0
    engine.suspend()
    assert engine.suspended and not engine.context.is_tensor_state_allocated
    with pytest.raises(RuntimeError, match="suspended"):
        engine.step()
    engine.resume()
    finished += engine.run()
    by_id = {r.request_id: r for r in finished}
    assert sorted(by_id) == list(range(len(prompts)))
    for i, (prompt, gen) in enumerate(zip(prompts, gens)):
        assert by_id[i].generated_tokens == hf_greedy(hf, prompt, gen)
        assert streamed[i] == by_id[i].generated_tokens
    assert engine.stats.suspends == 1


def test_requests_that_cannot_run_finish_with_an_error():
    hf = tiny_llama(seed=11)
    engine = build_engine(hf, block_size=16, blocks=6, paused_blocks=1, max_tokens=32,
                          kernel_backend="torch")
    budget_blocks = engine.context.block_allocator.active_count
    too_long = DynamicInferenceRequest(request_id=0, prompt_tokens=[5] * 250,
                                       sampling_params=SamplingParams(num_tokens_to_generate=10))
    too_big = DynamicInferenceRequest(
        request_id=1, prompt_tokens=[5] * (16 * budget_blocks),
        sampling_params=SamplingParams(num_tokens_to_generate=4))
    fine = DynamicInferenceRequest(request_id=2, prompt_tokens=[5, 6, 7],
                                   sampling_params=SamplingParams(top_k=1,
                                                                  num_tokens_to_generate=4))
    results = engine.generate_requests([too_long, too_big, fine])
    assert [r.finish_reason for r in results] == ["error", "error", "length"]
    assert "max_sequence_length" in results[0].error
    assert "active budget" in results[1].error
    with pytest.raises(RuntimeError, match="max_sequence_length"):
        engine.generate([[1] * 250], max_new_tokens=10)


def test_unsupported_model_type_names_what_it_lacks():
    """A model with neither a dedicated adapter nor attention on transformers' seam (every
    other one takes the generic path: tests/e2e/test_generic_errors.py)."""
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                         state_size=4)).eval()
    with pytest.raises(NotImplementedError, match="MambaForCausalLM cannot run on dynctx's "
                                                  "generic transformers path"):
        Engine.from_transformers(model, buffer_size_gb=0.001)


def test_context_defaults_come_from_the_model():
    hf = tiny_llama(max_positions=192)
    engine = Engine.from_transformers(hf, buffer_size_gb=0.002, block_size_tokens=32)
    ctx = engine.context
    assert (ctx.num_layers, ctx.kv_channels, ctx.num_attention_heads) == (2, 16, 2)
    assert ctx.max_sequence_length == 192 and ctx.params_dtype == torch.float32
    assert ctx.max_requests <= ctx.max_tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_recompute_longer_than_max_tokens_without_chunked_prefill(async_scheduling):
    """With chunked prefill off, an evicted request whose recompute (prompt + generated tokens,
    33 here) exceeds ``max_tokens`` (16) is recomputed in chunks: it could never run whole, and
    before, ``step()`` raised for the whole engine ("cannot be scheduled into an empty
    context"). Every request still equals transformers' greedy tokens."""
    hf = tiny_llama()
    engine = build_engine(hf, block_size=16, blocks=7, paused_blocks=1, max_tokens=16,
                          max_requests=8, enable_chunked_prefill=False,
                          async_scheduling=async_scheduling, max_sequence_length=80)
    prompts = make_prompts([15, 3, 9, 5], hf.config.vocab_size)
    gens = [39, 30, 30, 30]
    results = engine.generate_requests(greedy_requests(prompts, gens))
    assert [r.finish_reason for r in results] == ["length"] * 4
    recomputed = [r for r in results if r.num_evictions]
    assert recomputed and any(r.num_prefill_chunks > 1 for r in recomputed), \
        [(r.request_id, r.num_evictions, r.num_prefill_chunks) for r in results]
    for prompt, gen, result in zip(prompts, gens, results):
        assert result.generated_tokens == hf_greedy(hf, prompt, gen)
