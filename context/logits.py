"""The step's logits: each request's last-token row, and the log probs of the tokens chosen.

Both read the step's attention metadata (``cu_query_lengths``) and run the last-token kernels
(``dynctx.kernels.last_token_logits``); the caller's logits are checked at the context's edge
first (``inputs.check_logits``).
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from dynctx.kernels.last_token_logits import last_token_logits, token_log_probs

from .inputs import check_finite


def last_rows(logits: torch.Tensor, cu_query_lengths: torch.Tensor, requests: int, *,
              validate: bool, backend) -> torch.Tensor:
    """``[requests, vocab]``: each request's last-token row of ``logits`` ``[tokens, vocab]``."""
    last = last_token_logits(logits, cu_query_lengths, requests, backend=backend)
    if validate:
        check_finite("logits", last)
    return last


def log_probs(logits: torch.Tensor, new_tokens: torch.Tensor, *, requests: int, tokens: int,
              last_only: bool, input_ids: torch.Tensor, cu_query_lengths: torch.Tensor,
              query_lengths: np.ndarray, validate: bool, backend
              ) -> Tuple[List[List[float]], torch.Tensor]:
    """Log probs of the sampled tokens ``new_tokens`` (``last_only``: one row per request) or of
    every token of the step (each token predicts the next input token; a request's last token
    predicts its sample), one list per request; and the fp32 log-softmax of the rows used.
    ``tokens``: the step's real tokens; ``query_lengths``: each request's (host)."""
    if last_only:
        if logits.shape[0] < requests:
            raise ValueError(f"logits has {logits.shape[0]} rows, fewer than the {requests} "
                             "active requests")
        if validate:
            check_finite("logits", logits[:requests])
        selected, full = token_log_probs(logits[:requests], new_tokens, return_full=True,
                                         backend=backend)
        return [[value] for value in selected.tolist()], full
    if logits.shape[0] < tokens:
        raise ValueError(f"logits has {logits.shape[0]} rows, fewer than the step's {tokens} "
                         "tokens")
    if validate:
        check_finite("logits", logits[:tokens])
    targets = torch.roll(input_ids[:tokens], -1)
    last = cu_query_lengths[1:requests + 1].long() - 1
    targets.index_copy_(0, last, new_tokens.long())
    selected, full = token_log_probs(logits[:tokens], targets, return_full=True, backend=backend)
    values = selected.tolist()
    bounds = np.concatenate([[0], np.cumsum(query_lengths)])
    return [values[bounds[i]:bounds[i + 1]] for i in range(requests)], full
