"""An FP8 KV cache through the engine: a random Llama, DeepSeek (the MLA latent cache), a
NemotronH hybrid (Mamba states in their own dtype), prefix caching and suspend/resume, each
against the same engine with the params-dtype cache (teacher-forced prompt log probs: greedy
tokens of a random model diverge after one flip) or against itself without the feature."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_prompts, tiny_llama
from sizing_warning import built
from test_nemotron_h import tiny_nemotron_h

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine
from dynctx.models.random_models import random_causal_lm

E4M3 = torch.float8_e4m3fn


def scoring_requests(prompts, gen=4, first_id=0):
    return [DynamicInferenceRequest(
        request_id=first_id + i, prompt_tokens=list(prompt),
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=gen,
                                       return_log_probs=True))
        for i, prompt in enumerate(prompts)]


def engine(hf, **kwargs):
    kwargs.setdefault("buffer_size_gb", 0.002)
    return built(lambda: Engine.from_transformers(hf, block_size_tokens=16, max_tokens=512,
                                                  **kwargs))


def prompt_log_probs(eng, prompts, gen=4):
    results = sorted(eng.generate_requests(scoring_requests(prompts, gen)),
                     key=lambda r: r.request_id)
    return [torch.tensor(r.prompt_log_probs) for r in results], results


def max_log_prob_error(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("scales", ["dynamic", "dynamic_per_head"])
def test_llama_fp8_cache_tracks_the_params_dtype_cache(scales):
    hf = tiny_llama(max_positions=256)
    prompts = make_prompts([7, 40, 100], 256)
    reference, _ = prompt_log_probs(engine(hf), prompts)
    fp8 = engine(hf, kv_cache_dtype="fp8", kv_scales=scales)
    got, results = prompt_log_probs(fp8, prompts)
    assert fp8.context.memory_buffer.dtype == E4M3
    assert all(len(r.generated_tokens) == 4 for r in results)
    # e4m3 keeps 3 mantissa bits: log probs move by a few hundredths on this model, not more.
    assert max_log_prob_error(got, reference) < 0.1
    assert max_log_prob_error(got, reference) > 0, "the FP8 cache changed nothing"


def test_fp8_prefix_caching_reuses_quantized_blocks_unchanged():
    hf = tiny_llama(max_positions=256)
    shared = make_prompts([48], 256, seed=3)[0]
    prompts = [shared + tail for tail in make_prompts([5, 9], 256, seed=4)]
    scales = torch.full((2, 2), 0.02)   # given: both engines quantize alike from the start
    plain = engine(hf, kv_cache_dtype="fp8", kv_scales=scales)
    cached = engine(hf, kv_cache_dtype="fp8", kv_scales=scales, enable_prefix_caching=True,
                    prefix_caching_eviction_policy="lru")
    # One request at a time, so that the second finds the first's blocks; generated log probs
    # only (a request that wants every prompt log prob takes no prefix hit).
    def generated(eng, prompt, request_id):
        request, = scoring_requests([prompt], gen=5, first_id=request_id)
        request.sampling_params.skip_prompt_log_probs = True
        result, = eng.generate_requests([request])
        return result.generated_tokens, torch.tensor(result.generated_log_probs)

    expected = [generated(plain, p, i) for i, p in enumerate(prompts)]
    got = [generated(cached, p, i) for i, p in enumerate(prompts)]
    assert cached.stats.prefix_cache["prefix_cache_prefill_skipped_tokens"] >= 32
    for (tokens, log_probs), (want_tokens, want_log_probs) in zip(got, expected):
        assert tokens == want_tokens
        torch.testing.assert_close(log_probs, want_log_probs, atol=1e-4, rtol=1e-4)


def test_fp8_suspend_resume_keeps_the_scales_and_recomputes():
    hf = tiny_llama(max_positions=256)
    prompts = make_prompts([30, 12], 256, seed=5)
    eng = engine(hf, kv_cache_dtype="fp8")
    for request in scoring_requests(prompts, gen=6):
        eng.add_request(request)
    eng.step()
    scales = [s.clone() for s in eng.context.key_value_cache_scales(1)]
    eng.suspend()
    eng.resume()
    results = eng.run()
    assert sorted(len(r.generated_tokens) for r in results) == [6, 6]
    assert all(torch.equal(a, b) for a, b in zip(scales, eng.context.key_value_cache_scales(1)))
    # The same engine without a suspend gives the same tokens.
    fresh = engine(hf, kv_cache_dtype="fp8")
    again = {r.request_id: r.generated_tokens for r in fresh.generate_requests(
        scoring_requests(prompts, gen=6))}
    assert {r.request_id: r.generated_tokens for r in results} == again


def test_nemotron_h_hybrid_keeps_mamba_states_in_their_dtype():
    hf = tiny_nemotron_h()
    prompts = make_prompts([9, 33], 128, seed=6)
    reference, _ = prompt_log_probs(engine(hf, buffer_size_gb=0.01), prompts)
    fp8 = engine(hf, buffer_size_gb=0.01, kv_cache_dtype="fp8")
    got, _ = prompt_log_probs(fp8, prompts)
    ctx = fp8.context
    assert ctx.memory_buffer.dtype == E4M3
    assert ctx.mamba_conv_states.dtype == ctx.mamba_ssm_states.dtype == torch.float32
    assert max_log_prob_error(got, reference) < 0.1


def test_deepseek_mla_latent_cache_in_fp8():
    hf = random_causal_lm("deepseek_v3", vocab=128)
    prompts = make_prompts([11, 26], 128, seed=7)
    reference, _ = prompt_log_probs(engine(hf, buffer_size_gb=0.01), prompts)
    fp8 = engine(hf, buffer_size_gb=0.01, kv_cache_dtype="fp8")
    got, _ = prompt_log_probs(fp8, prompts)
    assert fp8.context.memory_buffer.dtype == E4M3
    assert max_log_prob_error(got, reference) < 0.1
    assert max_log_prob_error(got, reference) > 0


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
@pytest.mark.parametrize("scales", ["dynamic", "given"])
def test_fp8_on_kv_groups_equals_fp8_on_one_group(family, scales):
    """An FP8 cache on KV groups (Gemma 3: sliding + full; Mistral: every layer windowed,
    windows of 8 shorter than the prompts): each group holds its layers' scales (calibrated by
    its own first write, or cut from the given ones), so the prompt log probs and tokens equal
    the FP8 cache without groups, and track the params-dtype cache."""
    hf = random_causal_lm(family, vocab=128, window=8)
    prompts = make_prompts([7, 40, 29], 128, seed=8)
    given = dict(kv_scales=torch.tensor([[0.02, 0.03], [0.015, 0.025]])) \
        if scales == "given" else {}
    reference, _ = prompt_log_probs(engine(hf), prompts)
    one, one_results = prompt_log_probs(engine(hf, kv_cache_dtype="fp8", kv_groups=False,
                                               **given), prompts)
    fp8 = engine(hf, kv_cache_dtype="fp8", **given)
    usage = fp8.context.kv_group_usage()
    assert usage is not None and usage["layers"][0] == (family == "gemma3")
    got, results = prompt_log_probs(fp8, prompts)
    assert fp8.context._kv.groups[0].cache.buffer.dtype == E4M3
    assert [r.generated_tokens for r in results] == [r.generated_tokens for r in one_results]
    assert max_log_prob_error(got, one) < 1e-5
    assert 0 < max_log_prob_error(got, reference) < 0.1
    if scales == "given":
        for layer in (1, 2):
            k, v = fp8.context.key_value_cache_scales(layer)
            assert torch.equal(k, given["kv_scales"][0, layer - 1].expand(2))
            assert torch.equal(v, given["kv_scales"][1, layer - 1].expand(2))
