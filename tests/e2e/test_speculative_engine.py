"""Speculative decoding in the engine (``num_speculative_tokens``, ``drafter``): the options
checked before anything is built, greedy outputs identical to the engine without speculation
and to transformers' ``generate`` (Llama, a generic-path family, NemotronH with its Mamba
intermediate states) under pressure and with prefix caching, the finish rules over accepted
tokens, the counters, and seeded sampled requests reproducible run to run."""

from __future__ import annotations

from collections import defaultdict
from typing import List, Sequence

import numpy as np
import pytest
import torch
from e2e_helpers import (
    assert_pressure_stats,
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

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine
from dynctx.engine import build as engine_build
from dynctx.engine.drafters import NgramDrafter

LENGTHS = [1, 5, 17, 40, 3, 33, 16, 48, 2, 9, 31, 12, 20, 7, 45, 15]
GENS = [40, 24, 40, 16, 40, 32, 40, 24, 40, 12, 40, 28, 36, 40, 20, 40]


class OracleDrafter:
    """Proposes the reference continuation of each request with every third position
    corrupted: drafts are accepted in part, wholly and not at all (a test drafter with the
    documented interface)."""

    vocab_size = None

    def __init__(self, sequences: Sequence[Sequence[int]], vocab: int):
        self.sequences = [list(s) for s in sequences]
        self.vocab = vocab
        self.released: List[int] = []

    def propose(self, request_ids, histories, k):
        out = np.zeros((len(histories), k), dtype=np.int64)
        for r, history in enumerate(histories):
            history = history.tolist()
            for sequence in self.sequences:
                if sequence[:len(history)] == history:
                    tail = sequence[len(history):len(history) + k]
                    for j, token in enumerate(tail):
                        wrong = (len(history) + j) % 3 == 0
                        out[r, j] = (token + 1) % self.vocab if wrong else token
                    break
        return out

    def release(self, request_ids):
        self.released.extend(request_ids)


def _references(hf, prompts, gens):
    return [list(p) + hf_greedy(hf, p, g) for p, g in zip(prompts, gens)]


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_speculative_tokens=0, drafter="ngram"), ValueError, "num_speculative_tokens >= 1"),
    (dict(num_speculative_tokens=-1), ValueError, r"num_speculative_tokens=-1 must be >= 1"),
    (dict(num_speculative_tokens=8), ValueError, r"num_speculative_tokens=8 .*block_size_tokens"
                                                 r" \(8\)"),
    (dict(num_speculative_tokens=2.0), TypeError, "num_speculative_tokens=2.0 must be an int"),
    (dict(num_speculative_tokens=2, drafter="eagle"), ValueError, "drafter='eagle' must be one"),
    (dict(num_speculative_tokens=2, drafter=object()), TypeError, "callable propose"),
])
def test_bad_options_raise_before_anything_is_built(monkeypatch, kwargs, error, match):
    def refuse(*args, **kwargs):
        raise AssertionError("the adapter was built before the options were checked")

    monkeypatch.setattr(engine_build, "transformers_adapter", refuse)
    with pytest.raises(error, match=match):
        Engine.from_transformers(tiny_llama(vocab=64), block_size_tokens=8, **kwargs)


def test_a_drafter_of_another_vocabulary_is_refused(monkeypatch):
    class Other(NgramDrafter):
        vocab_size = 100

    monkeypatch.setattr(engine_build, "transformers_adapter", None)
    with pytest.raises(ValueError, match="drafter has vocab_size=100, the target model 64"):
        Engine.from_transformers(tiny_llama(vocab=64), block_size_tokens=8,
                                 num_speculative_tokens=2, drafter=Other())
    with pytest.raises(ValueError, match="drafter has vocab_size=32, the target model 64"):
        Engine.from_transformers(tiny_llama(vocab=64), block_size_tokens=8,
                                 num_speculative_tokens=2, drafter=tiny_llama(vocab=32))


def test_async_scheduling_with_speculation_refuses_what_it_refuses_without():
    """record_logits (a copy of every step's logits) conflicts with async scheduling with or
    without speculation, named before anything runs."""
    hf = tiny_llama(vocab=64)
    with pytest.raises(ValueError, match="async_scheduling=True conflicts with record_logits"):
        Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                 num_speculative_tokens=2, async_scheduling=True,
                                 record_logits=True)


