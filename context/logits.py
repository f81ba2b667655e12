"""The step's logits: each request's last-token row, and the log probs of the tokens chosen.

Both read the step's attention metadata (``cu_query_lengths``) and run the last-token kernels
(``dynctx.kernels.last_token_logits``); the caller's logits are checked at the context's edge
first (``inputs.check_logits``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

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
              query_lengths: np.ndarray, validate: bool, backend,
              processed: Optional[Callable] = None) -> Tuple[List[List[float]], torch.Tensor]:
    """Log probs of the sampled tokens ``new_tokens`` (``last_only``: one row per request) or of
    every token of the step (each token predicts the next input token; a request's last token
    predicts its sample), one list per request; and the fp32 log-softmax of the rows used.
    ``tokens``: the step's real tokens; ``query_lengths``: each request's (host).
    ``processed(rows, owners)``: Megatron-Core 0.19's processed log probs, the fp32
    ``[rows, vocab]`` log-softmax of each row after its request's sampling filter (``owners``:
    the host request index of each row, None for one row per request)."""
    if processed is not None:
        return _processed(logits, new_tokens, requests=requests, tokens=tokens,
                          last_only=last_only, input_ids=input_ids,
                          cu_query_lengths=cu_query_lengths, query_lengths=query_lengths,
                          validate=validate, processed=processed)
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
    targets = _targets(input_ids, new_tokens, tokens, requests, cu_query_lengths)
    selected, full = token_log_probs(logits[:tokens], targets, return_full=True, backend=backend)
    values = selected.tolist()
    bounds = np.concatenate([[0], np.cumsum(query_lengths)])
    return [values[bounds[i]:bounds[i + 1]] for i in range(requests)], full


def _targets(input_ids: torch.Tensor, new_tokens: torch.Tensor, tokens: int, requests: int,
             cu_query_lengths: torch.Tensor) -> torch.Tensor:
    """The token each of the step's ``tokens`` rows predicts: the next input token, and for a
    request's last token its sample."""
    targets = torch.roll(input_ids[:tokens], -1)
    last = cu_query_lengths[1:requests + 1].long() - 1
    return targets.index_copy_(0, last, new_tokens.long())


def _processed(logits, new_tokens, *, requests, tokens, last_only, input_ids, cu_query_lengths,
               query_lengths, validate, processed) -> Tuple[List[List[float]], torch.Tensor]:
    rows = requests if last_only else tokens
    if logits.shape[0] < rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, fewer than the "
                         f"{rows} {'active requests' if last_only else 'tokens of the step'}")
    if validate:
        check_finite("logits", logits[:rows])
    if last_only:
        targets, owners = new_tokens.long(), None
    else:
        targets = _targets(input_ids, new_tokens, tokens, requests, cu_query_lengths)
        owners = torch.arange(requests).repeat_interleave(
            torch.from_numpy(np.ascontiguousarray(query_lengths, dtype=np.int64)))
    full = processed(logits[:rows].float(), owners)
    if not isinstance(full, torch.Tensor) or tuple(full.shape) != (rows, logits.shape[1]) \
            or not full.is_floating_point():
        got = f"{tuple(full.shape)} {full.dtype}" if isinstance(full, torch.Tensor) \
            else type(full).__name__
        raise ValueError(f"sampling.log_probs_kernel returned {got}, expected a floating "
                         f"[{rows}, {logits.shape[1]}] (a log prob per row and vocabulary "
                         "entry)")
    selected = full[torch.arange(rows, device=full.device), targets].tolist()
    if last_only:
        return [[value] for value in selected], full
    bounds = np.concatenate([[0], np.cumsum(query_lengths)])
    return [selected[bounds[i]:bounds[i + 1]] for i in range(requests)], full
