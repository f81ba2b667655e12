"""Paged attention of decode requests (at most one query each): flash-decoding over splits.

A program takes one request, one KV head and one split of ``SPLIT_TOKENS`` cached tokens, walks
it in tiles of ``BLOCK_N`` keys through the block table, and keeps an online softmax for all
the query heads of that KV head at once (each K/V tile is loaded once for the whole group). It
writes an fp32 partial output and log-sum-exp per split; ``paged_attention_merge.py`` merges
the splits. The launcher is ``paged_attention`` (``paged_attention.py``), which runs the leading
decode requests of a step through ``launch_decode``.
"""

from __future__ import annotations

import math

import torch

from . import autotune
from ._common import check_grid, next_pow2
from .autotune import KernelConfig, bucket_tokens, dtype_name
from .backend import HAS_TRITON
from .launch_plan import KernelLaunch, tensor_arguments
from .paged_attention_merge import merge_splits_launch
from .paged_attention_tile import (  # noqa: F401
    LLAMA_HEADS,
    kernel_args,
    scaled_down_key,
    sink_args,
    with_kv_dtype,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .paged_attention_tile import _attend_key_tile


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_splits", "lse_offset", "window"])
    def _paged_attention_decode_kernel(
        partial_out_ptr, partial_lse_ptr,
        query_ptr, key_cache_ptr, value_cache_ptr,
        cu_query_lengths_ptr, kv_seq_lengths_ptr, block_table_ptr,
        key_scale_ptr, value_scale_ptr, stride_key_scale, stride_value_scale,
        num_splits, lse_offset, group_size, head_dim, block_size, softmax_scale, window,
        stride_query_token, stride_query_head,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_table_row,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_TOKENS: tl.constexpr, IEEE_DOT: tl.constexpr, KV_SCALED: tl.constexpr,
    ):
        """One (request, KV head, split): online softmax of the group's queries over the split's
        keys (of the last ``window`` keys; 0: all). ``partial_out`` is contiguous
        ``[requests, heads, num_splits, head_dim]``, ``partial_lse + lse_offset`` contiguous
        ``[requests, heads, num_splits]`` (the launcher passes one buffer for both)."""
        request = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2).to(tl.int64)
        num_heads = tl.num_programs(1).to(tl.int64) * group_size
        q_start = tl.load(cu_query_lengths_ptr + request).to(tl.int64)
        q_len = tl.load(cu_query_lengths_ptr + request + 1).to(tl.int64) - q_start
        kv_len = tl.load(kv_seq_lengths_ptr + request).to(tl.int64)
        # A request without a query has no output: its keys are not walked.
        kv_len = tl.where(q_len > 0, kv_len, 0)
        # The splits cover the keys the query sees: from the window's first one on, so keys
        # outside the window cost nothing (and the launcher sizes the grid to the window).
        first_key = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
        split_start = first_key + split * SPLIT_TOKENS
        split_end = tl.minimum(split_start + SPLIT_TOKENS, kv_len)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_g = offs_g < group_size
        mask_d = offs_d < head_dim
        heads = kv_head * group_size + offs_g                                   # [BLOCK_G]
        # A padded request's first token may lie past the queries: load nothing for it.
        # (tl.where, not `&`: a scalar & vector mask loses its bool dtype under the interpreter.)
        mask_q = tl.where(q_len > 0, mask_g, False)
        q = tl.load(query_ptr + q_start * stride_query_token + heads[:, None] * stride_query_head
                    + offs_d[None, :], mask=mask_q[:, None] & mask_d[None, :], other=0.0)

        if KV_SCALED:
            # FP8 K/V: the K scale folds into the softmax scale, the V scale into the output.
            softmax_scale = softmax_scale * tl.load(key_scale_ptr + kv_head * stride_key_scale)
            value_scale = tl.load(value_scale_ptr + kv_head * stride_value_scale)
        else:
            value_scale = 1.0
        running_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        table_row = block_table_ptr + request * stride_table_row
        # Every tile holds at least one key < kv_len, so running_max is finite after the first.
        # (A while loop: Triton 3.6's interpreter cannot take runtime bounds in range().)
        start = split_start
        while start < split_end:
            positions = start + offs_n
            mask_n = positions < split_end
            acc, running_max, running_sum = _attend_key_tile(
                q, acc, running_max, running_sum, positions, mask_n, mask_n[None, :],
                table_row, key_cache_ptr, value_cache_ptr, kv_head, block_size, softmax_scale,
                stride_kc_block, stride_kc_slot, stride_kc_head,
                stride_vc_block, stride_vc_slot, stride_vc_head, offs_d, mask_d, IEEE_DOT)
            start += BLOCK_N

        # An empty split (past kv_len) leaves lse = -inf and a zero output: weight 0 in the merge.
        has_keys = split_start < split_end
        safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
        lse = tl.where(has_keys, running_max + tl.log(safe_sum), float("-inf"))
        rows = (request * num_heads + heads) * num_splits + split               # [BLOCK_G]
        tl.store(partial_out_ptr + rows[:, None] * head_dim + offs_d[None, :],
                 acc * (value_scale / safe_sum)[:, None], mask=mask_g[:, None] & mask_d[None, :])
        tl.store(partial_lse_ptr + lse_offset + rows, lse, mask=mask_g)


def walked_keys(max_seqlen_k: int, window: int) -> int:
    """The keys a query walks at most: a window bounds them (the grid and the tuning key take
    that bound)."""
    return min(max_seqlen_k, window) if window else max_seqlen_k


