"""Causal GQA attention of a step's packed queries over a paged KV cache.

Two kernels behind one launcher, ``paged_attention``:

* **decode** (every request has at most one query): flash-decoding. A program takes one
  request, one KV head and one split of ``SPLIT_TOKENS`` cached tokens, walks it in tiles of
  ``BLOCK_N`` tokens through the block table, and keeps an online softmax for all the query
  heads of that KV head at once (each K/V tile is loaded once for the whole group). It writes
  an fp32 partial output and log-sum-exp per split; a second kernel merges the splits.
* **varlen** (prefill, chunked prefill, mixed steps): a program takes ``BLOCK_M`` rows, that
  is ``BLOCK_M // G`` query tokens of one request times the ``G`` query heads of one KV head
  (each K/V tile again loaded once for the group), and walks the request's keys up to its last
  token's position. In a mixed step the leading ``num_decode_requests`` (the context puts decode
  requests first) still take the decode kernel; the varlen kernel gets the rest. Query ``j`` of
  a request with ``q`` queries and ``kv`` cached tokens sits at position ``kv - q + j`` (a chunk
  may start mid-sequence).

Both read only the slots ``< kv_seq_lengths[i]`` of a request: block-table entries past them
(``-1`` or stale) are never dereferenced, and stale or NaN bytes in the cache never reach an
output. Scores, softmax and accumulation are fp32; the two matrix products take the cache dtype
(fp32 products are exact IEEE, never TF32). Rows of padding tokens (from
``cu_query_lengths[num_requests]`` on) are not written: zeros when the launcher allocates the
output, the caller's bytes when it passes ``out``.
"""

from __future__ import annotations

import math

import torch

from . import _autotune
from ._autotune import KernelConfig, KernelTuning, TuneCase, bucket_tokens, dtype_name
from ._backend import HAS_TRITON, resolve_backend
from ._common import FLOAT_DTYPES, check_same_device, custom_op, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

# fp32 is exact to rounding; fp16/bf16 products round p to the cache dtype before P @ V.
ATTENTION_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5),
                       torch.float16: dict(atol=4e-3, rtol=4e-3),
                       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
MAX_HEAD_DIM = 256
MAX_GROUP = 64

# Decode: tile width, tokens per split; varlen: query tokens and key tokens per tile.
_DECODE_BLOCK_N = (32, 64, 128)
_DECODE_SPLIT_TOKENS = (128, 256, 512, 1024, 2048)
_DECODE_WARPS = (2, 4, 8)
_VARLEN_BLOCK_M = (32, 64, 128)
_VARLEN_BLOCK_N = (32, 64)
_VARLEN_WARPS = (4, 8)
# Triton 3.9 does not multi-buffer these gathered K/V loads (sm_90 builds show the same shared
# memory at every num_stages), so two stage counts suffice.
_VARLEN_STAGES = (1, 2)
# Programs wanted in flight per launch before splitting a request's keys further (H200: 132 SMs).
_DECODE_TARGET_PROGRAMS = 264


def paged_attention_decode_configs(key: dict) -> list[KernelConfig]:
    return [KernelConfig.make(BLOCK_N=n, SPLIT_TOKENS=s, num_warps=w)
            for n in _DECODE_BLOCK_N for s in _DECODE_SPLIT_TOKENS if s >= n
            for w in _DECODE_WARPS]


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
                                    dtype: torch.dtype, num_requests: int, max_seqlen_k: int
                                    ) -> dict:
    return {"num_q_heads": int(num_q_heads), "num_kv_heads": int(num_kv_heads),
            "head_dim": int(head_dim), "dtype": dtype_name(dtype),
            "num_requests": bucket_tokens(num_requests),
            "max_seqlen_k": bucket_tokens(max_seqlen_k)}


