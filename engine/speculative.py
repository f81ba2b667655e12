"""Verification of speculative drafts: exact greedy acceptance and rejection sampling.

A decode request of a speculative step forwards its pending token and ``k`` drafts
``d_1..d_k``; the target's logits row ``j`` (``0 <= j <= k``) predicts the token after the
pending token and ``d_1..d_j``. Both rules return, per request, ``accepted`` (the drafts kept,
``0..k``) and ``next`` (the target's own token after them: the correction of the first rejected
draft, or the bonus token when all were accepted); the request gains ``d_1..d_accepted, next``.

* Greedy (``greedy_verify``): ``d_j`` is accepted while it equals the argmax of row ``j - 1``;
  ``next`` is the argmax of row ``accepted``. The tokens are exactly those greedy decoding
  without speculation gives.
* Sampled (``rejection_sample``, Leviathan et al. 2023): with ``p_j`` the target's distribution
  of row ``j`` (the request's temperature, top-k and top-p: ``target_probs``) and ``q_j`` the
  drafter's (one-hot at ``d_{j+1}`` for a deterministic drafter), ``d_{j+1}`` is accepted when
  ``u < min(1, p_j(d) / q_j(d))``; the first rejection draws ``next`` from ``max(p_j - q_j, 0)``
  normalised, and when every draft is accepted ``next`` is drawn from ``p_k``. Each token then
  follows the target's distribution exactly. With one-hot ``q`` and one-hot ``p`` (greedy) this
  is the exact-match rule.

The uniform numbers are the caller's (``engine/speculative_step.py`` draws them per request
and token index, so a seeded request is reproducible run to run). Everything here is
vectorised over requests and positions on the logits' device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .sampling import filter_sorted_logits


def greedy_verify(target: torch.Tensor, drafts: torch.Tensor) -> Tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """``target`` int ``[R, 1 + k]`` (the argmax of each row), ``drafts`` int ``[R, k]``:
    ``(accepted [R], next [R])``, int64."""
    k = drafts.shape[1]
    match = drafts.long() == target[:, :k].long()
    accepted = torch.cumprod(match.long(), dim=1).sum(dim=1)
    nxt = target.long().gather(1, accepted[:, None]).squeeze(1)
    return accepted, nxt


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """The distribution ``engine/sampling.py`` draws from, for each row of ``logits``
    ``[rows, V]`` (temperature, then top-k, then top-p; per-row parameters ``[rows]``), as
    fp32 probabilities ``[rows, V]`` in vocabulary order. A row without any finite
    probability comes back NaN."""
    logits = logits.float()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature.float()[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(filter_sorted_logits(sorted_logits, top_k.long(), top_p.float()),
                          dim=-1)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def draw(dist: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of the unnormalised ``dist`` ``[rows, V]`` (non-negative) by inverse
    CDF with ``uniforms`` ``[rows]`` in [0, 1); never an entry of zero mass (a row of no mass
    at all gives its argmax)."""
    cdf = torch.cumsum(dist, dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None].contiguous()
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    positive = dist > 0
    vocab = dist.shape[-1]
    last_positive = vocab - 1 - torch.argmax(positive.flip(-1).to(torch.uint8), dim=-1)
    index = torch.minimum(index, last_positive)
    return torch.where(positive.any(dim=-1), index, dist.argmax(dim=-1))


