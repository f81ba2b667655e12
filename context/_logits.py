"""Logits of the context: last-token rows and log probs, through the last-token kernels."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from dynctx.kernels.last_token_logits import last_token_logits as last_token_logits_kernel
from dynctx.kernels.last_token_logits import token_log_probs

from ._fields import FIELD_QUERY
from .inputs import check_new_tokens


class LogitsMixin:
    """``last_token_logits`` and ``calculate_log_probs`` of ``DynamicInferenceContext``."""

    def _logits_2d(self, logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
        if logits.dim() == 3:
            if logits.shape[0] != 1:
                raise ValueError(f"{name} must be [1, tokens, vocab], got {tuple(logits.shape)}")
            logits = logits[0]
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"{name} must be a floating [1, tokens, vocab] or [tokens, vocab] "
                             f"tensor, got {tuple(logits.shape)} {logits.dtype}")
        if logits.device != self.device:
            raise ValueError(f"{name} is on {logits.device}, the context on {self.device}")
        if self.vocab_size is not None and logits.shape[1] != self.vocab_size:
            raise ValueError(f"{name} has {logits.shape[1]} vocabulary columns, vocab_size is "
                             f"{self.vocab_size}")
        return logits

    def _check_finite(self, name: str, rows: torch.Tensor) -> None:
        """With ``validate``: no NaN or +inf in the real (not padding) rows used (one read-back;
        -inf stays legal: it masks tokens)."""
        if self.validate and rows.numel() and bool((rows.isnan() | rows.isposinf()).any()):
            raise ValueError(f"{name} holds NaN or +inf values in the rows of real tokens "
                             "(validate=True)")

    def last_token_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[active, vocab]``: each active request's last-token row of ``logits``
        (``[1, padded_tokens, vocab]``)."""
        self._check_allocated()
        meta = self._require_attention_state("last_token_logits")
        logits = self._logits_2d(logits)
        if logits.shape[0] != self.padded_active_token_count:
            raise ValueError(f"logits has {logits.shape[0]} token rows, the step has "
                             f"{self.padded_active_token_count} (padded_active_token_count)")
        last = last_token_logits_kernel(logits, meta.cu_query_seq_lengths,
                                        self.get_active_request_count(),
                                        backend=self.kernel_backend)
        self._check_finite("logits", last)
        return last

    def calculate_log_probs(self, logits: torch.Tensor, new_tokens: torch.Tensor,
                            only_last_token_logits: Optional[bool] = False
                            ) -> Tuple[List[List[float]], torch.Tensor]:
        """Log probs of the sampled tokens (decode) and of the prompt tokens (prefill), one list
        per active request; also returns the fp32 log-softmax of the rows used. Called before
        ``initialize_attention_state`` of this step, it builds the step first (Megatron-Core's
        order: the step's arrays exist after ``add_request``/``update_requests``)."""
        self._check_allocated()
        if self._step is None:
            self._materialize_step()
        meta = self._require_attention_state("calculate_log_probs")
        logits = self._logits_2d(logits)
        A = self.get_active_request_count()
        new_tokens = check_new_tokens(new_tokens, A, self.device, validate=self.validate,
                                      vocab_size=self.vocab_size)
        if self.is_decode_only() or only_last_token_logits:
            if logits.shape[0] < A:
                raise ValueError(f"logits has {logits.shape[0]} rows, fewer than the {A} "
                                 "active requests")
            self._check_finite("logits", logits[:A])
            selected, full = token_log_probs(logits[:A], new_tokens, return_full=True,
                                             backend=self.kernel_backend)
            return [[value] for value in selected.tolist()], full
        active = self.active_token_count
        if logits.shape[0] < active:
            raise ValueError(f"logits has {logits.shape[0]} rows, fewer than the step's {active} "
                             "tokens")
        self._check_finite("logits", logits[:active])
        # Each token predicts the next input token; a request's last token predicts its sample.
        targets = torch.roll(self.token_to_input_ids[:active], -1)
        last = meta.cu_query_seq_lengths[1:A + 1].long() - 1
        targets.index_copy_(0, last, new_tokens.long())
        selected, full = token_log_probs(logits[:active], targets, return_full=True,
                                         backend=self.kernel_backend)
        lengths = self._table.rows[FIELD_QUERY, self.paused_request_count:self.total_request_count]
        values = selected.tolist()
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        return [values[bounds[i]:bounds[i + 1]] for i in range(A)], full