def paged_attention_varlen_configs(key: dict) -> list[KernelConfig]:
    return [KernelConfig.make(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for m in _VARLEN_BLOCK_M for n in _VARLEN_BLOCK_N for w in _VARLEN_WARPS
            for s in _VARLEN_STAGES]


def paged_attention_varlen_default_config(key: dict) -> KernelConfig:
    # FlashAttention-2's forward tile: 128 rows x 64 keys, 8 warps, up to head dim 128.
    if key["head_dim"] <= 128:
        return KernelConfig.make(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return KernelConfig.make(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)


def paged_attention_varlen_tune_key(*, num_q_heads: int, num_kv_heads: int, head_dim: int,
                                    dtype: torch.dtype, num_tokens: int) -> dict:
    return {"num_q_heads": int(num_q_heads), "num_kv_heads": int(num_kv_heads),
            "head_dim": int(head_dim), "dtype": dtype_name(dtype),
            "num_tokens": bucket_tokens(num_tokens)}


def scaled_down_key(key: dict) -> dict:
    """A committed key made small enough for the interpreter: at most 2 requests (or 64
    tokens), 300 keys, 2 KV heads (the query heads per KV head kept), head dim 32, and fp16 for
    bf16 (the interpreter has no bf16 arithmetic). The search spaces depend on none of these."""
    group = key["num_q_heads"] // key["num_kv_heads"]
    small = {**key, "num_q_heads": 2 * group, "num_kv_heads": 2,
             "head_dim": min(key["head_dim"], 32)}
    if small["dtype"] == "bfloat16":
        small["dtype"] = "float16"
    if "num_requests" in small:
        small["num_requests"] = min(small["num_requests"], 2)
        small["max_seqlen_k"] = min(small["max_seqlen_k"], 300)
    if "num_tokens" in small:
        small["num_tokens"] = min(small["num_tokens"], 64)
    return small


class _AttentionCase(TuneCase):
    """Scratch paged cache for one key: ``decode`` requests of ``max_seqlen_k`` cached tokens
    and one query each, or ``varlen`` prompts of at most 512 tokens filling ``num_tokens``.
    Blocks of 256 tokens (Megatron's default), handed out in a shuffled order."""

    BLOCK_SIZE = 256

    def __init__(self, key: dict, device: torch.device, *, decode: bool):
        self.key = key
        dtype = getattr(torch, key["dtype"])
        # Drawn on the device: the largest preset caches hold gigabytes.
        gen = torch.Generator(device=device).manual_seed(0)
        if decode:
            q_lens = [1] * key["num_requests"]
            kv_lens = [key["max_seqlen_k"]] * key["num_requests"]
        else:
            per_request = min(512, key["num_tokens"])
            q_lens = [per_request] * max(1, key["num_tokens"] // per_request)
            kv_lens = list(q_lens)
        bs = self.BLOCK_SIZE
        blocks_per_request = [-(-kv // bs) for kv in kv_lens]
        num_blocks = sum(blocks_per_request) + 1
        heads, kv_heads, dim = key["num_q_heads"], key["num_kv_heads"], key["head_dim"]
        shape = (num_blocks, bs, kv_heads, dim)
        self.key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        self.value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0))
        table = torch.full((len(kv_lens), max(blocks_per_request)), -1, dtype=torch.int32)
        used = 0
        for request, count in enumerate(blocks_per_request):
            table[request, :count] = order[used:used + count].to(torch.int32)
            used += count
        self.block_table = table.to(device)
        self.kv_seq_lengths = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        self.cu_query_lengths = torch.tensor(cu, dtype=torch.int32, device=device)
        self.query = torch.randn(cu[-1], heads, dim, generator=gen, device=device, dtype=dtype)
        self.out = torch.empty_like(self.query)
        self._expected = None
        self.max_seqlen_q, self.max_seqlen_k = max(q_lens), max(kv_lens)
        item = self.query.element_size()
        self.bytes_moved = (2 * sum(kv_lens) * kv_heads * dim + 2 * cu[-1] * heads * dim) * item

    def _call(self, config, backend, out=None):
        return paged_attention(self.query, self.key_cache, self.value_cache,
                               self.cu_query_lengths, self.kv_seq_lengths, self.block_table,
                               max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                               out=out, config=config, backend=backend)

    def run(self, config: KernelConfig) -> None:
        self._call(config, "triton", self.out)

    def run_reference(self) -> None:
        self._call(None, "torch", self.out)

    def check(self, config: KernelConfig) -> None:
        self.out.fill_(float("nan"))
        got = self._call(config, "triton", self.out)
        if self._expected is None:
            # One reference per key, however many configs are checked against it.
            self._expected = self._call(None, "torch").float()
        torch.testing.assert_close(got.float(), self._expected,
                                   **ATTENTION_TOLERANCE[self.query.dtype],
                                   msg=lambda m: f"{config}: {m}")


def _decode_case(key: dict, device: torch.device) -> TuneCase:
    return _AttentionCase(key, device, decode=True)


def _varlen_case(key: dict, device: torch.device) -> TuneCase:
    return _AttentionCase(key, device, decode=False)


# Llama-3-8B's attention (bench/shapes.py LLAMA_3_8B): 32 query heads, 8 KV heads, head dim 128.
_LLAMA_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def _decode_presets() -> list[dict]:
    return [paged_attention_decode_tune_key(**_LLAMA_HEADS, dtype=torch.bfloat16, num_requests=r,
                                            max_seqlen_k=k)
            for r in (1, 8, 64, 256) for k in (1024, 4096, 16384)]


def _varlen_presets() -> list[dict]:
    return [paged_attention_varlen_tune_key(**_LLAMA_HEADS, dtype=torch.bfloat16, num_tokens=n)
            for n in (512, 2048, 8192)]


_autotune.register(KernelTuning(
    name="paged_attention_decode", configs=paged_attention_decode_configs,
    default_config=paged_attention_decode_default_config,
    tune_key=paged_attention_decode_tune_key, token_field="num_requests",
    make_case=_decode_case, presets=_decode_presets))
_autotune.register(KernelTuning(
    name="paged_attention_varlen", configs=paged_attention_varlen_configs,
    default_config=paged_attention_varlen_default_config,
    tune_key=paged_attention_varlen_tune_key, token_field="num_tokens",
    make_case=_varlen_case, presets=_varlen_presets))


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
        row sees which key). Returns ``(acc, running_max, running_sum)``; the decode and the
        varlen kernels share it."""
        blocks = tl.load(table_row + positions // block_size, mask=mask_n, other=0).to(tl.int64)
        slots = positions % block_size
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + blocks[:, None] * stride_kc_block
                    + slots[:, None] * stride_kc_slot + kv_head * stride_kc_head
                    + offs_d[None, :], mask=mask_kv, other=0.0)                 # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + blocks[:, None] * stride_vc_block
                    + slots[:, None] * stride_vc_slot + kv_head * stride_vc_head
                    + offs_d[None, :], mask=mask_kv, other=0.0)
        if IEEE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(allowed, scores * softmax_scale, float("-inf"))     # [rows, BLOCK_N]
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        if IEEE_DOT:
            update = tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        else:
            update = tl.dot(probs.to(v.dtype), v)
        return acc * correction[:, None] + update, new_max, running_sum

    @triton.jit
    def _paged_attention_decode_kernel(
        partial_out_ptr, partial_lse_ptr,
        query_ptr, key_cache_ptr, value_cache_ptr,
        cu_query_lengths_ptr, kv_seq_lengths_ptr, block_table_ptr,
        group_size, head_dim, block_size, softmax_scale,
        stride_query_token, stride_query_head,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_table_row,
        stride_partial_request, stride_partial_head, stride_partial_split,
        stride_lse_request, stride_lse_head,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT_TOKENS: tl.constexpr, IEEE_DOT: tl.constexpr,
    ):
        """One (request, KV head, split): online softmax of the group's queries over the split's
        keys."""
        request = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2).to(tl.int64)
        q_start = tl.load(cu_query_lengths_ptr + request).to(tl.int64)
        q_len = tl.load(cu_query_lengths_ptr + request + 1).to(tl.int64) - q_start
        kv_len = tl.load(kv_seq_lengths_ptr + request).to(tl.int64)
        # A request without a query has no output: its keys are not walked.
        kv_len = tl.where(q_len > 0, kv_len, 0)
        split_start = split * SPLIT_TOKENS
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

        running_max = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        table_row = block_table_ptr + request * stride_table_row
        # Every tile holds at least one key < kv_len, so running_max is finite after the first.
        for start in range(split_start, split_end, BLOCK_N):
            positions = start + offs_n
            mask_n = positions < split_end
            acc, running_max, running_sum = _attend_key_tile(
                q, acc, running_max, running_sum, positions, mask_n, mask_n[None, :],
                table_row, key_cache_ptr, value_cache_ptr, kv_head, block_size, softmax_scale,
                stride_kc_block, stride_kc_slot, stride_kc_head,
                stride_vc_block, stride_vc_slot, stride_vc_head, offs_d, mask_d, IEEE_DOT)

        # An empty split (past kv_len) leaves lse = -inf and a zero output: weight 0 in the merge.
        has_keys = split_start < split_end
        safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
        lse = tl.where(has_keys, running_max + tl.log(safe_sum), float("-inf"))
        partial = partial_out_ptr + request * stride_partial_request + split * stride_partial_split
        tl.store(partial + heads[:, None] * stride_partial_head + offs_d[None, :],
                 acc / safe_sum[:, None], mask=mask_g[:, None] & mask_d[None, :])
        tl.store(partial_lse_ptr + request * stride_lse_request + heads * stride_lse_head + split,
                 lse, mask=mask_g)

    @triton.jit
    def _paged_attention_merge_kernel(
        out_ptr,
        partial_out_ptr, partial_lse_ptr,
        cu_query_lengths_ptr,
        num_splits, head_dim,
        stride_out_token, stride_out_head,
        stride_partial_request, stride_partial_head, stride_partial_split,
        stride_lse_request, stride_lse_head,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """out[token of request, head] = the splits' partial outputs weighted by their softmax
        mass."""
        request = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        q_start = tl.load(cu_query_lengths_ptr + request).to(tl.int64)
        q_len = tl.load(cu_query_lengths_ptr + request + 1).to(tl.int64) - q_start
        if q_len > 0:
            offs_s = tl.arange(0, BLOCK_S)
            offs_d = tl.arange(0, BLOCK_D)
            mask_s = offs_s < num_splits
            mask_d = offs_d < head_dim
            lse = tl.load(partial_lse_ptr + request * stride_lse_request + head * stride_lse_head
                          + offs_s, mask=mask_s, other=float("-inf"))
            weights = tl.exp(lse - tl.max(lse, axis=0))                          # [BLOCK_S]
            weights = weights / tl.sum(weights, axis=0)
            partial = tl.load(partial_out_ptr + request * stride_partial_request
                              + head * stride_partial_head + offs_s[:, None] * stride_partial_split
                              + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
            result = tl.sum(partial * weights[:, None], axis=0)                 # [BLOCK_D]
            tl.store(out_ptr + q_start * stride_out_token + head * stride_out_head + offs_d,
                     result.to(out_ptr.dtype.element_ty), mask=mask_d)

    @triton.jit
    def _paged_attention_varlen_kernel(
        out_ptr,
        query_ptr, key_cache_ptr, value_cache_ptr,
        cu_query_lengths_ptr, kv_seq_lengths_ptr, block_table_ptr,
        group_size, head_dim, block_size, softmax_scale,
        stride_out_token, stride_out_head,
        stride_query_token, stride_query_head,
        stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head,
        stride_table_row,
        BLOCK_M: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
    ):
        """TILE_TOKENS query tokens of one request x the G query heads of one KV head, causal.

        BLOCK_M (the config's row count) sets TILE_TOKENS = max(1, BLOCK_M // BLOCK_G) on the
        host."""
        request = tl.program_id(0).to(tl.int64)
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
            # Causal: a row sees the keys up to its own position; every row sees key 0.
            row_position = kv_len - q_len + offs_q                             # [rows]
            last_key = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * TILE_TOKENS)

            running_max = tl.full((TILE_TOKENS * BLOCK_G,), float("-inf"), tl.float32)
            running_sum = tl.zeros((TILE_TOKENS * BLOCK_G,), tl.float32)
            acc = tl.zeros((TILE_TOKENS * BLOCK_G, BLOCK_D), tl.float32)
            table_row = block_table_ptr + request * stride_table_row
            for start in range(0, last_key, BLOCK_N):
                positions = start + offs_n
                mask_n = positions < last_key
                allowed = mask_n[None, :] & (positions[None, :] <= row_position[:, None])
                acc, running_max, running_sum = _attend_key_tile(
                    q, acc, running_max, running_sum, positions, mask_n, allowed,
                    table_row, key_cache_ptr, value_cache_ptr, kv_head, block_size,
                    softmax_scale, stride_kc_block, stride_kc_slot, stride_kc_head,
                    stride_vc_block, stride_vc_slot, stride_vc_head, offs_d, mask_d, IEEE_DOT)
            result = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
            tl.store(out_ptr + (q_start + offs_q)[:, None] * stride_out_token
                     + heads[:, None] * stride_out_head + offs_d[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


def _describe(tensor) -> str:
    return str(tuple(tensor.shape)) if isinstance(tensor, torch.Tensor) else type(tensor).__name__


def _check_index(name: str, tensor, dims: int, min_rows: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D int32 tensor, got {_describe(tensor)}")
    if tensor.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {tensor.dtype}")
    if tensor.shape[0] < min_rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows; num_requests needs >= {min_rows}")
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {tensor.stride()}")


def _check_inputs(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths, block_table,
                  num_requests, max_seqlen_q, max_seqlen_k, out) -> int:
    """Validate the launcher's arguments (shapes, dtypes, devices, limits); return num_requests."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"query must be [n, Hq, D], got {_describe(query)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query must be float32, float16 or bfloat16, got {query.dtype}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, Hkv, D]")
        if cache.dtype != query.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} != query dtype {query.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, "
                             f"got strides {cache.stride()}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
                         f"{tuple(key_cache.shape)}")
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache head dim {key_cache.shape[3]} != query head dim {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be in [1, {MAX_HEAD_DIM}]")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}")
    if num_q_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"query heads per KV head {num_q_heads // num_kv_heads} exceeds "
                         f"{MAX_GROUP}")
    if query.stride(-1) != 1:
        raise ValueError(f"query must have a contiguous last dim, got strides {query.stride()}")
    num_requests = kv_seq_lengths.shape[0] if num_requests is None else int(num_requests)
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests} must be >= 0")
    _check_index("cu_query_lengths", cu_query_lengths, 1, num_requests + 1)
    _check_index("kv_seq_lengths", kv_seq_lengths, 1, num_requests)
    _check_index("block_table", block_table, 2, num_requests)
    check_same_device((("key_cache", key_cache), ("value_cache", value_cache),
                       ("cu_query_lengths", cu_query_lengths), ("kv_seq_lengths", kv_seq_lengths),
                       ("block_table", block_table)), "query", query)
    if int(max_seqlen_q) < 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} must be >= 0")
    capacity = block_table.shape[1] * key_cache.shape[1]
    if not 0 <= int(max_seqlen_k) <= capacity:
        raise ValueError(f"max_seqlen_k={max_seqlen_k} must be in [0, {capacity}] (block_table "
                         f"columns {block_table.shape[1]} x block_size {key_cache.shape[1]})")
    if out is not None:
        if tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        if out.device != query.device:
            raise ValueError(f"out is on {out.device}, query on {query.device}")
        if out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    return num_requests


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                    block_table: torch.Tensor, *, max_seqlen_q: int, max_seqlen_k: int,
                    softmax_scale: float | None = None, num_requests: int | None = None,
                    num_decode_requests: int = 0, out: torch.Tensor | None = None,
                    config: KernelConfig | None = None, backend: str | None = None
                    ) -> torch.Tensor:
    """Causal GQA attention of packed queries over a paged KV cache.

    Args:
        query: ``[n, Hq, D]`` float32/float16/bfloat16, last dim contiguous; request ``i`` owns
            tokens ``[cu_query_lengths[i], cu_query_lengths[i + 1])``.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` in query's dtype, last dim
            contiguous, this step's K/V already written. ``Hq`` is a multiple of ``Hkv``
            (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        cu_query_lengths: int32 ``[>= num_requests + 1]``.
        kv_seq_lengths: int32 ``[>= num_requests]``: cached tokens of each request, its own
            queries included (``>= `` its query count; 0 for a padded request).
        block_table: int32 ``[>= num_requests, max_blocks]``; entries past a request's length
            are never read (``-1`` is fine).
        max_seqlen_q, max_seqlen_k: host ints bounding the query and KV lengths (they size the
            grid and pick the kernel: at most one query per request runs the split-KV decode).
        softmax_scale: default ``D ** -0.5``.
        num_requests: requests to attend (default ``kv_seq_lengths.shape[0]``).
        num_decode_requests: the leading requests with at most one query each (the context
            puts decode requests first). In a step with longer queries they still run through
            the split-KV decode kernel, the rest through the varlen one. ``config`` then must be
            None (each kernel resolves its own).
        out: optional ``[n, Hq, D]`` output in query's dtype, written in place for the
            requests' tokens only (padding rows keep their bytes).

    Returns ``[n, Hq, D]`` in query's dtype; padding rows are zero when the launcher allocates.
    """
    num_requests = _check_inputs(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                                 block_table, num_requests, max_seqlen_q, max_seqlen_k, out)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    num_tokens, num_q_heads, head_dim = query.shape
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    num_decode_requests = int(num_decode_requests)
    if not 0 <= num_decode_requests <= num_requests:
        raise ValueError(f"num_decode_requests={num_decode_requests} must be in [0, "
                         f"num_requests={num_requests}]")
    if max_seqlen_q > 1 and 0 < num_decode_requests < num_requests and config is not None:
        raise ValueError(f"config={config} names one kernel's config, but num_decode_requests="
                         f"{num_decode_requests} of num_requests={num_requests} runs both")
    if resolve_backend(backend, query.device) == "torch":
        result = paged_attention_ref(query, key_cache, value_cache, cu_query_lengths,
                                     kv_seq_lengths, block_table, softmax_scale=scale,
                                     num_requests=num_requests)
        if out is None:
            return result
        real = int(cu_query_lengths[num_requests])
        out[:real] = result[:real]
        return out
    if out is None:
        out = torch.zeros_like(query)
    if num_requests == 0 or max_seqlen_q == 0 or max_seqlen_k == 0 or num_tokens == 0:
        return out
    decode = num_requests if max_seqlen_q == 1 else num_decode_requests
    launch = dict(query=query, key_cache=key_cache, value_cache=value_cache, out=out,
                  scale=scale, config=config)
    if decode:
        _launch_decode(**launch, cu_query_lengths=cu_query_lengths[:decode + 1],
                       kv_seq_lengths=kv_seq_lengths[:decode], block_table=block_table[:decode],
                       num_requests=decode, max_seqlen_k=max_seqlen_k)
    if decode < num_requests:
        # Views from the first prefill request on: its tokens keep their absolute indices.
        _launch_varlen(**launch, cu_query_lengths=cu_query_lengths[decode:num_requests + 1],
                       kv_seq_lengths=kv_seq_lengths[decode:num_requests],
                       block_table=block_table[decode:num_requests],
                       num_requests=num_requests - decode, max_seqlen_q=max_seqlen_q)
    return out


