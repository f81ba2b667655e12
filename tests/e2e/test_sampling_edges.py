"""Sampling at the top of the CDF (engine/sampling.py): a uniform draw that rounds to 1 in fp32
lands past every kept entry of the sorted distribution; the sample must still be a kept token
(within top-k and top-p), never the first masked one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynctx.context import SamplingParams
from dynctx.engine.sampling import sample


class TopOfTheRange:
    """A numpy-like generator whose every draw is the largest double below 1 (1.0 in fp32)."""

    def random(self):
        return float(np.nextafter(1.0, 0.0))


@pytest.mark.parametrize("top_k, top_p", [(3, 0.0), (0, 0.6), (2, 0.9)])
def test_a_draw_at_the_top_of_the_cdf_samples_a_kept_token(top_k, top_p):
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 12, generator=generator)
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * logits.shape[0]
    tokens = sample(logits, params, [0] * logits.shape[0], TopOfTheRange())
    probs = torch.softmax(logits, dim=-1)
    for row, token in enumerate(tokens.tolist()):
        order = torch.argsort(logits[row], descending=True).tolist()
        kept = order[:top_k] if top_k else order
        if 0 < top_p < 1:
            mass = torch.cumsum(probs[row, order], dim=0) - probs[row, order]
            kept = [t for t, before in zip(order, mass.tolist()) if before < top_p and t in kept]
        # The draw is the largest: the last kept token in rank order.
        assert token == kept[-1], (row, token, kept)
