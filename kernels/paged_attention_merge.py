"""Merge of split-KV attention: each request's partial outputs weighted by their softmax mass.

The decode kernel (``paged_attention_decode.py``) writes, per (request, query head, split), the
split's normalised output ``o_s`` and its log-sum-exp ``lse_s`` (``-inf`` for a split without
keys). The merge writes ``out = sum_s w_s o_s`` with ``w_s = exp(lse_s - m) / sum exp(lse - m)``,
``m = max lse``. A program walks the splits in chunks of ``BLOCK_S`` (at most 256, and at most
8K values of a chunk in registers), keeping the running maximum, the running sum of weights
and the weighted accumulator across chunks (the log-sum-exp merge of flash-decoding), so that
any number of splits merges without spilling.
"""

from __future__ import annotations

import torch

from .backend import HAS_TRITON
from .launch_plan import KernelLaunch, tensor_arguments
from .paged_attention_tile import sink_args

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_MERGE_CHUNK = 256
# Values of one chunk held per program: BLOCK_S x BLOCK_D fp32 over 4 warps.
_CHUNK_VALUES = 8192


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_splits", "lse_offset", "num_sinks"])
    def _merge_attention_splits_kernel(
        out_ptr,
        partial_out_ptr, partial_lse_ptr,
        cu_query_lengths_ptr, sinks_ptr,
        num_splits, lse_offset, head_dim, num_sinks,
        stride_out_token, stride_out_head, stride_sinks,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One (request, head): ``out[token] = sum_s w_s partial[s]`` over chunks of splits,
        the head's sink logit (heads ``< num_sinks``) one more weight, of no value.

        ``partial_out`` is ``[requests, heads, num_splits, head_dim]`` and ``partial_lse +
        lse_offset`` ``[requests, heads, num_splits]``, both contiguous fp32 (the launcher
        allocates them, as one buffer)."""
        request = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        num_heads = tl.num_programs(1).to(tl.int64)
        q_start = tl.load(cu_query_lengths_ptr + request).to(tl.int64)
        q_len = tl.load(cu_query_lengths_ptr + request + 1).to(tl.int64) - q_start
        if q_len > 0:
            row = request * num_heads + head
            lse_row = partial_lse_ptr + lse_offset + row * num_splits
            partial_row = partial_out_ptr + row * num_splits * head_dim
            offs_s = tl.arange(0, BLOCK_S)
            offs_d = tl.arange(0, BLOCK_D)
            mask_d = offs_d < head_dim
            running_max = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), axis=0)
            running_sum = tl.sum(tl.zeros((BLOCK_S,), tl.float32), axis=0)
            acc = tl.zeros((BLOCK_D,), tl.float32)
            # (A while loop: Triton 3.6's interpreter cannot take runtime bounds in range().)
            start = 0
            while start < num_splits:
                splits = start + offs_s
                mask_s = splits < num_splits
                lse = tl.load(lse_row + splits, mask=mask_s, other=float("-inf"))  # [BLOCK_S]
                new_max = tl.maximum(running_max, tl.max(lse, axis=0))
                # While every split so far is empty the maximum is -inf: weigh against 0.
                shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                correction = tl.exp(running_max - shift)
                weights = tl.exp(lse - shift)
                partial = tl.load(partial_row + splits[:, None] * head_dim + offs_d[None, :],
                                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)
                running_sum = running_sum * correction + tl.sum(weights, axis=0)
                acc = acc * correction + tl.sum(partial * weights[:, None], axis=0)
                running_max = new_max
                start += BLOCK_S
            # The sink: one more term of the denominator (-inf, nothing, without one).
            sink = tl.load(sinks_ptr + head * stride_sinks, mask=head < num_sinks,
                           other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, sink)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            correction = tl.exp(running_max - shift)
            running_sum = running_sum * correction + tl.exp(sink - shift)
            acc = acc * correction
            result = acc / tl.where(running_sum > 0, running_sum, 1.0)
            tl.store(out_ptr + q_start * stride_out_token + head * stride_out_head + offs_d,
                     result.to(out_ptr.dtype.element_ty), mask=mask_d)


def merge_chunk(block_d: int) -> int:
    """Splits per chunk of the merge for a padded head dim: a power of two, 2 to 256."""
    return max(2, min(MAX_MERGE_CHUNK, _CHUNK_VALUES // block_d))


def merge_attention_splits(out: torch.Tensor, partial_out: torch.Tensor,
                           partial_lse: torch.Tensor, cu_query_lengths: torch.Tensor, *,
                           block_d: int, sinks: torch.Tensor | None = None) -> KernelLaunch:
    """Write ``out[cu_query_lengths[i]]`` for every request ``i`` with a query, in place.

    ``out``: ``[n, H, D]``, last dim contiguous; ``partial_out``: contiguous fp32
    ``[R, H, num_splits, D]``; ``partial_lse``: contiguous fp32 ``[R, H, num_splits]``;
    ``cu_query_lengths``: int32 ``[>= R + 1]``, at most one query per request. ``block_d`` is
    the padded head dim the decode kernel used; ``sinks``: ``[H]`` logits, or None. The caller
    checked everything; this launches only. Returns the launch."""
    return merge_splits_launch(out, partial_out, partial_lse, cu_query_lengths,
                               shape=tuple(partial_out.shape), lse_offset=0, block_d=block_d,
                               sinks=sinks)


def merge_splits_launch(out, partial_out, partial_lse, cu_query_lengths, *, shape, lse_offset,
                        block_d, sinks=None, roles=None) -> KernelLaunch:
    """``merge_attention_splits`` of partials of ``shape`` ``(R, H, num_splits, D)``, their
    log-sum-exps from element ``lse_offset`` of ``partial_lse`` on (``paged_attention`` passes
    one buffer for both), for a plan (its pointers named by ``roles``, role name -> tensor)."""
    num_requests, num_heads, num_splits, head_dim = shape
    kwargs = dict(
        out_ptr=out, partial_out_ptr=partial_out, partial_lse_ptr=partial_lse,
        cu_query_lengths_ptr=cu_query_lengths, num_splits=num_splits, lse_offset=lse_offset,
        head_dim=head_dim, stride_out_token=out.stride(0), stride_out_head=out.stride(1),
        **sink_args(out, sinks), BLOCK_S=merge_chunk(block_d), BLOCK_D=block_d)
    return KernelLaunch(_merge_attention_splits_kernel, (num_requests, num_heads), kwargs,
                        tensor_arguments(kwargs), roles)


def merge_attention_splits_ref(partial_out: torch.Tensor, partial_lse: torch.Tensor,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of the merge: ``[R, H, D]`` fp32 from ``[R, H, S, D]`` and ``[R, H, S]``
    (a row whose splits are all empty gives zeros); a head's sink is one more split of zero
    output and log-sum-exp ``sinks[h]``."""
    if sinks is not None:
        rows, heads, _, dim = partial_out.shape
        sink_lse = sinks.float().view(1, heads, 1).expand(rows, heads, 1)
        partial_lse = torch.cat((partial_lse.float(), sink_lse), dim=-1)
        partial_out = torch.cat((partial_out.float(), partial_out.new_zeros(rows, heads, 1, dim)
                                 .float()), dim=-2)
    finite = torch.isfinite(partial_lse).any(dim=-1, keepdim=True)
    weights = torch.where(finite, partial_lse, torch.zeros_like(partial_lse)).softmax(dim=-1)
    weights = torch.where(torch.isfinite(partial_lse), weights, torch.zeros_like(weights))
    return torch.einsum("rhs,rhsd->rhd", weights, partial_out.float())