# ---------------------------------------------------------------------------- the drafters
def test_ngram_drafter_proposes_what_followed_the_longest_recent_match():
    drafter = NgramDrafter(max_ngram=3)
    histories = [np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]),   # 3-gram: the latest match
                 np.array([4, 5, 6, 4, 5]),                        # 2-gram, runs off the end
                 np.array([8, 9, 10]),                             # no match: none
                 np.array([3])]
    drafts = drafter.propose([0, 1, 2, 3], histories, 3)
    # No match: no drafts (-1s), so that the request decodes without speculation's cost.
    assert drafts.tolist() == [[7, 5, 1], [6, 4, 5], [-1, -1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="min_ngram=4 must be <= max_ngram=3"):
        NgramDrafter(min_ngram=4)


# ---------------------------------------------------------------------------- greedy = exact
def _pressure(hf, k, drafter, *, gib=None, **extra):
    prompts = make_prompts(LENGTHS, hf.config.vocab_size)
    requests = greedy_requests(prompts, GENS)
    arrivals = [i // 2 for i in range(len(requests))]
    sizes = dict(block_size=16, blocks=10, paused_blocks=2, max_tokens=32)
    kwargs = dict(kernel_backend="torch", **extra)
    if gib is not None:
        kwargs["gib"] = gib
    engine = build_engine(hf, **sizes, num_speculative_tokens=k, drafter=drafter, **kwargs)
    results = engine.generate_requests(requests, arrival_steps=arrivals)
    return engine, prompts, requests, results


def test_llama_under_pressure_equals_transformers_with_each_drafter():
    hf = tiny_llama()
    prompts = make_prompts(LENGTHS, hf.config.vocab_size)
    oracle = OracleDrafter(_references(hf, prompts, GENS), hf.config.vocab_size)
    for k, drafter in ((1, "ngram"), (3, oracle)):
        engine, prompts, requests, results = _pressure(hf, k, drafter)
        assert_pressure_stats(engine.stats, results)
        assert_requests_match_greedy(hf, requests, prompts, results)
        assert engine.context.block_allocator.total_avail == 9
    spec = engine.stats.speculative
    # The oracle's drafts are right two times in three: some steps accept every draft.
    assert 0.3 < spec["acceptance_rate"] < 1 and spec["tokens_per_forward"] > 1.3, spec
    # At most k drafts a decode row; each gains its accepted drafts and one more (fewer when
    # cut).
    decode_rows = spec["decode_rows"]
    assert 0 < spec["draft_tokens"] <= k * decode_rows
    assert spec["emitted_tokens"] <= spec["accepted_tokens"] + decode_rows
    assert set(oracle.released) >= set(range(len(prompts)))


def test_fewer_forward_passes_than_tokens_and_the_same_tokens_as_without_speculation():
    hf = tiny_llama()
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12]]
    plain = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                     kernel_backend="torch")
    expected = plain.generate(prompts, max_new_tokens=24, ignore_eos=True)
    oracle = OracleDrafter([p + e for p, e in zip(prompts, expected)], hf.config.vocab_size)
    fast = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                    kernel_backend="torch", num_speculative_tokens=4,
                                    drafter=oracle)
    steps = []
    fast.step_callback = steps.append
    assert fast.generate(prompts, max_new_tokens=24, ignore_eos=True) == expected
    assert fast.stats.forward_steps < plain.stats.forward_steps
    assert fast.stats.generated_tokens == plain.stats.generated_tokens == 48
    # Streaming sees every token: the lists of each step add up to the outputs.
    streamed = defaultdict(list)
    for step in steps:
        for request_id, tokens in step.all_new_tokens.items():
            assert tokens[-1] == step.new_tokens[request_id]
            streamed[request_id].extend(tokens)
    assert [streamed[i] for i in sorted(streamed)] == expected


def test_finish_rules_apply_to_accepted_tokens_in_order():
    """A termination id or the length limit inside the accepted drafts ends the request
    there: its later accepted tokens are dropped, as without speculation."""
    hf = tiny_llama(vocab=64)
    prompt = [3, 4, 5, 6]
    reference = hf_greedy(hf, prompt, 20)
    stop = reference[6]
    cut = reference.index(stop)
    perfect = OracleDrafter([prompt + reference], 64)
    perfect.propose = lambda ids, histories, k, _o=perfect: np.array(
        [(_o.sequences[0] + [0] * 8)[len(h):len(h) + k] for h in histories], dtype=np.int64)
    engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                      kernel_backend="torch", num_speculative_tokens=5,
                                      drafter=perfect)
    out = engine.generate([prompt], max_new_tokens=20, termination_id=stop)
    assert out == [reference[:cut + 1]]
    assert engine.generate([prompt], max_new_tokens=4, ignore_eos=True) == [reference[:4]]
    assert engine.context.block_allocator.total_avail == \
        engine.context.block_allocator.total_count - 1


