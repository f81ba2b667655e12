"""``ContextGPUView``: Megatron-Core 0.19's device snapshot of a step's bookkeeping, one byte
buffer with typed views at fixed addresses (``megatron/core/inference/contexts/gpu_view.py``),
with 0.19's fields, order, dtypes and shapes.

dynctx's context does not stage its bookkeeping through it: the host arena
(``staging.HostArena``) is uploaded in one copy and the token arrays are built on the device
(docs/SEMANTICS.md §16 row 54). ``ctx.gpu_view`` is ``ContextStepView``: 0.19's names for the
context's own device tensors, so code that reads ``ctx.gpu_view.token_to_input_ids`` reads what
the forward pass reads.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

# (name, dtype, shape in terms of R requests, T tokens, B blocks a request, C Mamba chunks).
_TOKEN_FIELDS = [(name, torch.int64, ("T",)) for name in (
    "token_to_input_ids", "token_to_pos_ids", "token_to_block_idx")] + [
    (name, torch.int32, ("T",)) for name in (
        "token_to_local_position_within_kv_block", "token_to_request_idx",
        "token_to_position_in_request")]
_REQUEST_FIELDS = [
    ("request_in_prefill_status", torch.int32, ("R",)),
    ("request_query_lengths", torch.int32, ("R",)),
    ("request_kv_length_offsets", torch.int32, ("R",)),
    ("temperature", torch.float32, ("R",)),
    ("top_k", torch.int32, ("R",)),
    ("top_p", torch.float32, ("R",)),
    ("active_request_last_token_idxs", torch.int32, ("R",)),
    ("real_token_count", torch.int32, (1,)),
    ("mha_query_lengths", torch.int32, ("R",)),
    ("mha_cu_query_seq_lengths", torch.int32, ("R+1",)),
    ("mha_kv_seq_lengths", torch.int32, ("R",)),
    ("mha_cu_kv_seq_lengths", torch.int32, ("R+1",)),
    ("mha_block_table", torch.int32, ("R", "B")),
]
_MAMBA_FIELDS = [
    ("mamba_batch_indices_decode", torch.int64, ("R",)),
    ("mamba_batch_indices_prefill", torch.int32, ("R",)),
    ("mamba_seq_idx", torch.int32, (1, "T")),
    ("mamba_cu_seqlens", torch.int32, ("R+1",)),
    ("mamba_cu_chunk_seqlens", torch.int32, ("C+1",)),
    ("mamba_last_chunk_indices", torch.int32, ("R",)),
    ("mamba_seq_idx_for_varlen", torch.int32, ("C",)),
    ("mamba_conv_seq_idx", torch.int32, ("T",)),
    ("mamba_conv_seq_start", torch.int32, ("T",)),
]


def _check_size(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return value


class ContextGPUView:
    """One ``uint8`` buffer on ``device`` and 0.19's typed views of it: the token fields
    (``[max_tokens]``: input ids, positions and block ids int64; the other three int32), the
    request fields (``[max_requests]`` int32, temperature and top-p float32), the real token
    count, the MHA metadata (query and KV lengths, their cumulative sums ``[max_requests + 1]``,
    the block table ``[max_requests, max_kv_blocks]``) and, with ``max_mamba_chunks > 0``, the
    Mamba metadata (8-byte aligned; else each Mamba field is None)."""

    def __init__(self, max_requests: int, max_tokens: int, max_kv_blocks: int,
                 device: torch.device, max_mamba_chunks: int = 0):
        sizes = dict(R=_check_size("max_requests", max_requests, 1),
                     T=_check_size("max_tokens", max_tokens, 1),
                     B=_check_size("max_kv_blocks", max_kv_blocks, 1),
                     C=_check_size("max_mamba_chunks", max_mamba_chunks, 0))
        sizes["R+1"], sizes["C+1"] = sizes["R"] + 1, sizes["C"] + 1
        layout: List[Tuple[str, torch.dtype, tuple, int]] = []
        offset = 0
        for name, dtype, shape in _TOKEN_FIELDS + _REQUEST_FIELDS:
            dims = tuple(sizes.get(dim, dim) for dim in shape)
            layout.append((name, dtype, dims, offset))
            offset += _nbytes(dtype, dims)
        mamba = max_mamba_chunks > 0
        if mamba:
            offset += (8 - offset % 8) % 8
            for name, dtype, shape in _MAMBA_FIELDS:
                dims = tuple(sizes.get(dim, dim) for dim in shape)
                layout.append((name, dtype, dims, offset))
                offset += _nbytes(dtype, dims)
        self._buf = torch.zeros(offset, dtype=torch.uint8, device=device)
        for name, dtype, dims, start in layout:
            view = self._buf[start:start + _nbytes(dtype, dims)].view(dtype).view(dims)
            setattr(self, name, view)
        if not mamba:
            for name, _, _ in _MAMBA_FIELDS:
                setattr(self, name, None)


def _nbytes(dtype: torch.dtype, dims: tuple) -> int:
    count = 1
    for dim in dims:
        count *= dim
    return count * torch.empty((), dtype=dtype).element_size()


class ContextStepView:
    """``ctx.gpu_view``: 0.19's names for the context's own device tensors of the step (the
    token arrays, all int64 here; the per-request fields and the attention metadata of the
    last step), read through the context's parts at each access."""

    _TOKENS = ("token_to_input_ids", "token_to_pos_ids", "token_to_block_idx",
               "token_to_local_position_within_kv_block", "token_to_request_idx",
               "token_to_position_in_request")

    def __init__(self, device_state: Any):
        self._device_state = device_state

    def __getattr__(self, name: str) -> Any:
        if name in ContextStepView._TOKENS:
            device = self.__dict__["_device_state"]
            device.check_allocated()
            return getattr(device, name)
        raise AttributeError(f"ctx.gpu_view has no {name!r}: dynctx keeps the token arrays "
                             "here; the rest of 0.19's ContextGPUView is not mirrored "
                             "(docs/SEMANTICS.md §16 row 54)")
