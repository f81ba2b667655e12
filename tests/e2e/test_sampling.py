"""Per-request sampling: greedy, temperature, top-k, top-p, and seeds independent of the batch."""

from __future__ import annotations

import numpy as np
import torch
from e2e_helpers import gib_for_blocks, make_prompts, tiny_llama
from sizing_warning import built

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine
from dynctx.engine.sampling import REFUSED, filter_sorted_logits, sample, sample_checked


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1),
              SamplingParams(temperature=0.0, top_k=7), SamplingParams(top_k=1, top_p=0.3),
              SamplingParams(temperature=0.0)]
    tokens = sample(logits, params, [0] * 5, np.random.default_rng(0))
    assert torch.equal(tokens, logits.argmax(-1))


def test_rows_without_a_distribution_are_refused_in_the_readout():
    """NaN logits (greedy or sampled), all -inf, and +inf under temperature give no finite
    probabilities: the readout holds REFUSED there; the tokens stay valid ids (what the
    context is given) and the other rows are as ``sample`` draws them."""
    logits = torch.randn(7, 30, generator=torch.Generator().manual_seed(4))
    logits[0, 3] = float("nan")                    # greedy, NaN
    logits[1, 5] = float("nan")                    # sampled, NaN
    logits[2] = float("-inf")                      # sampled, nothing allowed
    logits[3, 7] = float("inf")                    # sampled, +inf under temperature
    logits[4, 9] = float("inf")                    # greedy, +inf: that token (legal)
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.8, seed=2), SamplingParams(temperature=0.5, seed=3),
              SamplingParams(top_k=1), SamplingParams(temperature=0.9, seed=4),
              SamplingParams(top_k=1)]
    tokens, readout = sample_checked(logits, params, [0] * 7, np.random.default_rng(0))
    assert readout.tolist()[:4] == [REFUSED] * 4
    assert int(readout[4]) == 9 and tokens.min() >= 0 and tokens.max() < 30
    assert torch.equal(readout[4:], tokens[4:])
    assert torch.equal(tokens, sample(logits, params, [0] * 7, np.random.default_rng(0)))
    assert int(tokens[6]) == int(logits[6].argmax())


def test_seeded_draws_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 100, generator=gen)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i) for i in range(6)]
    batch = sample(logits, params, [3, 0, 5, 1, 2, 9], np.random.default_rng(0))
    for i in range(6):
        alone = sample(logits[i:i + 1], [params[i]], [[3, 0, 5, 1, 2, 9][i]],
                       np.random.default_rng(123))
        assert int(alone) == int(batch[i])
    # A different token index is a different draw.
    draws = {int(sample(logits[:1], [params[0]], [k], np.random.default_rng(0)))
             for k in range(40)}
    assert len(draws) > 1


def test_top_k_and_top_p_filter():
    sorted_logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]] * 4))
    kept = filter_sorted_logits(sorted_logits.repeat(2, 1)[:5], torch.tensor([0, 2, 0, 0, 1]),
                                torch.tensor([0.0, 0.0, 0.75, 0.5, 0.0]))
    finite = torch.isfinite(kept).sum(-1).tolist()
    # no filter; top-2; top-p 0.75 keeps 0.5+0.3; top-p 0.5 keeps the first (mass reaches 0.5);
    # top-1 keeps one (as stated; the engine's callers send no greedy row, is_greedy)
    assert finite == [5, 2, 2, 1, 1]


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log()[None].repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(4000)]
    tokens = sample(logits, params, [0] * 4000, np.random.default_rng(0))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    top_k = sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=s) for s in range(4000)],
                   [0] * 4000, np.random.default_rng(0))
    assert set(top_k.tolist()) == {0, 1}


def test_seeded_requests_match_alone_and_under_memory_pressure():
    """A seeded request draws the same tokens in a busy engine (pauses, evictions, chunked
    prefill, recompute) as alone in a roomy one."""
    hf = tiny_llama(seed=12)
    prompts = make_prompts([1, 5, 17, 40, 3, 33, 16, 48, 2, 9], hf.config.vocab_size, seed=13)

    def requests():
        return [DynamicInferenceRequest(
            request_id=i, prompt_tokens=prompt,
            sampling_params=SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1000 + i,
                                           num_tokens_to_generate=32))
            for i, prompt in enumerate(prompts)]

    busy = built(lambda: Engine.from_transformers(
        hf, block_size_tokens=16, buffer_size_gb=gib_for_blocks(hf, 16, 12),
        paused_buffer_size_gb=gib_for_blocks(hf, 16, 2), max_tokens=32, kernel_backend="torch"))
    crowded = busy.generate_requests(requests(), arrival_steps=[i // 3 for i in range(10)])
    assert busy.stats.pauses + busy.stats.evictions > 0 and busy.stats.chunked_prefills > 0
    for i, request in enumerate(requests()):
        roomy = Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=0.01,
                                         max_tokens=256, kernel_backend="torch", seed=99)
        alone = roomy.generate_requests([request])[0]
        assert alone.generated_tokens == crowded[i].generated_tokens, f"request {i}"