def test_generic_family_equals_transformers_with_prefix_caching():
    hf = without_windows(tiny_family("qwen3"))
    for caching in (False, True):
        engine, prompts, requests, results = _pressure(
            hf, 2, "ngram", gib=lambda h, bs, n: n * kv_block_bytes(hf)(h, bs) / 1024 ** 3,
            enable_prefix_caching=caching)
        assert engine.model.path == "generic"
        assert_requests_match_greedy(hf, requests, prompts, results)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_windowed_families_on_kv_groups_equal_transformers(family):
    """KV groups with speculative steps (docs/SEMANTICS.md §22): Gemma 3 (sliding + full) and
    Mistral (every layer windowed, windows of 6), k = 2, under pressure: each window keeps k
    more tokens, so a rewind never reaches a released block; the tokens are transformers'."""
    layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    hf = tiny_family(family, **(layers if family == "gemma3" else {}))
    engine, prompts, requests, results = _pressure(
        hf, 2, "ngram", gib=lambda h, bs, n: n * kv_block_bytes(hf)(h, bs) / 1024 ** 3,
        max_requests=8)
    usage = engine.context.kv_group_usage()
    assert usage["layers"][0] == (family == "gemma3")
    assert engine.context._kv.groups[0].reach == 6 + 2
    assert_pressure_stats(engine.stats, results)
    assert engine.stats.speculative["accepted_tokens"] > 0
    assert_requests_match_greedy(hf, requests, prompts, results)


def test_llama_prefix_caching_shared_prompts_equal_transformers():
    hf = tiny_llama()
    shared = make_prompts([40], hf.config.vocab_size)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared[:20]]
    oracle = OracleDrafter(_references(hf, prompts, [20] * 3), hf.config.vocab_size)
    engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.02,
                                      kernel_backend="torch", enable_prefix_caching=True,
                                      num_speculative_tokens=3, drafter=oracle)
    out = engine.generate(prompts, max_new_tokens=20, ignore_eos=True, arrival_steps=[0, 3, 6])
    assert out == [hf_greedy(hf, p, 20) for p in prompts]
    assert engine.context.prefix_cache_hits > 0


def test_nemotron_h_restores_mamba_states_and_equals_transformers():
    hf = tiny_nemotron_h()
    prompts = make_prompts(LENGTHS[:8], hf.config.vocab_size)
    gens = GENS[:8]
    requests = greedy_requests(prompts, gens)
    oracle = OracleDrafter(_references(hf, prompts, gens), hf.config.vocab_size)
    engine = build_nemotron_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=32,
                                   kernel_backend="torch", attention_backend="torch",
                                   num_speculative_tokens=3, drafter=oracle)
    results = engine.generate_requests(requests, arrival_steps=[i // 2 for i in range(8)])
    assert engine.stats.pauses > 0 and engine.stats.chunked_prefills > 0
    assert engine.stats.speculative["accepted_tokens"] > 0
    assert_requests_match_greedy(hf, requests, prompts, results)


# ---------------------------------------------------------------------------- sampling
def test_seeded_sampled_requests_are_reproducible_and_unseeded_ones_run():
    hf = tiny_llama(vocab=64)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4]]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=11),
              SamplingParams(temperature=1.3, top_p=0.9, seed=12)]

    def run(seed=0):
        engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                          kernel_backend="torch", num_speculative_tokens=3,
                                          seed=seed, drafter=NgramDrafter(min_ngram=1))
        return engine.generate(prompts, max_new_tokens=16, sampling_params=params,
                               ignore_eos=True), engine

    first, engine = run()
    second, _ = run(seed=5)      # the engine's generator is not used by seeded requests
    assert first == second and all(len(tokens) == 16 for tokens in first)
    assert engine.stats.speculative["draft_tokens"] > 0
    unseeded = [SamplingParams(temperature=1.0)] * 2
    out = engine.generate(prompts, max_new_tokens=8, sampling_params=unseeded, ignore_eos=True)
    assert [len(tokens) for tokens in out] == [8, 8]
    assert all(0 <= t < 64 for tokens in out for t in tokens)


