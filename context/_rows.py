"""The request limit and Megatron-Core's row helpers of the context (a mixin of the facade).

``max_requests`` is the limit ``add_request`` enforces, lowered or restored by hand as
Megatron-Core's tests do (the rows allocated at construction are the ceiling).
``_move_book_keeping_tensors`` and ``_swap_book_keeping_tensors`` are Megatron-Core's helpers of
``update_requests``: they permute the host rows (``RequestTable.permute_rows``) and the pending
next tokens; the device mirrors follow at the next upload.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch


class RowsMixin:
    """``max_requests`` and the row moves of ``DynamicInferenceContext``."""

    @property
    def max_requests(self) -> int:
        """Request rows ``add_request`` may fill (``RequestOverflowError`` beyond)."""
        return self._table.request_limit

    @max_requests.setter
    def max_requests(self, value: int) -> None:
        """Lower (or restore) the request limit, as Megatron-Core's tests do by hand; the rows
        allocated at construction are the ceiling."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"max_requests={value!r} must be an int")
        if not max(1, self.total_request_count) <= value <= self._request_rows:
            raise ValueError(
                f"max_requests={value} must lie in [max(1, total_request_count="
                f"{self.total_request_count}), {self._request_rows}] (the rows allocated)")
        self._table.request_limit = int(value)

    def _row_indices(self, name: str, idxs: Any) -> np.ndarray:
        """``idxs`` (tensor on any device, array or sequence of ints) as int64 row numbers in
        ``[0, max_requests)``."""
        if isinstance(idxs, torch.Tensor):
            if idxs.is_floating_point() or idxs.is_complex() or idxs.dtype == torch.bool:
                raise TypeError(f"{name} must hold integer row indices, got {idxs.dtype}")
            idxs = idxs.detach().cpu().numpy()
        array = np.asarray(idxs)
        if array.size and array.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer row indices, got {array.dtype}")
        array = array.astype(np.int64).reshape(-1)
        rows = self._request_rows
        if array.size and (array.min() < 0 or array.max() >= rows):
            raise ValueError(f"{name} holds rows {array[(array < 0) | (array >= rows)].tolist()}"
                             f" outside [0, {rows})")
        return array

    def _rows_op(self, src_idxs: Any, dst_idxs: Any, next_tokens: Optional[torch.Tensor],
                 swap: bool) -> None:
        self._check_allocated()
        src = self._row_indices("src_idxs", src_idxs)
        dst = self._row_indices("dst_idxs", dst_idxs)
        if src.size != dst.size:
            raise ValueError(f"src_idxs has {src.size} rows, dst_idxs {dst.size}")
        touched = np.concatenate([src, dst]) if swap else dst
        if np.unique(touched).size != touched.size:
            raise ValueError(f"{'src_idxs and dst_idxs' if swap else 'dst_idxs'} must be "
                             f"distinct rows, got src {src.tolist()}, dst {dst.tolist()}")
        if next_tokens is not None:
            if not isinstance(next_tokens, torch.Tensor) or next_tokens.dim() != 1:
                raise TypeError(f"next_tokens must be a 1-D tensor or None, got "
                                f"{type(next_tokens).__name__}")
            if touched.size and next_tokens.shape[0] <= touched.max():
                raise ValueError(f"next_tokens has {next_tokens.shape[0]} rows; the rows moved "
                                 f"reach {int(touched.max())}")
        dst_rows, src_rows = (np.concatenate([dst, src]), np.concatenate([src, dst])) if swap \
            else (dst, src)
        self._table.permute_rows(dst_rows, src_rows)
        device = self._device
        device.arena.dirty = True
        pending = device.next_tokens[device.current]
        index_dst = torch.from_numpy(dst_rows).to(pending.device)
        index_src = torch.from_numpy(src_rows).to(pending.device)
        pending[index_dst] = pending[index_src]
        if next_tokens is not None and next_tokens.data_ptr() != pending.data_ptr():
            next_tokens[index_dst.to(next_tokens.device)] = \
                next_tokens[index_src.to(next_tokens.device)]
        self._step = None

    def _move_book_keeping_tensors(self, src_idxs: Any, dst_idxs: Any,
                                   next_tokens: Optional[torch.Tensor]) -> None:
        """Rows ``dst_idxs`` take the bookkeeping of rows ``src_idxs`` (Megatron-Core's helper
        of ``update_requests``): the per-request fields (the Mamba slot among them), metadata,
        block-table rows and pending next tokens, and ``next_tokens[dst] = next_tokens[src]``
        on the tensor given (Megatron's step-local tokens; None: ours only). The source rows
        keep their values; the counts are the caller's. Host-side, uploaded at the next step."""
        self._rows_op(src_idxs, dst_idxs, next_tokens, swap=False)

    def _swap_book_keeping_tensors(self, src_idxs: Any, dst_idxs: Any,
                                   next_tokens: Optional[torch.Tensor]) -> None:
        """Exchange the bookkeeping of rows ``src_idxs`` and ``dst_idxs`` (as
        ``_move_book_keeping_tensors``, both ways; the rows must be distinct)."""
        self._rows_op(src_idxs, dst_idxs, next_tokens, swap=True)
