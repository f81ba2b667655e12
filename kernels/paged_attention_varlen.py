"""Paged attention of prefill, chunked-prefill and mixed steps: causal, in tiles of queries.

A program takes ``BLOCK_M`` rows, that is ``BLOCK_M // G`` query tokens of one request times the
``G`` query heads of one KV head (each K/V tile loaded once for the group), and walks the
request's keys up to its tile's last position. Query ``j`` of a request with ``q`` queries and
``kv`` cached tokens sits at position ``kv - q + j`` (a chunk may start mid-sequence). The
launcher is ``paged_attention`` (``paged_attention.py``): the requests after the leading decode
ones run here, through ``launch_varlen``.
"""

from __future__ import annotations

import torch

from . import autotune
from ._common import check_grid, next_pow2
from .autotune import KernelConfig, bucket_tokens, dtype_name
from .backend import HAS_TRITON
from .launch_plan import KernelLaunch, tensor_arguments
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

    from .paged_attention_tile import _attend_key_tile, _fold_sinks


if HAS_TRITON:

    @triton.jit(do_not_specialize=["first_request", "window", "num_sinks"])
    def _paged_attention_varlen_kernel(
        out_ptr,
        query_ptr, key_cache_ptr, value_cache_ptr,
        cu_query_lengths_ptr, kv_seq_lengths_ptr, block_table_ptr, sinks_ptr,
        key_scale_ptr, value_scale_ptr, stride_key_scale, stride_value_scale,
        first_request, group_size, head_dim, block_size, softmax_scale, window, num_sinks,
        stride_out_token, stride_out_head,
        stride_query_token, stride_query_head,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_table_row, stride_sinks,
        BLOCK_M: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
        KV_SCALED: tl.constexpr,
    ):
        """TILE_TOKENS query tokens of request ``first_request + program_id(0)`` x the G query
        heads of one KV head, causal, within the last ``window`` keys of each row's position
        (0: all), with each head's sink logit in the denominator (heads ``< num_sinks``).

        BLOCK_M (the config's row count) sets TILE_TOKENS = max(1, BLOCK_M // BLOCK_G) on the
        host."""
        request = first_request + tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(2).to(tl.int64)
        q_start = tl.load(cu_query_lengths_ptr + request).to(tl.int64)
        q_len = tl.load(cu_query_lengths_ptr + request + 1).to(tl.int64) - q_start
        if tile * TILE_TOKENS < q_len:
            kv_len = tl.load(kv_seq_lengths_ptr + request).to(tl.int64)
            # Row r of the tile is query token tile * TILE_TOKENS + r // BLOCK_G, head r % BLOCK_G.
            offs_r = tl.arange(0, TILE_TOKENS * BLOCK_G)
            offs_q = tile * TILE_TOKENS + offs_r // BLOCK_G
            offs_g = offs_r % BLOCK_G
            offs_d = tl.arange(0, BLOCK_D)
            offs_n = tl.arange(0, BLOCK_N)
            mask_r = (offs_q < q_len) & (offs_g < group_size)
            mask_d = offs_d < head_dim
            heads = kv_head * group_size + offs_g
            q = tl.load(query_ptr + (q_start + offs_q)[:, None] * stride_query_token
                        + heads[:, None] * stride_query_head + offs_d[None, :],
                        mask=mask_r[:, None] & mask_d[None, :], other=0.0)  # [rows, BLOCK_D]
            # Causal: a row sees the keys up to its own position, and with a window only those
            # after row_floor; every row sees its own key.
            row_position = kv_len - q_len + offs_q                             # [rows]
            row_floor = tl.where(window > 0, row_position - window, -1)
            last_key = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * TILE_TOKENS)
            # Keys before the tile's first row's window are no row's: the walk skips them.
            first_key = tl.where(window > 0,
                                 tl.maximum(kv_len - q_len + tile * TILE_TOKENS - window + 1, 0),
                                 0)

            if KV_SCALED:
                # FP8 K/V: the K scale folds into the softmax scale, the V scale into the output.
                softmax_scale = softmax_scale * tl.load(key_scale_ptr
                                                        + kv_head * stride_key_scale)
                value_scale = tl.load(value_scale_ptr + kv_head * stride_value_scale)
            else:
                value_scale = 1.0
            running_max = tl.full((TILE_TOKENS * BLOCK_G,), float("-inf"), tl.float32)
            running_sum = tl.zeros((TILE_TOKENS * BLOCK_G,), tl.float32)
            acc = tl.zeros((TILE_TOKENS * BLOCK_G, BLOCK_D), tl.float32)
            table_row = block_table_ptr + request * stride_table_row
            # (A while loop: Triton 3.6's interpreter cannot take runtime bounds in range().)
            start = first_key + last_key * 0
            while start < last_key:
                positions = start + offs_n
                mask_n = positions < last_key
                allowed = mask_n[None, :] & (positions[None, :] <= row_position[:, None]) \
                    & (positions[None, :] > row_floor[:, None])
                acc, running_max, running_sum = _attend_key_tile(
                    q, acc, running_max, running_sum, positions, mask_n, allowed,
                    table_row, key_cache_ptr, value_cache_ptr, kv_head, block_size,
                    softmax_scale, stride_kc_block, stride_kc_slot, stride_kc_head,
                    stride_vc_block, stride_vc_slot, stride_vc_head, offs_d, mask_d, IEEE_DOT)
                start += BLOCK_N
            acc, running_max, running_sum = _fold_sinks(acc, running_max, running_sum, sinks_ptr,
                                                        heads, num_sinks, stride_sinks)
            result = acc * (value_scale / tl.where(running_sum > 0, running_sum, 1.0))[:, None]
            tl.store(out_ptr + (q_start + offs_q)[:, None] * stride_out_token
                     + heads[:, None] * stride_out_head + offs_d[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


def launch_varlen(*, query, key_cache, value_cache, out, scale, window, sinks, config,
                  cu_query_lengths, kv_seq_lengths, block_table, first_request, num_requests,
                  max_seqlen_q, key_scale=None, value_scale=None, roles=None) -> KernelLaunch:
    """Causal attention of every query token of requests ``[first_request, first_request +
    num_requests)``, in tiles of query tokens. ``paged_attention`` checked every argument.
    Returns the launch, for a plan (its pointers named by ``roles`` when given)."""
    num_tokens, num_q_heads, head_dim = query.shape
    if config is None:
        key = paged_attention_varlen_tune_key(num_q_heads=num_q_heads,
                                              num_kv_heads=key_cache.shape[2], head_dim=head_dim,
                                              dtype=query.dtype, num_tokens=num_tokens,
                                              window=window, kv_dtype=key_cache.dtype)
        config, _ = autotune.resolve_config("paged_attention_varlen", key, query.device)
    args = kernel_args(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                       block_table, scale, window, key_scale, value_scale)
    block_g = next_pow2(args["group_size"])
    tile_tokens = max(1, config.kwargs["BLOCK_M"] // block_g)
    grid = (num_requests, triton.cdiv(max_seqlen_q, tile_tokens), key_cache.shape[2])
    check_grid("paged_attention varlen", grid,
               f"max_seqlen_q={max_seqlen_q} in tiles of {tile_tokens} tokens")
    kwargs = dict(out_ptr=out, first_request=first_request, **args, **sink_args(query, sinks),
                  stride_out_token=out.stride(0), stride_out_head=out.stride(1),
                  TILE_TOKENS=tile_tokens, BLOCK_G=block_g, **config.launch_kwargs())
    return KernelLaunch(_paged_attention_varlen_kernel, grid, kwargs, tensor_arguments(kwargs),
                        roles)


# Query tokens and key tokens per tile, warps and stages of the search space.
_VARLEN_BLOCK_M = (32, 64, 128)
_VARLEN_BLOCK_N = (32, 64)
_VARLEN_WARPS = (4, 8)
# Triton 3.9 does not multi-buffer these gathered K/V loads (sm_90 builds show the same shared
# memory at every num_stages), so two stage counts suffice.
_VARLEN_STAGES = (1, 2)


def paged_attention_varlen_configs(key: dict) -> list[KernelConfig]:
    # 128 rows at 4 warps spill on sm_90 (tests/kernels/test_sm90_build.py), and so do 32 rows
    # x 64 keys at 4 warps reading an FP8 cache (its conversions need the registers).
    fp8 = "kv_dtype" in key
    return [KernelConfig.make(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for m in _VARLEN_BLOCK_M for n in _VARLEN_BLOCK_N for w in _VARLEN_WARPS
            for s in _VARLEN_STAGES if m <= 16 * w and not (fp8 and (m, n, w) == (32, 64, 4))]


def paged_attention_varlen_default_config(key: dict) -> KernelConfig:
    # FlashAttention-2's forward tile: 128 rows x 64 keys, 8 warps, up to head dim 128.
    if key["head_dim"] <= 128:
        return KernelConfig.make(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return KernelConfig.make(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)


def paged_attention_varlen_tune_key(*, num_q_heads: int, num_kv_heads: int, head_dim: int,
                                    dtype: torch.dtype, num_tokens: int, window: int = 0,
                                    kv_dtype=None) -> dict:
    """A sliding window (exact, like a model dimension; 0: none) bounds the keys of a query
    tile, and with them which tile shape wins; sinks add one term per row and are not in it.
    ``kv_dtype``, the cache's, only where it differs from the query's (an FP8 cache)."""
    return with_kv_dtype({"num_q_heads": int(num_q_heads), "num_kv_heads": int(num_kv_heads),
                          "head_dim": int(head_dim), "dtype": dtype_name(dtype),
                          "num_tokens": bucket_tokens(num_tokens), "window": int(window)},
                         kv_dtype)


# A window shorter than the presets' prompts of 512 tokens (gpt-oss's is 128).
_PRESET_WINDOW = 128


def paged_attention_varlen_presets() -> list[dict]:
    return [paged_attention_varlen_tune_key(**LLAMA_HEADS, dtype=torch.bfloat16, num_tokens=n,
                                            window=window, kv_dtype=kv_dtype)
            for kv_dtype in (None, torch.float8_e4m3fn)
            for n, window in ((512, 0), (2048, 0), (8192, 0), (8192, _PRESET_WINDOW))]