def _log_prob_requests(prompts, skip_prompt=(False, True, False)):
    return [DynamicInferenceRequest(
        request_id=i, prompt_tokens=list(prompt),
        sampling_params=SamplingParams(temperature=0.0, top_k=1, num_tokens_to_generate=10,
                                       return_log_probs=True, skip_prompt_log_probs=skip,
                                       termination_id=-1))
        for i, (prompt, skip) in enumerate(zip(prompts, skip_prompt))]


def test_log_probs_are_those_of_the_accepted_tokens():
    """Requests with return_log_probs get the log probs of every token they gain (accepted
    drafts and the target's own) and of their prompts, equal to the engine's without
    speculation (fp32 log-softmax of the same rows, computed in other batches: 1e-5), under
    chunked prefill (max_tokens 8 splits the 20-token prompt)."""
    hf = tiny_llama(vocab=64)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 3, [3, 4] * 4 + [5]]
    options = dict(block_size_tokens=8, buffer_size_gb=0.01, max_tokens=8,
                   kernel_backend="torch")
    plain = Engine.from_transformers(hf, **options).generate_requests(_log_prob_requests(prompts))
    oracle = OracleDrafter([p + r.generated_tokens for p, r in zip(prompts, plain)], 64)
    engine = Engine.from_transformers(hf, **options, num_speculative_tokens=3, drafter=oracle)
    results = engine.generate_requests(_log_prob_requests(prompts))
    assert engine.stats.speculative["accepted_tokens"] > 0
    for got, want in zip(results, plain):
        assert got.finish_reason == want.finish_reason == "length"
        assert got.generated_tokens == want.generated_tokens
        assert len(got.generated_log_probs) == len(want.generated_log_probs) == 10
        assert np.allclose(got.generated_log_probs, want.generated_log_probs, atol=1e-5)
        if want.prompt_log_probs is None:
            assert got.prompt_log_probs is None
        else:
            assert len(got.prompt_log_probs) == len(want.prompt_log_probs)
            assert np.allclose(got.prompt_log_probs, want.prompt_log_probs, atol=1e-5)


def test_record_logits_records_each_gained_tokens_row():
    """record_logits with speculation: one ``(tokens before it, logits row)`` per generated
    token, as the engine without speculation records them (same lengths, rows within fp32
    rounding of another batch)."""
    hf = tiny_llama(vocab=64)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 2]
    options = dict(block_size_tokens=8, buffer_size_gb=0.01, kernel_backend="torch",
                   record_logits=True)
    requests = lambda: greedy_requests(prompts, [9, 9])  # noqa: E731
    plain = Engine.from_transformers(hf, **options).generate_requests(requests())
    oracle = OracleDrafter([p + r.generated_tokens for p, r in zip(prompts, plain)], 64)
    engine = Engine.from_transformers(hf, **options, num_speculative_tokens=3, drafter=oracle)
    results = engine.generate_requests(requests())
    assert engine.stats.speculative["accepted_tokens"] > 0
    for got, want in zip(results, plain):
        assert got.generated_tokens == want.generated_tokens
        assert [n for n, _ in got.step_logits] == [n for n, _ in want.step_logits] == \
            list(range(len(got.prompt_tokens), len(got.prompt_tokens) + 9))
        for (_, row), (_, ref), token in zip(got.step_logits, want.step_logits,
                                             got.generated_tokens):
            assert int(row.argmax()) == token and torch.allclose(row, ref, atol=1e-5)


def test_a_drafter_that_breaks_its_contract_raises_naming_it():
    hf = tiny_llama(vocab=64)

    class Bad(NgramDrafter):
        def propose(self, request_ids, histories, k):
            return torch.full((len(histories), k), 64)

    engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                      kernel_backend="torch", num_speculative_tokens=2,
                                      drafter=Bad())
    with pytest.raises(ValueError, match=r"drafter.propose returned token id 64, outside"):
        engine.generate([[1, 2, 3]], max_new_tokens=3)


