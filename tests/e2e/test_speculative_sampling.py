"""The verification functions of speculative decoding alone (``engine/speculative.py``), no
model: greedy acceptance, and rejection sampling whose outputs follow the target's
distribution (a tiny vocabulary, many draws, a chi-square bound), for a deterministic drafter
(one-hot ``q``) and a drafter with its own distribution."""

from __future__ import annotations

import pytest
import torch

from dynctx.engine.speculative import (
    SpeculativeStats,
    draw,
    greedy_verify,
    rejection_sample,
    target_probs,
)

V = 5


def test_greedy_verify_accepts_the_matching_prefix_and_adds_the_target_token():
    target = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [0, 4, 5]])
    accepted, nxt = greedy_verify(target, drafts)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [6, 4, 3]


def test_one_hot_target_and_drafts_reduce_to_the_exact_match_rule():
    p = torch.nn.functional.one_hot(torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6]]), 8).float()
    drafts = torch.tensor([[3, 4, 5], [3, 9 % 8, 5]])
    u = torch.rand(2, 3)
    accepted, nxt = rejection_sample(p, drafts, u, torch.rand(2, 4))
    assert accepted.tolist() == [3, 1] and nxt.tolist() == [6, 4]


def test_draw_never_picks_a_zero_mass_entry():
    dist = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
    picks = draw(dist, torch.tensor([0.0, 0.4999, 0.999999]))
    assert picks.tolist() == [1, 1, 3]
    assert draw(torch.zeros(1, 4), torch.tensor([0.3])).tolist() == [0]


def test_target_probs_match_the_sampler_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    probs = target_probs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([0.0]))
    expected = torch.softmax(torch.tensor([2.0, 1.0]), dim=0)
    assert torch.allclose(probs[0, :2], expected) and probs[0, 2:].abs().sum() == 0
    top_p = target_probs(logits, torch.tensor([0.5]), torch.tensor([0]), torch.tensor([0.5]))
    assert top_p[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, strict: bool = True) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    if strict:
        assert counts[~keep].sum() == 0, "a token of zero target probability was drawn"
    observed = counts[keep].double()
    statistic = ((observed - expected[keep]) ** 2 / expected[keep]).sum()
    dof = torch.tensor(float(int(keep.sum()) - 1), dtype=torch.float64)
    # The chi-square survival function: the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.mark.parametrize("drafter", ["one_hot", "distribution"])
def test_rejection_sampling_follows_the_target_distribution(drafter):
    """Each emitted token's distribution, given the tokens before it, is the target's: the
    first token against ``p_0``, the second (after an accepted first draft) against ``p_1``.
    200 000 draws of one batched call; the p-value bound fails a correct sampler 1e-4 of the
    time and any visible bias almost surely."""
    generator = torch.Generator().manual_seed(0)
    draws, k = 200_000, 2
    p_rows = torch.tensor([[0.40, 0.25, 0.20, 0.15, 0.00],
                           [0.10, 0.10, 0.50, 0.20, 0.10],
                           [0.30, 0.30, 0.10, 0.10, 0.20]])
    p = p_rows[None].expand(draws, -1, -1)
    if drafter == "one_hot":
        # A deterministic drafter proposing tokens 1 then 2.
        drafts = torch.tensor([1, 2]).expand(draws, -1)
        q = None
    else:
        q_rows = torch.tensor([[0.10, 0.50, 0.10, 0.10, 0.20], [0.25, 0.25, 0.25, 0.0, 0.25]])
        drafts = torch.stack([torch.multinomial(q_rows[j], draws, replacement=True,
                                                generator=generator) for j in range(k)], 1)
        q = q_rows[None].expand(draws, -1, -1)
    u_accept = torch.rand(draws, k, generator=generator)
    u_draw = torch.rand(draws, k + 1, generator=generator)
    accepted, nxt = rejection_sample(p, drafts, u_accept, u_draw, q)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    assert _chi_square_p_value(torch.bincount(first, minlength=V), p_rows[0]) > 1e-4
    # Given an accepted first draft, the second token is drawn from p_1 (the drafts of the
    # first position are independent of the second's).
    on = accepted > 0
    second = torch.where(accepted[on] > 1, drafts[on, 1], nxt[on])
    assert _chi_square_p_value(torch.bincount(second, minlength=V), p_rows[1]) > 1e-4
    # After both drafts are accepted, the bonus token is drawn from p_2.
    bonus = nxt[accepted == k]
    assert bonus.numel() > 1000
    assert _chi_square_p_value(torch.bincount(bonus, minlength=V), p_rows[2]) > 1e-4
    # A visibly wrong sampler fails the same bound: drawing the first token from q.
    if q is not None:
        assert _chi_square_p_value(torch.bincount(drafts[:, 0], minlength=V),
                                   p_rows[0], strict=False) < 1e-4


def test_rejection_sampling_is_a_function_of_its_uniforms():
    p = torch.softmax(torch.randn(4, 3, V, generator=torch.Generator().manual_seed(1)), -1)
    drafts = torch.tensor([[0, 1], [2, 2], [4, 0], [1, 3]])
    u_a = torch.rand(4, 2, generator=torch.Generator().manual_seed(2))
    u_d = torch.rand(4, 3, generator=torch.Generator().manual_seed(3))
    first = rejection_sample(p, drafts, u_a, u_d)
    second = rejection_sample(p.clone(), drafts.clone(), u_a.clone(), u_d.clone())
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_speculative_stats_ratios():
    counts = SpeculativeStats(3, forward_steps=2, draft_tokens=12, accepted_tokens=6,
                              emitted_tokens=10, decode_rows=4)
    assert counts.as_dict()["acceptance_rate"] == 0.5
    assert counts.as_dict()["tokens_per_forward"] == 2.5
    assert SpeculativeStats(2).as_dict()["acceptance_rate"] == 0.0
