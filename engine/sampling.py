"""Per-request sampling from last-token logits, independent of the batch a request runs in.

Each row is sampled from its own ``SamplingParams``: greedy (argmax) at ``temperature == 0`` or
``top_k == 1``; otherwise temperature, then top-k (0: off), then top-p (0.0 or 1.0: off; keep
the smallest prefix of the sorted distribution whose mass reaches ``top_p``), then one draw by
inverse CDF. The uniform number of a draw comes from ``numpy.random.default_rng([seed,
token_index])`` when the request has a ``seed``: it depends only on the request and on how many
tokens it has generated, never on the batch, its row or the step, so a request re-run after an
eviction draws the same tokens. Requests without a seed draw from the engine's generator.
Every operation is row-wise, so a row's result does not depend on the other rows either.

Sampling refuses a row that gives no distribution: logits holding NaN, all ``-inf``, or (under
temperature) ``+inf``, whose probabilities are not finite. ``sample_checked`` returns, beside
the tokens, the same tokens with ``REFUSED`` in those rows: the host reads that one tensor, so
the refusal costs no extra read. The sampling parameters reach the device in one upload, from
pinned memory without blocking the host on CUDA.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from dynctx.context import SamplingParams

# The token read back for a row sampling refused (its probabilities are not finite).
REFUSED = -1


def finish_reason(params: SamplingParams, token: int, generated: int) -> Optional[str]:
    """``"stop"`` when ``token`` is the request's termination id, else ``"length"`` when
    ``generated`` (its tokens so far, ``token`` included) reaches ``num_tokens_to_generate``,
    else None."""
    termination = params.termination_id
    if termination is not None and termination >= 0 and token == termination:
        return "stop"
    return "length" if generated >= params.num_tokens_to_generate else None


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.top_k == 1


def uniform_draw(seed: Optional[int], token_index: int, fallback: np.random.Generator) -> float:
    """The uniform number in [0, 1) for the ``token_index``-th generated token of a request."""
    if seed is None:
        return float(fallback.random())
    return float(np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(token_index)]).random())


def filter_sorted_logits(sorted_logits: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the entries of descending-sorted logits ``[rows, V]`` outside top-k
    (``top_k`` ``[rows]``, 0 off) and top-p (``top_p`` ``[rows]``, 0 or 1 off)."""
    vocab = sorted_logits.shape[-1]
    ranks = torch.arange(vocab, device=sorted_logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep = ranks < k[:, None]
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    p_on = (top_p > 0) & (top_p < 1)
    keep &= ~p_on[:, None] | (mass_before < top_p[:, None])
    keep[:, 0] = True
    return sorted_logits.masked_fill(~keep, float("-inf"))


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without blocking the host: on CUDA a non-blocking copy from
    pinned memory (PyTorch's pinned allocator keeps the block until the copy is done), on a
    CPU the array itself."""
    host = torch.from_numpy(values)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def sample_checked(logits: torch.Tensor, params: Sequence[SamplingParams],
                   token_indices: Sequence[int],
                   generator: np.random.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``[rows, V]`` (any float dtype; the math is fp32).

    ``params[i]`` and ``token_indices[i]`` (tokens the request generated so far) belong to row
    ``i``. Returns ``(tokens, readout)``, both int64 ``[rows]`` on ``logits``' device:
    ``tokens`` holds a valid id in every row (what the context may be given); ``readout`` is
    ``tokens`` with ``REFUSED`` in each row whose logits give no distribution (NaN, all
    ``-inf``, or ``+inf`` under temperature), what the host reads.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(token_indices):
        raise ValueError(f"logits {tuple(logits.shape)} needs one row per request "
                         f"({len(params)} params, {len(token_indices)} token indices)")
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    # NaN and -inf maxima fail the comparison: no token to pick.
    refused = ~(logits.amax(dim=-1) > float("-inf"))
    rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if rows:
        _sample_rows(logits, tokens, refused, rows, params, token_indices, generator)
    return tokens, tokens.masked_fill(refused, REFUSED)


def _sample_rows(logits: torch.Tensor, tokens: torch.Tensor, refused: torch.Tensor,
                 rows: Sequence[int], params: Sequence[SamplingParams],
                 token_indices: Sequence[int], generator: np.random.Generator) -> None:
    """Draw the tokens of the sampled ``rows`` into ``tokens`` and mark in ``refused`` those
    whose probabilities are not finite."""
    chosen = [params[i] for i in rows]
    # One upload: rows, temperature, top-k, top-p and the uniform draw of each sampled row
    # (float64 holds the ids and top-k exactly and rounds the floats to fp32 as before).
    packed = np.array([rows, [p.temperature for p in chosen], [p.top_k for p in chosen],
                       [p.top_p for p in chosen],
                       [uniform_draw(params[i].seed, token_indices[i], generator)
                        for i in rows]], dtype=np.float64)
    values = upload(packed, logits.device)
    index, top_k = values[0].long(), values[2].long()
    temperature, top_p, uniforms = values[1].float(), values[3].float(), values[4].float()
    # A temperature below fp32's range (1e-300) rounded to 0 and scaled the top logit to 0/0;
    # at the smallest normal fp32 the top stays 0 and the rest go to -inf: greedy, as meant.
    temperature.clamp_(min=torch.finfo(torch.float32).tiny)
    # Shifted by the row maximum first: a tiny temperature then scales to 0 and -large, never
    # to inf - inf (NaN).
    chosen_logits = logits[index]
    scaled = (chosen_logits - chosen_logits.amax(dim=-1, keepdim=True)) / temperature[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(filter_sorted_logits(sorted_logits, top_k, top_p), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = (uniforms * cdf[:, -1])[:, None].contiguous()
    position = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    # Never land on a masked entry through rounding at the top of the CDF; a row without any
    # positive probability (refused) takes its best-ranked token, never index -1.
    kept = (probs > 0).sum(dim=-1, keepdim=True) - 1
    position = torch.minimum(position, kept).clamp_(min=0)
    tokens[index] = order.gather(1, position).squeeze(1)
    # A NaN total mass (NaN or +inf logits) fails the comparison.
    refused[index] = ~(cdf[:, -1] > 0)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], token_indices: Sequence[int],
           generator: np.random.Generator) -> torch.Tensor:
    """The tokens of ``sample_checked`` (int64 ``[rows]`` on ``logits``' device, a valid id in
    every row, also where sampling refused the row)."""
    return sample_checked(logits, params, token_indices, generator)[0]