# ---------------------------------------------------------------------------- draft model
def test_draft_model_drafter_gives_the_greedy_outputs_and_accepts_drafts():
    """A draft model a quarter of the target's size (same vocabulary), and the target itself
    as its own draft model (every draft accepted but where the finish rules cut)."""
    hf = tiny_llama()
    draft = tiny_llama(seed=1, hidden=32, intermediate=64, layers=1)
    prompts = make_prompts([5, 17, 9], hf.config.vocab_size)
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    for drafter, rate in ((draft, 0.0), (hf, 0.99)):
        engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                          max_tokens=64, kernel_backend="torch",
                                          num_speculative_tokens=3, drafter=drafter)
        assert engine.generate(prompts, max_new_tokens=12, ignore_eos=True) == expected
        spec = engine.stats.speculative
        assert spec["acceptance_rate"] >= rate, spec
    assert spec["tokens_per_forward"] > 3


# ---------------------------------------------------------------------------- the demo
@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_demo_speculative_matches_transformers(capsys, drafter):
    from dynctx import cli_demo

    assert cli_demo.main(["--requests", "4", "--max-new-tokens", "8", "--plot", "",
                          "--no-progress", "--speculative", drafter]) == 0
    out = capsys.readouterr().out
    assert "check             OK: 4/4 outputs match" in out
    assert f"speculative       {drafter} drafter, k=3: " in out


def test_demo_refuses_speculative_flags_that_do_not_combine(capsys):
    from dynctx import cli_demo

    with pytest.raises(SystemExit, match="--speculative-tokens 16 must be below --block-size "
                                         "16"):
        cli_demo.main(["--speculative", "ngram", "--speculative-tokens", "16", "--plot", ""])


# ---------------------------------------------------------------------------- graphs, suspend
def test_graph_replays_of_speculative_steps_and_suspend_resume_keep_the_outputs():
    """Decode graphs of 1 + k tokens a request, replayed by the stand-in runner (every launch
    checked against the capture), and a suspend / resume in the middle: greedy outputs as
    transformers'."""
    hf = tiny_llama(vocab=64)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7], [9]]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    oracle = OracleDrafter([p + e for p, e in zip(prompts, expected)], 64)
    engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                      max_tokens=64, kernel_backend="torch", num_cuda_graphs=4,
                                      num_speculative_tokens=2, drafter=oracle)
    assert engine.graph_runner is not None
    decode_graphs = [d for d in engine.context.cuda_graph_batch_dimensions_list
                     if d.prefill_req_count == 0]
    assert all(d.token_count == 3 * d.decode_req_count for d in decode_graphs)
    for i, prompt in enumerate(prompts):
        engine.add_request(DynamicInferenceRequest(
            request_id=i, prompt_tokens=prompt,
            sampling_params=SamplingParams(temperature=0.0, num_tokens_to_generate=12)))
    results = []
    for _ in range(3):
        results += engine.step().finished
    engine.suspend()
    engine.resume()
    results += engine.run()
    assert {r.request_id: r.generated_tokens for r in results} == dict(enumerate(expected))
    assert engine.graph_replays > 0 and engine.stats.speculative["accepted_tokens"] > 0


def test_a_mixed_step_with_drafted_rows_is_not_replayed_in_a_prefill_graph():
    """A step of drafted decode rows and a prefill chunk: the ladder's mixed graphs have
    prefill slots only, which give one logit row a request, so the drafted rows (``1 + d``
    rows each) must not take them: the step runs eagerly (or in a graph with decode slots),
    and the outputs are transformers' (a replay in a prefill graph lost the prefill's row)."""
    hf = tiny_llama()
    prompts = make_prompts([3, 17, 40, 9], 256)
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    oracle = OracleDrafter([p + e for p, e in zip(prompts, expected)], 256)
    engine = build_engine(hf, block_size=16, blocks=48, paused_blocks=8, max_tokens=32,
                          max_requests=8, kernel_backend="torch", num_cuda_graphs=4,
                          num_speculative_tokens=3, drafter=oracle)
    assert any(d.prefill_req_count and not d.decode_req_count
               for d in engine.context.cuda_graph_batch_dimensions_list)
    results = engine.generate(prompts, max_new_tokens=10, arrival_steps=[0, 0, 1, 2],
                              ignore_eos=True)
    assert results == expected
    assert engine.graph_replays > 0 and engine.stats.speculative["accepted_tokens"] > 0