def _common_args(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths, block_table,
                 scale) -> dict:
    num_q_heads, head_dim = query.shape[1:]
    return dict(query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
                cu_query_lengths_ptr=cu_query_lengths, kv_seq_lengths_ptr=kv_seq_lengths,
                block_table_ptr=block_table, group_size=num_q_heads // key_cache.shape[2],
                head_dim=head_dim, block_size=key_cache.shape[1], softmax_scale=scale,
                stride_query_token=query.stride(0), stride_query_head=query.stride(1),
                stride_kc_block=key_cache.stride(0), stride_kc_slot=key_cache.stride(1),
                stride_kc_head=key_cache.stride(2), stride_vc_block=value_cache.stride(0),
                stride_vc_slot=value_cache.stride(1), stride_vc_head=value_cache.stride(2),
                stride_table_row=block_table.stride(0),
                # tl.dot wants a reduction dim of at least 16; fp32 products stay IEEE.
                BLOCK_D=max(16, next_pow2(head_dim)), IEEE_DOT=query.dtype == torch.float32)


def _launch_decode(*, query, key_cache, value_cache, out, scale, config, cu_query_lengths,
                   kv_seq_lengths, block_table, num_requests, max_seqlen_k) -> None:
    """Split-KV decode of requests with at most one query each, then the merge of the splits."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if config is None:
        key = paged_attention_decode_tune_key(
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=query.dtype, num_requests=num_requests, max_seqlen_k=max_seqlen_k)
        config, _ = _autotune.resolve_config("paged_attention_decode", key, query.device)
    common = _common_args(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                          block_table, scale)
    num_splits = triton.cdiv(max_seqlen_k, config.kwargs["SPLIT_TOKENS"])
    partial = torch.empty(num_requests, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                          device=query.device)
    lse = torch.empty(num_requests, num_q_heads, num_splits, dtype=torch.float32,
                      device=query.device)
    partial_strides = dict(stride_partial_request=partial.stride(0),
                           stride_partial_head=partial.stride(1),
                           stride_partial_split=partial.stride(2),
                           stride_lse_request=lse.stride(0), stride_lse_head=lse.stride(1))
    # tl.dot wants at least 16 rows: the group's query heads, padded.
    _paged_attention_decode_kernel[(num_requests, num_kv_heads, num_splits)](
        partial_out_ptr=partial, partial_lse_ptr=lse, **common, **partial_strides,
        BLOCK_G=max(16, next_pow2(common["group_size"])), **config.launch_kwargs())
    _paged_attention_merge_kernel[(num_requests, num_q_heads)](
        out_ptr=out, partial_out_ptr=partial, partial_lse_ptr=lse,
        cu_query_lengths_ptr=cu_query_lengths, num_splits=num_splits, head_dim=head_dim,
        stride_out_token=out.stride(0), stride_out_head=out.stride(1), **partial_strides,
        BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_D=common["BLOCK_D"])


def _launch_varlen(*, query, key_cache, value_cache, out, scale, config, cu_query_lengths,
                   kv_seq_lengths, block_table, num_requests, max_seqlen_q) -> None:
    """Causal attention of every query token of the requests, in tiles of query tokens."""
    num_tokens, num_q_heads, head_dim = query.shape
    if config is None:
        key = paged_attention_varlen_tune_key(num_q_heads=num_q_heads,
                                              num_kv_heads=key_cache.shape[2], head_dim=head_dim,
                                              dtype=query.dtype, num_tokens=num_tokens)
        config, _ = _autotune.resolve_config("paged_attention_varlen", key, query.device)
    common = _common_args(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                          block_table, scale)
    block_g = next_pow2(common["group_size"])
    tile_tokens = max(1, config.kwargs["BLOCK_M"] // block_g)
    grid = (num_requests, triton.cdiv(max_seqlen_q, tile_tokens), key_cache.shape[2])
    _paged_attention_varlen_kernel[grid](
        out_ptr=out, **common, stride_out_token=out.stride(0), stride_out_head=out.stride(1),
        TILE_TOKENS=tile_tokens, BLOCK_G=block_g, **config.launch_kwargs())


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                        block_table: torch.Tensor, *, softmax_scale: float | None = None,
                        num_requests: int | None = None) -> torch.Tensor:
    """Torch reference of ``paged_attention``: one request at a time, fp32, GQA by repeating
    K/V per query head; padding rows are zero."""
    num_q_heads, head_dim = query.shape[1:]
    group = num_q_heads // key_cache.shape[2]
    block_size = key_cache.shape[1]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    num_requests = kv_seq_lengths.shape[0] if num_requests is None else num_requests
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    cu = cu_query_lengths.tolist()
    for request in range(num_requests):
        q_start, q_len = cu[request], cu[request + 1] - cu[request]
        kv_len = int(kv_seq_lengths[request])
        if q_len == 0:
            continue
        positions = torch.arange(kv_len, device=query.device)
        blocks = block_table[request].long()[positions // block_size]
        k = key_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        v = value_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        q = query[q_start:q_start + q_len].float()                             # [q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_positions = kv_len - q_len + torch.arange(q_len, device=query.device)
        causal = positions[None, :] <= query_positions[:, None]                 # [q, kv]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out[q_start:q_start + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(query.dtype)


@custom_op("dynctx::paged_attention", mutates_args=())
def _paged_attention_op(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                        block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        softmax_scale: float, num_requests: int,
                        num_decode_requests: int = 0) -> torch.Tensor:
    return paged_attention(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                           block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           softmax_scale=softmax_scale, num_requests=num_requests,
                           num_decode_requests=num_decode_requests)


@_paged_attention_op.register_fake
def _(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths, block_table, max_seqlen_q,
      max_seqlen_k, softmax_scale, num_requests, num_decode_requests=0):
    return torch.empty_like(query)
