"""Megatron-Core 0.19's ``TorchSampling`` and processed log probs (``calculate_log_probs(...,
sampling=)`` with ``logprobs_mode="processed_logprobs"``; context/sampling.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import add, make_ctx, request

from dynctx.context import TorchSampling


def _context(temperature, top_k, top_p):
    return SimpleNamespace(
        total_request_count=len(temperature), paused_request_count=0,
        active_request_metadata={"temperature": torch.tensor(temperature),
                                 "top_k": torch.tensor(top_k, dtype=torch.int32),
                                 "top_p": torch.tensor(top_p)})


def test_filters_by_hand():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    top2 = TorchSampling.filter_logits(logits, 1.0, 2, 0.0)
    assert top2.tolist() == [[-math.inf, 4.0, -math.inf, 3.0]]
    # Temperature 2 halves; the input is not modified.
    assert TorchSampling.filter_logits(logits, 2.0, 0, 0.0).tolist() == [[0.5, 2.0, 1.0, 1.5]]
    assert logits.tolist() == [[1.0, 4.0, 2.0, 3.0]]
    # Probabilities of [4, 3, 2, 1]: 0.644, 0.237, 0.087, 0.032. top_p = 0.7 keeps the two
    # largest (the mass before the second is 0.644 < 0.7), top_p = 0.5 the largest only.
    assert TorchSampling.filter_logits(logits, 1.0, 0, 0.7).isfinite().tolist() == \
        [[False, True, False, True]]
    assert TorchSampling.filter_logits(logits, 1.0, 0, 0.5).isfinite().tolist() == \
        [[False, True, False, False]]
    with pytest.raises(AssertionError, match="top-p and top-k"):
        TorchSampling.filter_logits(logits, 1.0, 2, 0.5)


def test_log_probs_kernel_groups_rows_by_their_request():
    sampling = TorchSampling(rng=torch.Generator(), vocab_size=6)
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    context = _context([1.0, 0.5], [0, 2], [0.0, 0.0])
    owners = torch.tensor([0, 0, 1, 1, 1])
    got = sampling.log_probs_kernel(logits, context, token_to_request_index=owners)
    assert torch.equal(got[:2], torch.log_softmax(logits[:2], dim=-1))
    want = torch.log_softmax(TorchSampling.filter_logits(logits[2:], 0.5, 2, 0.0), dim=-1)
    assert torch.equal(got[2:], want)
    assert (got[2:].isfinite().sum(dim=-1) == 2).all()


def test_sample_kernel_top_k_1_is_argmax_and_rows_follow_their_request():
    sampling = TorchSampling(rng=torch.Generator().manual_seed(1), vocab_size=6)
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    context = _context([1.0, 1.0, 1.0], [1, 2, 1], [0.0, 0.0, 0.0])
    out = sampling.sample_kernel(logits, 3, context, no_top_k=False, no_top_p=True)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[1] in logits[1].topk(2).indices


def _prefill_and_decode(mode):
    ctx = make_ctx(vocab_size=200)
    ctx.config = SimpleNamespace(logprobs_mode=mode)
    add(ctx, request(1, 3))
    r2 = request(2, 4)
    r2.sampling_params.temperature, r2.sampling_params.top_k = 0.5, 3
    add(ctx, r2)
    ctx.initialize_attention_state()
    logits = torch.randn(1, ctx.padded_active_token_count, 200,
                         generator=torch.Generator().manual_seed(3))
    return ctx, logits


def test_processed_log_probs_of_a_prefill_step_use_each_requests_filter():
    ctx, logits = _prefill_and_decode("processed_logprobs")
    sampling = TorchSampling(rng=torch.Generator(), vocab_size=200)
    new_tokens = torch.tensor([7, 9])
    lists, full = ctx.calculate_log_probs(logits, new_tokens, sampling=sampling)
    rows = logits[0, :7].float()
    assert torch.equal(full[:3], torch.log_softmax(rows[:3], dim=-1))
    assert torch.equal(full[3:], torch.log_softmax(
        TorchSampling.filter_logits(rows[3:], 0.5, 3, 0.0), dim=-1))
    inputs = ctx.token_to_input_ids[:7].tolist()
    targets = inputs[1:3] + [7] + inputs[4:7] + [9]
    flat = lists[0] + lists[1]
    assert [len(x) for x in lists] == [3, 4]
    assert flat == [full[i, t].item() for i, t in enumerate(targets)]
    # Request 2's sampled token 9 is outside its top 3 unless its logit ranks there.
    assert (flat[-1] == -math.inf) == (9 not in rows[6].topk(3).indices.tolist())


def test_raw_mode_ignores_the_backend_and_processed_mode_needs_one():
    ctx, logits = _prefill_and_decode("raw_logprobs")
    sampling = TorchSampling(rng=torch.Generator(), vocab_size=200)
    raw, _ = ctx.calculate_log_probs(logits, torch.tensor([7, 9]))
    assert ctx.calculate_log_probs(logits, torch.tensor([7, 9]), sampling=sampling)[0] == raw
    ctx.config.logprobs_mode = "processed_logprobs"
    with pytest.raises(ValueError, match="processed_logprobs' needs a sampling backend"):
        ctx.calculate_log_probs(logits, torch.tensor([7, 9]))


def test_active_request_metadata_is_a_view_of_the_active_rows():
    ctx = make_ctx()
    add(ctx, request(1, 3))
    r2 = request(2, 3)
    r2.sampling_params.top_k = 4
    add(ctx, r2)
    meta = ctx.active_request_metadata
    assert meta["top_k"][:2].tolist() == [0, 4]
    meta["top_k"][0] = 5
    assert ctx.request_metadata["top_k"][0].item() == 5


@pytest.mark.parametrize("args, match", [
    ((torch.ones(1, 4), 0.0, 0, 0.0), "temperature=0.0 must be a finite number > 0"),
    ((torch.ones(1, 4), float("nan"), 0, 0.0), "temperature=nan must be a finite"),
    ((torch.ones(1, 4), 1.0, -2, 0.0), r"top_k=-2 must be an int >= 0"),
    ((torch.ones(1, 4), 1.0, 2.5, 0.0), r"top_k=2.5 must be an int >= 0"),
    ((torch.ones(1, 4), 1.0, 0, -0.5), r"top_p=-0.5 must lie in \[0, 1\]"),
    ((torch.ones(4), 1.0, 2, 0.0), r"last_token_logits must be a floating \[rows, vocab\]"),
])
def test_filter_logits_refuses_what_would_give_nan_or_no_filter(args, match):
    with pytest.raises(ValueError, match=match):
        TorchSampling.filter_logits(*args)


def test_the_backend_refuses_rows_it_would_hand_back_unwritten():
    with pytest.raises(TypeError, match="rng must be a torch.Generator"):
        TorchSampling(rng=5, vocab_size=6)
    with pytest.raises(ValueError, match="vocab_size=-3 must be None or an int >= 0"):
        TorchSampling(rng=torch.Generator(), vocab_size=-3)
    sampling = TorchSampling(rng=torch.Generator(), vocab_size=6)
    context = _context([1.0, 0.5], [0, 2], [0.0, 0.0])
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    for kwargs, error, match in [
        (dict(), ValueError, "logits gives 5 rows, the active requests 2"),
        (dict(token_to_request_index=torch.tensor([0, 0, 1])), ValueError,
         "logits gives 5 rows, the entries of token_to_request_index 3"),
        (dict(token_to_request_index=torch.tensor([0, 0, 1, 1, -1])), ValueError,
         r"holds requests in \[-1, 1\], outside the active ones \[0, 2\)"),
        (dict(token_to_request_index=torch.tensor([0., 0, 1, 1, 1])), TypeError,
         "token_to_request_index must be a 1-D integer tensor"),
    ]:
        with pytest.raises(error, match=match):
            sampling.log_probs_kernel(logits, context, **kwargs)
    for n, kwargs, error, match in [
        (5, dict(), ValueError, "n gives 5 rows, the active requests 2"),
        (2.0, dict(), TypeError, "n=2.0 must be an int"),
        (2, dict(output=torch.empty(1, dtype=torch.int64)), ValueError,
         r"output must be an integer tensor \[>= n=2\], got \(1,\)"),
        (2, dict(output=torch.empty(2)), ValueError, r"got \(2,\) torch.float32"),
    ]:
        with pytest.raises(error, match=match):
            sampling.sample_kernel(logits[:2], n, context, no_top_k=True, no_top_p=True, **kwargs)