def rejection_sample(p: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                     u_draw: torch.Tensor, q: Optional[torch.Tensor] = None,
                     num_drafts: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of ``drafts`` int ``[R, k]`` against the target's probabilities
    ``p`` ``[R, 1 + k, V]``; ``q`` ``[R, k, V]`` the drafter's (None: one-hot at the drafts).
    ``u_accept`` ``[R, k]`` and ``u_draw`` ``[R, 1 + k]`` are uniforms in [0, 1): draft ``j``
    is tested with ``u_accept[:, j]``, and the token drawn after ``a`` accepted drafts uses
    ``u_draw[:, a]``. ``num_drafts`` ``[R]`` (None: ``k`` each): a row's drafts past its count
    are none (after all of its own are accepted, its bonus token is drawn from ``p``). Returns
    ``(accepted [R], next [R])``, int64."""
    rows, k = drafts.shape
    own = None if num_drafts is None else \
        torch.arange(k, device=drafts.device)[None, :] < num_drafts.long()[:, None]
    drafts = drafts.long().clamp(min=0)
    p = p.float()
    p_draft = p[:, :k].gather(2, drafts[..., None]).squeeze(2)                 # [R, k]
    if q is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q = q.float()
        q_draft = q.gather(2, drafts[..., None]).squeeze(2)
    # u < min(1, p / q), without dividing (q = 0 never proposed the draft: accept iff p > 0).
    accept = u_accept.to(p.dtype) * q_draft < p_draft
    if own is not None:
        accept &= own
    accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)                 # [R]
    index = torch.arange(rows, device=p.device)
    at = p[index, accepted]                                                   # [R, V]
    rejected = accepted < (k if num_drafts is None else num_drafts.long())
    position = accepted.clamp(max=k - 1)
    if q is None:
        proposal = torch.zeros_like(at).scatter_(1, drafts[index, position][:, None], 1.0)
    else:
        proposal = q[index, position]
    residual = (at - proposal).clamp_(min=0)
    # A residual of no mass (p <= q everywhere: rounding) falls back to p itself.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, at)
    at = torch.where(rejected[:, None], residual, at)
    nxt = draw(at, u_draw.gather(1, accepted[:, None]).squeeze(1))
    return accepted, nxt


def speculative_log_probs(rows: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor,
                          nxt: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, 1 + k]``: at position ``j`` the log prob (log-softmax of the raw logits
    ``rows`` ``[R, 1 + k, V]``) of the token a request gains there: draft ``j`` while
    ``j < accepted``, the target's ``next`` at ``accepted`` (positions after it: junk)."""
    chosen = torch.cat([drafts.long().clamp(min=0), nxt.long()[:, None]], dim=1)
    chosen = chosen.scatter(1, accepted.long()[:, None], nxt.long()[:, None])
    return torch.log_softmax(rows.float(), dim=-1).gather(2, chosen[..., None]).squeeze(2)


def decode_windows(queries: np.ndarray, k: int) -> np.ndarray:
    """The host index of a speculative step's decode rows, int64 ``[3, D, 1 + k]``, from each
    row's query length ``queries`` ``[D]`` (``1 + `` its drafts): ``[0]`` the logit row of
    each position (past a row's own tokens, its last), ``[1]`` the input position of draft
    ``j`` at ``[1, :, j]`` (clamped into the row; the last column unused), ``[2]`` 1 where
    draft ``j`` is one of the row's own."""
    rows = queries.size
    starts = np.zeros(rows, dtype=np.int64)
    np.cumsum(queries[:-1], out=starts[1:])
    last = queries.astype(np.int64)[:, None] - 1
    positions = np.arange(1 + k)[None, :]
    out = np.empty((3, rows, 1 + k), dtype=np.int64)
    out[0] = starts[:, None] + np.minimum(positions, last)
    out[1] = starts[:, None] + np.minimum(positions + 1, last)
    out[2] = positions < last
    return out


@dataclass
class SpeculativeStats:
    """``engine.stats.speculative``'s counters: ``forward_steps`` (speculative engine steps
    that ran the model), ``decode_rows`` (decode requests over those steps), ``draft_tokens``
    (drafts verified: up to ``k`` per decode request and step, none for one the drafter had
    nothing for), ``accepted_tokens`` (of those, accepted), ``acceptance_rate`` (their ratio, 0
    before any draft), ``emitted_tokens`` (tokens the decode requests gained: accepted plus one
    each) and ``tokens_per_forward`` (``emitted_tokens`` per decode request and step, 1 to
    ``1 + k``)."""

    num_speculative_tokens: int
    forward_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    decode_rows: int = 0

    def as_dict(self) -> Dict[str, float]:
        return {"num_speculative_tokens": self.num_speculative_tokens,
                "forward_steps": self.forward_steps, "decode_rows": self.decode_rows,
                "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.accepted_tokens / self.draft_tokens
                if self.draft_tokens else 0.0,
                "emitted_tokens": self.emitted_tokens,
                "tokens_per_forward": self.emitted_tokens / self.decode_rows
                if self.decode_rows else 0.0}
