"""Sampling cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md "Mutation
testing"): top-p 1 is off, logits that are not ``[rows, V]`` are refused, low-precision logits
sample as their fp32 values, a greedy row of only ``-inf`` is refused, a tiny temperature picks
the argmax, a draw on a CDF step takes the next token, and a vocabulary of one token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynctx.context import SamplingParams
from dynctx.engine.sampling import REFUSED, filter_sorted_logits, sample, sample_checked


class Fixed:
    """A numpy-like generator whose every draw is ``value`` (unseeded requests draw from it)."""

    def __init__(self, value: float):
        self.value = value

    def random(self):
        return self.value


def test_top_p_of_one_keeps_even_a_tail_that_rounds_away():
    """``top_p`` 1 is off: the tokens after a mass that rounds to 1.0 in fp32 stay kept."""
    sorted_logits = torch.tensor([[0.0, -20.0, -20.0, -20.0]])
    kept = filter_sorted_logits(sorted_logits, torch.tensor([0]), torch.tensor([1.0]))
    assert torch.equal(kept, sorted_logits)


@pytest.mark.parametrize("shape", [(2, 1, 5), (2,)])
def test_logits_that_are_not_one_row_per_request_are_refused(shape):
    params = [SamplingParams(temperature=0.5, seed=1)] * shape[0]
    with pytest.raises(ValueError, match="needs one row per request"):
        sample_checked(torch.zeros(shape), params, [0] * shape[0], np.random.default_rng(0))


def test_bf16_logits_sample_as_their_fp32_values():
    """The math is fp32 whatever the logits' dtype: bf16 logits draw what the same values
    in fp32 draw (bf16 arithmetic before the conversion would move CDF steps)."""
    logits = (torch.randn(256, 64, generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    params = [SamplingParams(temperature=0.7 + 0.01 * i, seed=i) for i in range(256)]
    indices = [3] * 256
    low = sample_checked(logits, params, indices, np.random.default_rng(0))
    full = sample_checked(logits.float(), params, indices, np.random.default_rng(0))
    assert torch.equal(low[0], full[0]) and torch.equal(low[1], full[1])


def test_a_greedy_row_of_only_minus_inf_is_refused():
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    logits[0] = float("-inf")
    tokens, readout = sample_checked(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0],
                                     np.random.default_rng(0))
    assert readout.tolist() == [REFUSED, int(logits[1].argmax())]
    assert 0 <= int(tokens[0]) < 6


def test_a_tiny_temperature_samples_the_argmax():
    """Logits shifted by their maximum before the division: a tiny temperature scales them to 0
    and large negatives, never to inf (then NaN in the softmax, a refused row)."""
    logits = torch.tensor([[30.0, 5.0, 29.0, -3.0], [1.0, 25.0, 0.0, 24.5]])
    params = [SamplingParams(temperature=1e-37, seed=i) for i in range(2)]
    tokens, readout = sample_checked(logits, params, [0, 0], np.random.default_rng(0))
    assert readout.tolist() == [0, 1] and torch.equal(tokens, readout)


def test_a_draw_on_a_cdf_step_takes_the_next_token():
    """Four equal probabilities (CDF 0.25, 0.5, 0.75, 1 exactly) and a draw of 0.5: the token
    is the first whose CDF passes the draw, 2 (the oracle's ``searchsorted`` side right)."""
    tokens = sample(torch.zeros(1, 4), [SamplingParams(temperature=1.0)], [0], Fixed(0.5))
    assert tokens.tolist() == [2]


def test_a_vocabulary_of_one_token_samples_it():
    tokens, readout = sample_checked(torch.tensor([[0.3]]), [SamplingParams(temperature=0.7,
                                                                              seed=4)],
                                     [0], np.random.default_rng(0))
    assert tokens.tolist() == [0] and readout.tolist() == [0]
