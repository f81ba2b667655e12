"""Speculative decoding under async scheduling (``engine/speculative_overlap.py``): the rewinds
deferred to the device and settled one step late, drafts guessed one token further, tokens
delivered one step late. Greedy outputs equal transformers' ``generate`` and the synchronous
speculative engine's, under pauses, evictions and chunked prefill, for Llama, a generic-path
family (Qwen3, with prefix caching) and NemotronH (the deferred Mamba restore); log probs,
CUDA-graph replays (the stand-in runner), suspend/resume and seeded sampling too. That no step
waits for the device is tests/e2e/test_engine_syncs.py's."""

from __future__ import annotations

import numpy as np
import pytest
from e2e_helpers import (
    assert_requests_match_greedy,
    build_engine,
    greedy_requests,
    hf_greedy,
    make_prompts,
    tiny_llama,
)
from generic_families import kv_block_bytes, tiny_family, without_windows
from test_nemotron_h import build_engine as build_nemotron_engine
from test_nemotron_h import tiny_nemotron_h
from test_speculative_engine import GENS, LENGTHS, OracleDrafter, _log_prob_requests

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine


class GuessingOracle(OracleDrafter):
    """The reference continuation of a history that is a reference's prefix, every fifth
    position wrong, and no drafts (-1) for a history that is none (a wrong guess of the step
    in flight): drafts accepted in part, wholly and not at all."""

    def propose(self, request_ids, histories, k):
        out = np.full((len(histories), k), -1, dtype=np.int64)
        for r, history in enumerate(histories):
            history = history.tolist()
            for sequence in self.sequences:
                if sequence[:len(history)] == history and len(sequence) > len(history):
                    tail = sequence[len(history):len(history) + k]
                    for j, token in enumerate(tail):
                        wrong = (len(history) + j) % 5 == 0
                        out[r, j] = (token + 1) % self.vocab if wrong else token
                    break
        return out


def _references(hf, prompts, gens):
    return [list(p) + hf_greedy(hf, p, g) for p, g in zip(prompts, gens)]


def _pressure(hf, drafter, *, build=build_engine, k=3, count=16, **extra):
    prompts = make_prompts(LENGTHS[:count], hf.config.vocab_size)
    requests = greedy_requests(prompts, GENS[:count])
    sizes = dict(block_size=16, blocks=10, paused_blocks=2, max_tokens=32)
    engine = build(hf, **sizes, kernel_backend="torch", async_scheduling=True,
                   num_speculative_tokens=k, drafter=drafter, **extra)
    results = engine.generate_requests(requests, arrival_steps=[i // 2 for i in
                                                                range(len(requests))])
    return engine, prompts, requests, results


@pytest.mark.parametrize("k", [1, 3])
def test_llama_under_pressure_equals_transformers(k):
    hf = tiny_llama()
    prompts = make_prompts(LENGTHS, hf.config.vocab_size)
    oracle = GuessingOracle(_references(hf, prompts, GENS), hf.config.vocab_size)
    engine, prompts, requests, results = _pressure(hf, oracle, k=k)
    assert engine.stats.pauses > 0 and engine.stats.evictions > 0
    assert engine.stats.chunked_prefills > 0
    assert_requests_match_greedy(hf, requests, prompts, results)
    spec = engine.stats.speculative
    assert spec["accepted_tokens"] > 0 and spec["tokens_per_forward"] > 1.2, spec
    assert engine.async_scheduling_counts["early_reads"] > 0   # evictions read first
    assert engine.context.block_allocator.total_avail == 9


def test_qwen3_generic_path_with_prefix_caching_equals_transformers():
    hf = without_windows(tiny_family("qwen3"))
    engine, prompts, requests, results = _pressure(
        hf, "ngram", k=2, gib=lambda h, bs, n: n * kv_block_bytes(hf)(h, bs) / 1024 ** 3,
        enable_prefix_caching=True)
    assert engine.model.path == "generic"
    assert_requests_match_greedy(hf, requests, prompts, results)


def test_nemotron_h_restores_mamba_states_on_the_device():
    """The deferred rewind restores each decode row's Mamba state from the intermediate states
    when its next step begins (one speculative_rewind launch)."""
    hf = tiny_nemotron_h()
    prompts = make_prompts(LENGTHS[:8], hf.config.vocab_size)
    oracle = GuessingOracle(_references(hf, prompts, GENS[:8]), hf.config.vocab_size)
    engine, prompts, requests, results = _pressure(
        hf, oracle, build=build_nemotron_engine, count=8, attention_backend="torch")
    assert engine.stats.pauses > 0 and engine.stats.chunked_prefills > 0
    spec = engine.stats.speculative
    assert spec["accepted_tokens"] > 0 and spec["draft_tokens"] > spec["accepted_tokens"]
    assert_requests_match_greedy(hf, requests, prompts, results)


def test_log_probs_equal_the_synchronous_speculative_engines():
    hf = tiny_llama(vocab=64)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 3, [3, 4] * 4 + [5]]
    options = dict(block_size_tokens=8, buffer_size_gb=0.01, max_tokens=8,
                   kernel_backend="torch", num_speculative_tokens=3)
    runs = []
    for async_scheduling in (False, True):
        engine = Engine.from_transformers(hf, **options, async_scheduling=async_scheduling,
                                          drafter=GuessingOracle(_references(
                                              hf, prompts, [10] * 3), 64))
        runs.append(engine.generate_requests(_log_prob_requests(prompts)))
        assert engine.stats.speculative["accepted_tokens"] > 0
    for sync, overlapped in zip(*runs):
        assert overlapped.generated_tokens == sync.generated_tokens
        assert np.allclose(overlapped.generated_log_probs, sync.generated_log_probs, atol=1e-5)
        assert (overlapped.prompt_log_probs is None) == (sync.prompt_log_probs is None)
        if sync.prompt_log_probs is not None:
            assert np.allclose(overlapped.prompt_log_probs, sync.prompt_log_probs, atol=1e-5)


def test_graph_replays_suspend_resume_and_seeded_sampling():
    """Decode graphs replayed by the stand-in runner, a suspend / resume in the middle (the
    tokens in flight read first), greedy outputs as transformers'; a seeded sampled request
    decodes without drafts and draws what the engine without speculation draws."""
    hf = tiny_llama(vocab=64)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7], [9]]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    oracle = GuessingOracle([p + e for p, e in zip(prompts, expected)], 64)
    engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                      max_tokens=64, kernel_backend="torch", num_cuda_graphs=4,
                                      async_scheduling=True, num_speculative_tokens=2,
                                      drafter=oracle)
    for i, prompt in enumerate(prompts):
        engine.add_request(DynamicInferenceRequest(
            request_id=i, prompt_tokens=prompt,
            sampling_params=SamplingParams(temperature=0.0, num_tokens_to_generate=12)))
    results = []
    for _ in range(4):
        results += engine.step().finished
    engine.suspend()
    engine.resume()
    results += engine.run()
    assert {r.request_id: r.generated_tokens for r in results} == dict(enumerate(expected))
    assert engine.graph_replays > 0 and engine.stats.speculative["accepted_tokens"] > 0
    seeded = [SamplingParams(temperature=0.9, top_k=20, seed=7, num_tokens_to_generate=10)]
    plain = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                     kernel_backend="torch")
    want = plain.generate([prompts[0]], sampling_params=seeded)
    assert engine.generate([prompts[0]], sampling_params=seeded) == want