def decode_workspace(num_requests: int, num_q_heads: int, head_dim: int,
                     num_splits: int) -> tuple[int, int]:
    """``(lse_offset, size)`` of the fp32 workspace between the decode kernel and the merge:
    the partial outputs ``[requests, Hq, splits, D]``, then their log-sum-exps."""
    lse_offset = num_requests * num_q_heads * num_splits * head_dim
    return lse_offset, lse_offset + num_requests * num_q_heads * num_splits


def launch_decode(*, query, key_cache, value_cache, out, scale, window, sinks, config,
                  cu_query_lengths, kv_seq_lengths, block_table, num_requests,
                  max_seqlen_k, key_scale=None, value_scale=None, roles=None):
    """Split-KV decode of the first ``num_requests`` requests (at most one query each), then
    the merge of the splits into ``out`` (which folds the sinks in). ``paged_attention``
    checked every argument. Returns ``(decode, merge, workspace)``, the two ``KernelLaunch``
    of a plan (their pointers named by ``roles``, plus ``workspace``) and the size of the fp32
    buffer between them: the partial outputs ``[requests, Hq, splits, D]``, then their
    log-sum-exps ``[requests, Hq, splits]``, one allocation."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    walked = walked_keys(max_seqlen_k, window)
    if config is None:
        key = paged_attention_decode_tune_key(
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=query.dtype, num_requests=num_requests, max_seqlen_k=walked,
            kv_dtype=key_cache.dtype)
        config, _ = autotune.resolve_config("paged_attention_decode", key, query.device)
    args = kernel_args(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                       block_table, scale, window, key_scale, value_scale)
    num_splits = triton.cdiv(walked, config.kwargs["SPLIT_TOKENS"])
    grid = (num_requests, num_kv_heads, num_splits)
    check_grid("paged_attention decode", grid,
               f"max_seqlen_k={max_seqlen_k} (window {window}) in splits of "
               f"{config.kwargs['SPLIT_TOKENS']}")
    lse_offset, size = decode_workspace(num_requests, num_q_heads, head_dim, num_splits)
    workspace = torch.empty(size, dtype=torch.float32, device=query.device)
    roles = {**(roles or {}), "workspace": workspace}
    # tl.dot wants at least 16 rows: the group's query heads, padded.
    kwargs = dict(partial_out_ptr=workspace, partial_lse_ptr=workspace, num_splits=num_splits,
                  lse_offset=lse_offset, **args, BLOCK_G=max(16, next_pow2(args["group_size"])),
                  **config.launch_kwargs())
    decode = KernelLaunch(_paged_attention_decode_kernel, grid, kwargs, tensor_arguments(kwargs),
                          roles)
    merge = merge_splits_launch(out, workspace, workspace, cu_query_lengths,
                                shape=(num_requests, num_q_heads, num_splits, head_dim),
                                lse_offset=lse_offset, block_d=args["BLOCK_D"], sinks=sinks,
                                roles=roles)
    return decode, merge, size


# Tile width, tokens per split and warps of the search space.
_DECODE_BLOCK_N = (32, 64, 128)
_DECODE_SPLIT_TOKENS = (128, 256, 512, 1024, 2048)
_DECODE_WARPS = (2, 4, 8)
# Programs wanted in flight per launch before splitting a request's keys further (H200: 132 SMs).
_DECODE_TARGET_PROGRAMS = 264


def paged_attention_decode_configs(key: dict) -> list[KernelConfig]:
    # Tiles of 128 keys at 2 warps spill on sm_90 (tests/kernels/test_sm90_build.py), and so
    # does every 2-warp config reading an FP8 cache (its conversions need the registers).
    warps = _DECODE_WARPS if "kv_dtype" not in key else tuple(w for w in _DECODE_WARPS if w > 2)
    return [KernelConfig.make(BLOCK_N=n, SPLIT_TOKENS=s, num_warps=w)
            for n in _DECODE_BLOCK_N for s in _DECODE_SPLIT_TOKENS if s >= n
            for w in warps if n <= 32 * w]


def paged_attention_decode_default_config(key: dict) -> KernelConfig:
    programs = key["num_requests"] * key["num_kv_heads"]
    splits_wanted = max(1, _DECODE_TARGET_PROGRAMS // max(1, programs))
    split = _DECODE_SPLIT_TOKENS[-1]
    for candidate in _DECODE_SPLIT_TOKENS:
        if math.ceil(key["max_seqlen_k"] / candidate) <= splits_wanted:
            split = candidate
            break
    block_n = 64 if key["head_dim"] <= 128 else 32
    return KernelConfig.make(BLOCK_N=block_n, SPLIT_TOKENS=split, num_warps=4)


def paged_attention_decode_tune_key(*, num_q_heads: int, num_kv_heads: int, head_dim: int,
                                    dtype: torch.dtype, num_requests: int, max_seqlen_k: int,
                                    kv_dtype=None) -> dict:
    """``max_seqlen_k``: the keys a query walks, so a window ``W`` keys at ``min(kv, W)``
    (the decode kernel walks a window exactly as it walks that many keys; sinks add one term
    in the merge and are not in the key). ``kv_dtype``, the cache's, only where it differs
    from the query's (an FP8 cache)."""
    return with_kv_dtype({"num_q_heads": int(num_q_heads), "num_kv_heads": int(num_kv_heads),
                          "head_dim": int(head_dim), "dtype": dtype_name(dtype),
                          "num_requests": bucket_tokens(num_requests),
                          "max_seqlen_k": bucket_tokens(max_seqlen_k)}, kv_dtype)


def paged_attention_decode_presets() -> list[dict]:
    return [paged_attention_decode_tune_key(**LLAMA_HEADS, dtype=torch.bfloat16, num_requests=r,
                                            max_seqlen_k=k, kv_dtype=kv_dtype)
            for kv_dtype in (None, torch.float8_e4m3fn)
            for r in (1, 8, 64, 256) for k in (1024, 4096, 16384)]
