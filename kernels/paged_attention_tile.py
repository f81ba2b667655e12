"""The step both paged-attention kernels take for every tile of keys, and what they share.

``_attend_key_tile`` gathers one tile of keys and values of a request through its block-table
row and folds it into an online softmax. The decode kernel (``paged_attention_decode.py``) and
the varlen kernel (``paged_attention_varlen.py``) differ only in which rows they hold and which
keys each row may see (``allowed``, where a sliding window narrows it); a change to what a key
contributes (dequantised FP8 blocks) belongs here, once for both. ``_fold_sinks`` adds each
row's sink logit to its softmax denominator (the varlen kernel; the decode splits' merge folds
it the same way).
"""

from __future__ import annotations

import torch

from ._common import next_pow2
from ._shapes import LLAMA_3_8B
from .autotune import dtype_name
from .backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

MAX_HEAD_DIM = 256
MAX_GROUP = 64


if HAS_TRITON:

    @triton.jit
    def _attend_key_tile(
        q, acc, running_max, running_sum, positions, mask_n, allowed,
        table_row, key_cache_ptr, value_cache_ptr, kv_head, block_size, softmax_scale,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head, offs_d, mask_d,
        IEEE_DOT: tl.constexpr,
    ):
        """One tile of keys ``positions`` (``mask_n``: inside the walk) through the block
        table row, folded into the online softmax of the rows of ``q`` (``allowed``: which
        row sees which key). Returns ``(acc, running_max, running_sum)``."""
        blocks = tl.load(table_row + positions // block_size, mask=mask_n, other=0).to(tl.int64)
        slots = positions % block_size
        mask_kv = mask_n[:, None] & mask_d[None, :]
        # An FP8 cache is read in the query's dtype (exact); its scales are applied outside.
        k = tl.load(key_cache_ptr + blocks[:, None] * stride_kc_block
                    + slots[:, None] * stride_kc_slot + kv_head * stride_kc_head
                    + offs_d[None, :], mask=mask_kv, other=0.0).to(q.dtype)     # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + blocks[:, None] * stride_vc_block
                    + slots[:, None] * stride_vc_slot + kv_head * stride_vc_head
                    + offs_d[None, :], mask=mask_kv, other=0.0).to(q.dtype)
        if IEEE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(allowed, scores * softmax_scale, float("-inf"))     # [rows, BLOCK_N]
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row may see no key yet (a sliding window starts past this tile): shift by 0 there,
        # so its sum and accumulator stay 0 instead of exp(-inf - -inf) = NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp(running_max - shift)
        probs = tl.exp(scores - shift[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        if IEEE_DOT:
            update = tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        else:
            update = tl.dot(probs.to(v.dtype), v)
        return acc * correction[:, None] + update, new_max, running_sum

    @triton.jit
    def _fold_sinks(acc, running_max, running_sum, sinks_ptr, heads, num_sinks, stride_sinks):
        """Fold each row's sink logit (``sinks[heads]``, fp32; ``-inf`` for heads at or past
        ``num_sinks``, so ``num_sinks = 0`` adds nothing) into its softmax denominator: the
        sink takes probability mass and gives no value. Returns ``(acc, running_max,
        running_sum)``."""
        sink = tl.load(sinks_ptr + heads * stride_sinks, mask=heads < num_sinks,
                       other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, sink)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp(running_max - shift)
        running_sum = running_sum * correction + tl.exp(sink - shift)
        return acc * correction[:, None], new_max, running_sum


def kernel_args(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths, block_table,
                scale, window, key_scale=None, value_scale=None) -> dict:
    """The arguments both kernels take, named as in their signatures (``window``: keys a query
    sees, its own included; 0 for all). An FP8 cache comes with fp32 ``[Hkv]`` ``key_scale``
    (folded into the softmax scale) and ``value_scale`` (into the output); without them the
    kernels read no scale (any pointer stands in)."""
    num_q_heads, head_dim = query.shape[1:]
    scaled = key_scale is not None
    return dict(key_scale_ptr=key_scale if scaled else query,
                value_scale_ptr=value_scale if scaled else query,
                stride_key_scale=key_scale.stride(0) if scaled else 0,
                stride_value_scale=value_scale.stride(0) if scaled else 0, KV_SCALED=scaled,
                query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
                cu_query_lengths_ptr=cu_query_lengths, kv_seq_lengths_ptr=kv_seq_lengths,
                block_table_ptr=block_table, group_size=num_q_heads // key_cache.shape[2],
                head_dim=head_dim, block_size=key_cache.shape[1], softmax_scale=scale,
                window=window,
                stride_query_token=query.stride(0), stride_query_head=query.stride(1),
                stride_kc_block=key_cache.stride(0), stride_kc_slot=key_cache.stride(1),
                stride_kc_head=key_cache.stride(2), stride_vc_block=value_cache.stride(0),
                stride_vc_slot=value_cache.stride(1), stride_vc_head=value_cache.stride(2),
                stride_table_row=block_table.stride(0),
                # tl.dot wants a reduction dim of at least 16; fp32 products stay IEEE.
                BLOCK_D=max(16, next_pow2(head_dim)), IEEE_DOT=query.dtype == torch.float32)


def sink_args(query, sinks) -> dict:
    """The sink arguments of the kernels that fold them (varlen, merge): ``sinks`` ``[Hq]``, or
    None (then no head has a sink: ``num_sinks = 0``, and ``query`` stands in for the pointer,
    never read)."""
    if sinks is None:
        return dict(sinks_ptr=query, num_sinks=0, stride_sinks=0)
    return dict(sinks_ptr=sinks, num_sinks=sinks.shape[0], stride_sinks=sinks.stride(0))


def with_kv_dtype(key: dict, kv_dtype) -> dict:
    """``key`` with the cache's dtype as ``kv_dtype`` where it differs from the query's ``dtype``
    (an FP8 cache); the keys of a cache in the query's dtype stay as they were."""
    if kv_dtype is not None:
        name = kv_dtype if isinstance(kv_dtype, str) else dtype_name(kv_dtype)
        if name != key["dtype"]:
            key["kv_dtype"] = name
    return key


# What both tunings share: the tolerance a candidate config is checked to, the preset heads
# and the interpreter's scaled-down key.
# fp32 is exact to rounding; fp16/bf16 products round p to the cache dtype before P @ V.
ATTENTION_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5),
                       torch.float16: dict(atol=4e-3, rtol=4e-3),
                       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# The heads both tunings' presets use: Llama-3-8B's attention (kernels/_shapes.py).
LLAMA_HEADS = dict(num_q_heads=LLAMA_3_8B["num_attention_heads"],
                   num_kv_heads=LLAMA_3_8B["num_key_value_heads"], head_dim=LLAMA_3_8B["head_dim"])


def scaled_down_key(key: dict) -> dict:
    """A committed key made small enough for the interpreter: at most 2 requests (or 64
    tokens), 300 keys, 2 KV heads (the query heads per KV head kept), head dim 32, and fp16 for
    bf16 (the interpreter has no bf16 arithmetic). The search spaces depend on none of these."""
    group = key["num_q_heads"] // key["num_kv_heads"]
    small = {**key, "num_q_heads": 2 * group, "num_kv_heads": 2,
             "head_dim": min(key["head_dim"], 32)}
    # (An FP8 "kv_dtype" stays: the interpreter reads fp8 exactly.)
    if small["dtype"] == "bfloat16":
        small["dtype"] = "float16"
    if "num_requests" in small:
        small["num_requests"] = min(small["num_requests"], 2)
        small["max_seqlen_k"] = min(small["max_seqlen_k"], 300)
    if "num_tokens" in small:
        small["num_tokens"] = min(small["num_tokens"], 64)
    return small
