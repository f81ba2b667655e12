"""Rope + KV append: rotate query and key in place and write the rotated key and the value
into the paged KV cache, all in one launch.

The rotation is exactly ``fused_qk_rope``'s (``kernels/rope_rotation.py``: same tables, layouts,
``mscale``, fp32 math); the cache write is ``kv_append``'s: ``key_cache[block_ids[t], slots[t]]
= rotated key[t]`` and the same for ``value``, bit-exact copies of what ``key`` holds after the
rotation. Tokens whose block id or slot is negative are rotated but not written to the cache.
An FP8 cache (``kernels/fp8.py``) takes ``key_scale``/``value_scale`` ``[Hk]`` and stores the
rotated key (as ``key`` holds it) and the value quantized, bit-exact against ``quantize_ref``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import autotune
from ._common import check_writable, custom_op, next_pow2
from ._shapes import LLAMA_3_8B
from .autotune import KernelConfig, KernelTuning
from .backend import HAS_TRITON, resolve_backend
from .devices import same_device
from .fp8 import FLOAT_DTYPES, check_head_scale, fp8_constexprs, is_fp8, quantize_ref
from .launch_plan import KernelLaunch, PlanCache
from .rope import fused_qk_rope_ref
from .rope_rotation import (
    RopeTuneCase,
    as_head_view,
    check_rope_args,
    fused_qk_rope_tune_key,
    rope_block_configs,
    rope_block_default,
    rope_meta,
    tune_check_rotation,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8 import round_to_fp8
    from .rope_rotation import _rope_rotate_program

# Per launch key (launch_plan.py): the checks passed, the config, the grid, the arguments.
_PLANS = PlanCache("rope_kv_append")


if HAS_TRITON:

    @triton.heuristics({"HAS_QUERY": lambda args: args["query_ptr"] is not None})
    @triton.jit(do_not_specialize=["num_tokens"])
    def _rope_kv_append_kernel(
        query_ptr, key_ptr, key_cache_ptr, value_cache_ptr,
        value_ptr, table_ptr,
        positions_ptr, block_ids_ptr, slots_ptr, key_scale_ptr, value_scale_ptr,
        num_tokens, num_q_heads, num_kv_heads, mscale,
        stride_query_token, stride_query_head, stride_query_dim,
        stride_key_token, stride_key_head, stride_key_dim,
        stride_value_token, stride_value_head, stride_value_dim,
        stride_key_cache_block, stride_key_cache_slot, stride_key_cache_head, stride_key_cache_dim,
        stride_value_cache_block, stride_value_cache_slot, stride_value_cache_head,
        stride_value_cache_dim,
        stride_table_pos, stride_table_dim, stride_positions, stride_block_ids, stride_slots,
        stride_key_scale, stride_value_scale,
        HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr,
        DIM_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, LAYOUT: tl.constexpr,
        TABLE_IS_FREQS: tl.constexpr, HAS_QUERY: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
        FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        """Grid (token tiles, query head tiles + kv head tiles); kv programs also append (an FP8
        cache, ``FP8_MAX > 0``: ``round_to_fp8(x / scale[head])`` of what ``key`` holds)."""
        pid_h = tl.program_id(1)
        num_q_tiles = tl.cdiv(num_q_heads, BLOCK_H)
        if HAS_QUERY:
            if pid_h < num_q_tiles:
                _rope_rotate_program(query_ptr, table_ptr, positions_ptr, pid_h, num_tokens,
                                     num_q_heads, mscale, stride_query_token, stride_query_head,
                                     stride_query_dim, stride_table_pos, stride_table_dim,
                                     stride_positions, ROT_DIM, HALF_BLOCK, LAYOUT,
                                     TABLE_IS_FREQS, BLOCK_T, BLOCK_H)
        if pid_h >= num_q_tiles:
            offs_t, mask_t, offs_h, mask_h, mask_pair, out1, out2, key_first, key_second = \
                _rope_rotate_program(key_ptr, table_ptr, positions_ptr, pid_h - num_q_tiles,
                                     num_tokens, num_kv_heads, mscale, stride_key_token,
                                     stride_key_head, stride_key_dim, stride_table_pos,
                                     stride_table_dim, stride_positions, ROT_DIM, HALF_BLOCK,
                                     LAYOUT, TABLE_IS_FREQS, BLOCK_T, BLOCK_H)
            block_ids = tl.load(block_ids_ptr + offs_t * stride_block_ids, mask=mask_t,
                                other=-1).to(tl.int64)
            slots = tl.load(slots_ptr + offs_t * stride_slots, mask=mask_t, other=-1).to(tl.int64)
            # padding tokens (negative block id or slot) are rotated but never appended
            mask_write = mask_t & (block_ids >= 0) & (slots >= 0)
            mask_rows = mask_write[:, None, None] & mask_h[None, :, None]
            # [BLOCK_T, BLOCK_H, 1]
            key_rows = key_ptr + offs_t[:, None, None] * stride_key_token \
                + offs_h[None, :, None] * stride_key_head
            key_cache_rows = key_cache_ptr + block_ids[:, None, None] * stride_key_cache_block \
                + slots[:, None, None] * stride_key_cache_slot \
                + offs_h[None, :, None] * stride_key_cache_head
            mask_rot = mask_rows & mask_pair[None, None, :]
            if FP8_MAX > 0:
                # Quantize the rotated key as ``key`` holds it (rounded to its dtype).
                key_scale = tl.load(key_scale_ptr + offs_h * stride_key_scale, mask=mask_h,
                                    other=1.0)[None, :, None]
                value_scale = tl.load(value_scale_ptr + offs_h * stride_value_scale, mask=mask_h,
                                      other=1.0)[None, :, None]
                key_first = round_to_fp8(
                    key_first.to(key_ptr.dtype.element_ty).to(tl.float32) / key_scale,
                    FP8_MANTISSA, FP8_MIN_EXP, FP8_MAX)
                key_second = round_to_fp8(
                    key_second.to(key_ptr.dtype.element_ty).to(tl.float32) / key_scale,
                    FP8_MANTISSA, FP8_MIN_EXP, FP8_MAX)
            tl.store(key_cache_rows + out1[None, None, :] * stride_key_cache_dim,
                     key_first.to(key_cache_ptr.dtype.element_ty), mask=mask_rot)
            tl.store(key_cache_rows + out2[None, None, :] * stride_key_cache_dim,
                     key_second.to(key_cache_ptr.dtype.element_ty), mask=mask_rot)
            if TAIL_BLOCK > 0:
                offs_tail = ROT_DIM + tl.arange(0, TAIL_BLOCK)
                mask_tail = mask_rows & (offs_tail < HEAD_DIM)[None, None, :]
                tail = tl.load(key_rows + offs_tail[None, None, :] * stride_key_dim, mask=mask_tail)
                if FP8_MAX > 0:
                    tail = round_to_fp8(tail.to(tl.float32) / key_scale, FP8_MANTISSA,
                                        FP8_MIN_EXP, FP8_MAX)
                tl.store(key_cache_rows + offs_tail[None, None, :] * stride_key_cache_dim,
                         tail.to(key_cache_ptr.dtype.element_ty), mask=mask_tail)
            offs_d = tl.arange(0, DIM_BLOCK)
            mask_value = mask_rows & (offs_d < HEAD_DIM)[None, None, :]
            value = tl.load(value_ptr + offs_t[:, None, None] * stride_value_token
                            + offs_h[None, :, None] * stride_value_head
                            + offs_d[None, None, :] * stride_value_dim,
                            mask=mask_value)
            if FP8_MAX > 0:
                value = round_to_fp8(value.to(tl.float32) / value_scale, FP8_MANTISSA,
                                     FP8_MIN_EXP, FP8_MAX)
            tl.store(value_cache_ptr + block_ids[:, None, None] * stride_value_cache_block
                     + slots[:, None, None] * stride_value_cache_slot
                     + offs_h[None, :, None] * stride_value_cache_head
                     + offs_d[None, None, :] * stride_value_cache_dim,
                     value.to(value_cache_ptr.dtype.element_ty), mask=mask_value)


def _check_cache(cache, name: str, like: torch.Tensor) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, H, D]")
    if tuple(cache.shape[2:]) != tuple(like.shape[1:]):
        raise ValueError(f"{name} heads/dim {tuple(cache.shape[2:])} != key's "
                         f"{tuple(like.shape[1:])}")
    if cache.dtype != like.dtype and not (is_fp8(cache.dtype) and like.dtype in FLOAT_DTYPES):
        raise ValueError(f"{name} dtype {cache.dtype} != key dtype {like.dtype} (nor an FP8 "
                         "cache)")
    if not same_device(cache.device, like.device):
        raise ValueError(f"{name} is on {cache.device}, expected {like.device}")
    check_writable((name, cache))


def _check_index(index, name: str, num_tokens: int, device: torch.device) -> None:
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.numel() != num_tokens:
        raise ValueError(f"{name} must be a 1-D tensor of positions.numel()={num_tokens} entries")
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {index.dtype}")
    if not same_device(index.device, device):
        raise ValueError(f"{name} is on {index.device}, expected {device}")


def rope_kv_append(query: Optional[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                   positions: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_ids: torch.Tensor, slots: torch.Tensor, *,
                   cos_sin_cache: Optional[torch.Tensor] = None,
                   freqs: Optional[torch.Tensor] = None, interleaved: bool = False,
                   mscale: float = 1.0, mla_layout: bool = False,
                   key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None,
                   config: KernelConfig | None = None, backend: str | None = None) -> None:
    """Rotate ``query[:n]`` and ``key[:n]`` IN PLACE and append key and value to the cache.

    query/key/positions/cos_sin_cache/freqs/interleaved/mscale/mla_layout: as ``fused_qk_rope``
        (``query`` may be None; ``key`` may not).
    value: ``[>=n, Hk, D]`` or ``[>=n, 1, Hk, D]``, key's dtype, any strides.
    key_cache, value_cache: ``[num_blocks, block_size, Hk, D]``, key's dtype (or both FP8, then
        ``key_scale``, ``value_scale`` fp32 ``[Hk]``), any strides
        (usually views of ``[2, L, blocks, bs, H, D]``); written IN PLACE at
        ``[block_ids[t], slots[t]]`` for ``t < n`` whose block id and slot are both >= 0.
    block_ids, slots: ``[n]`` int32/int64, any stride; targets must be in range (not checked).

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied at the edge. Every argument is checked before anything is written.
    """
    plan, plan_key = _PLANS.find(
        (query, key, value, positions, key_cache, value_cache, block_ids, slots, cos_sin_cache,
         freqs, key_scale, value_scale), (interleaved, mscale, mla_layout, backend), config,
         backend=backend)
    if plan is not None:
        plan.launch((query, key, key_cache, value_cache, value,
                     freqs if cos_sin_cache is None else cos_sin_cache, positions, block_ids,
                     slots, key if key_scale is None else key_scale,
                     key if value_scale is None else value_scale))
        return
    if key is None:
        raise ValueError("key must be a tensor (only query may be None)")
    problem = check_rope_args(query, key, positions, cos_sin_cache, freqs, interleaved, mla_layout)
    n, k = problem.num_tokens, problem.key
    v = as_head_view(value, "value", n)
    if tuple(v.shape[1:]) != tuple(k.shape[1:]) or v.dtype != k.dtype or \
            not same_device(v.device, k.device):
        raise ValueError(f"value {tuple(v.shape)} {v.dtype} must match key's heads, dim and dtype")
    _check_cache(key_cache, "key_cache", k)
    _check_cache(value_cache, "value_cache", k)
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} != key_cache dtype "
                         f"{key_cache.dtype}")
    if is_fp8(key_cache.dtype):
        if key_scale is None or value_scale is None:
            raise ValueError(f"an {key_cache.dtype} cache needs key_scale and value_scale")
        check_head_scale("key_scale", key_scale, k.shape[1], k.device)
        check_head_scale("value_scale", value_scale, k.shape[1], k.device)
    elif key_scale is not None or value_scale is not None:
        raise ValueError(f"key_scale/value_scale are for an FP8 cache, not {key_cache.dtype}")
    _check_index(block_ids, "block_ids", n, k.device)
    _check_index(slots, "slots", n, k.device)
    if n == 0:
        return
    device = positions.device
    if resolve_backend(backend, device) == "torch":
        rope_kv_append_ref(query, key, value, positions, key_cache, value_cache, block_ids, slots,
                           cos_sin_cache=cos_sin_cache, freqs=freqs, interleaved=interleaved,
                           mscale=mscale, mla_layout=mla_layout, key_scale=key_scale,
                           value_scale=value_scale)
        return
    if config is None:
        tune_key = problem.tune_key()
        if key_cache.dtype != k.dtype:
            tune_key["kv_dtype"] = autotune.dtype_name(key_cache.dtype)
        config, _ = autotune.resolve_config("rope_kv_append", tune_key, device)
    block_t, block_h = config.kwargs["BLOCK_T"], config.kwargs["BLOCK_H"]
    q, dim, rot = problem.query, problem.head_dim, problem.rot_dim
    grid = (triton.cdiv(n, block_t),
            triton.cdiv(problem.num_q_heads, block_h) + triton.cdiv(problem.num_k_heads, block_h))
    # The head views and the 2-D table start where the arguments do: a plan's launch passes
    # the arguments themselves.
    pointers = dict(
        query_ptr=q, key_ptr=k, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
        value_ptr=v, table_ptr=problem.table,
        positions_ptr=positions, block_ids_ptr=block_ids, slots_ptr=slots,
        # Without scales the kernel reads none: any pointer stands in.
        key_scale_ptr=k if key_scale is None else key_scale,
        value_scale_ptr=k if value_scale is None else value_scale)
    _PLANS.put(plan_key, KernelLaunch(_rope_kv_append_kernel, grid, dict(
        **pointers, num_tokens=n, num_q_heads=problem.num_q_heads, num_kv_heads=problem.num_k_heads,
        mscale=float(mscale),
        stride_query_token=0 if q is None else q.stride(0),
        stride_query_head=0 if q is None else q.stride(1),
        stride_query_dim=0 if q is None else q.stride(2),
        stride_key_token=k.stride(0), stride_key_head=k.stride(1), stride_key_dim=k.stride(2),
        stride_value_token=v.stride(0), stride_value_head=v.stride(1),
        stride_value_dim=v.stride(2),
        stride_key_cache_block=key_cache.stride(0), stride_key_cache_slot=key_cache.stride(1),
        stride_key_cache_head=key_cache.stride(2), stride_key_cache_dim=key_cache.stride(3),
        stride_value_cache_block=value_cache.stride(0),
        stride_value_cache_slot=value_cache.stride(1),
        stride_value_cache_head=value_cache.stride(2),
        stride_value_cache_dim=value_cache.stride(3),
        stride_table_pos=problem.table.stride(0), stride_table_dim=problem.table.stride(1),
        stride_positions=positions.stride(0), stride_block_ids=block_ids.stride(0),
        stride_slots=slots.stride(0),
        stride_key_scale=0 if key_scale is None else key_scale.stride(0),
        stride_value_scale=0 if value_scale is None else value_scale.stride(0),
        **fp8_constexprs(key_cache.dtype), HEAD_DIM=dim, DIM_BLOCK=next_pow2(dim),
        TAIL_BLOCK=0 if rot == dim else next_pow2(dim - rot),
        **rope_meta(problem), **config.launch_kwargs(),
    ), pointers))


def _kv_append_ref(key_cache, value_cache, key, value, block_ids, slots, key_scale=None,
                   value_scale=None) -> None:
    """``cache[block_ids[t], slots[t]] = x[t]`` (an FP8 cache: ``quantize_ref(x[t])``) for
    ``t < n`` with both indices >= 0."""
    n = block_ids.numel()
    keep = (block_ids >= 0) & (slots >= 0)
    blocks, slots = block_ids[keep].long(), slots[keep].long()
    for cache, x, scale in ((key_cache, key, key_scale), (value_cache, value, value_scale)):
        heads = (x[:, 0] if x.dim() == 4 else x)[:n][keep]
        if is_fp8(cache.dtype):
            heads = quantize_ref(heads, scale[:, None], cache.dtype)
        cache[blocks, slots] = heads


def rope_kv_append_ref(query, key, value, positions, key_cache, value_cache, block_ids, slots, *,
                       cos_sin_cache=None, freqs=None, interleaved: bool = False,
                       mscale: float = 1.0, mla_layout: bool = False, key_scale=None,
                       value_scale=None) -> None:
    """Readable torch reference: ``fused_qk_rope_ref``, then the KV append of the result."""
    fused_qk_rope_ref(query, key, positions, cos_sin_cache=cos_sin_cache, freqs=freqs,
                      interleaved=interleaved, mscale=mscale, mla_layout=mla_layout)
    _kv_append_ref(key_cache, value_cache, key, value, block_ids, slots, key_scale, value_scale)


def rope_kv_append_tune_key(kv_dtype=None, **shapes) -> dict:
    """The ``fused_qk_rope`` key: ``num_k_heads`` is also the value/cache head count;
    ``kv_dtype``, the cache's, only where it differs (an FP8 cache)."""
    key = fused_qk_rope_tune_key(**shapes)
    if kv_dtype is not None:
        name = kv_dtype if isinstance(kv_dtype, str) else autotune.dtype_name(kv_dtype)
        if name != key["dtype"]:
            key["kv_dtype"] = name
    return key


def rope_kv_append_configs(key: dict) -> list[KernelConfig]:
    # key programs also copy the whole value head and the key's pass-through dims; tiles of
    # 8K elements spill on sm_90 at 4 and 8 warps (tests/kernels/test_sm90_build.py)
    return rope_block_configs(next_pow2(key["head_dim"]),
                              max(key["num_q_heads"], key["num_k_heads"]), max_elements=4096)


def rope_kv_append_default_config(key: dict) -> KernelConfig:
    return rope_block_default(next_pow2(key["head_dim"]),
                              max(key["num_q_heads"], key["num_k_heads"]), key["num_tokens"],
                              max_elements=4096)


def rope_kv_append_presets() -> list[dict]:
    """Llama-3-8B (GQA 32/8, D 128, half-split, bf16) at decode and prefill sizes."""
    llama = dict(num_q_heads=LLAMA_3_8B["num_attention_heads"],
                 num_k_heads=LLAMA_3_8B["num_key_value_heads"], head_dim=LLAMA_3_8B["head_dim"],
                 rot_dim=LLAMA_3_8B["rotary_dim"], layout="neox", dtype=LLAMA_3_8B["dtype"])
    keys = [rope_kv_append_tune_key(num_tokens=n, table="freqs", **llama)
            for n in (1, 16, 64, 256, 2048, 8192)]
    keys += [rope_kv_append_tune_key(num_tokens=64, table="cos_sin", **llama)]
    keys += [rope_kv_append_tune_key(num_tokens=n, table="freqs", kv_dtype="float8_e4m3fn",
                                     **llama) for n in (1, 2048)]
    return keys


class _RopeKVAppendCase(RopeTuneCase):
    """Scratch q/k/v and a ``[2, 1, blocks, 16, Hk, D]`` cache; tokens land in shuffled slots."""

    def __init__(self, key: dict, device: torch.device):
        n, dim, dtype = key["num_tokens"], key["head_dim"], getattr(torch, key["dtype"])
        heads_q, heads_kv, block_size = key["num_q_heads"], key["num_k_heads"], 16
        generator = self._init_rope(key, device)
        num_blocks = -(-n // block_size) + 1
        targets = torch.randperm(num_blocks * block_size, generator=generator)[:n]
        self.block_ids = (targets // block_size).to(device)
        self.slots = (targets % block_size).to(device)
        self.originals = [None if heads == 0 else
                          (torch.rand(n, heads, dim, generator=generator) * 2 - 1).to(device, dtype)
                          for heads in (heads_q, heads_kv, heads_kv)]
        kv_dtype = getattr(torch, key.get("kv_dtype", key["dtype"]))
        self.buffer = torch.zeros(2, 1, num_blocks, block_size, heads_kv, dim,
                                  device=device).to(kv_dtype)
        self.scales = {} if not is_fp8(kv_dtype) else dict(
            key_scale=torch.full((heads_kv,), 1 / 256, device=device),
            value_scale=torch.full((heads_kv,), 1 / 256, device=device))
        self.tensors = [None if x is None else x.clone() for x in self.originals]
        itemsize = self.buffer.element_size()
        self.bytes_moved = itemsize * n * (2 * heads_q * key["rot_dim"] + 2 * heads_kv * dim
                                           + 2 * heads_kv * key["rot_dim"] + 2 * heads_kv * dim)

    def _launch(self, tensors, buffer, config, backend):
        query, key, value = tensors
        rope_kv_append(query, key, value, self.positions, buffer[0, 0], buffer[1, 0],
                       self.block_ids, self.slots, interleaved=self.interleaved,
                       mla_layout=self.mla_layout, config=config, backend=backend, **self.table,
                       **self.scales)

    def run(self, config: KernelConfig) -> None:
        self._launch(self.tensors, self.buffer, config, "triton")

    def run_reference(self) -> None:
        self._launch(self.tensors, self.buffer, None, "torch")

    def check(self, config: KernelConfig) -> None:
        actual = [None if x is None else x.clone() for x in self.originals]
        expected = [None if x is None else x.float() for x in self.originals]
        buffer = torch.full_like(self.buffer, float("nan"))
        if self.scales:
            # An FP8 cache holds exactly quantize_ref of what the kernel left in key and value.
            self._launch(actual, buffer, config, "triton")
            for index, (source, scale) in enumerate(((actual[1], self.scales["key_scale"]),
                                                     (self.originals[2],
                                                      self.scales["value_scale"]))):
                want = quantize_ref(source, scale[:, None], buffer.dtype)
                got = buffer[index, 0, self.block_ids, self.slots]
                if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    raise AssertionError(f"FP8 cache {index} is not quantize_ref of the input")
            return
        expected_buffer = buffer.float()
        self._launch(actual, buffer, config, "triton")
        self._launch(expected, expected_buffer, None, "torch")
        for name, got, want in (("query", actual[0], expected[0]), ("key", actual[1], expected[1]),
                                ("cache", buffer, expected_buffer)):
            if got is not None:
                tune_check_rotation(got.nan_to_num(7.0), want.nan_to_num(7.0), 1.0, name)
        if not torch.equal(buffer[0, 0, self.block_ids, self.slots], actual[1]):
            raise AssertionError("key_cache does not hold the rotated key bit for bit")
        if not torch.equal(buffer[1, 0, self.block_ids, self.slots], self.originals[2]):
            raise AssertionError("value_cache does not hold the value bit for bit")


autotune.register(KernelTuning(
    name="rope_kv_append", configs=rope_kv_append_configs,
    default_config=rope_kv_append_default_config, tune_key=rope_kv_append_tune_key,
    make_case=lambda key, device: _RopeKVAppendCase(key, torch.device(device)),
    presets=rope_kv_append_presets,
))


@custom_op("dynctx::rope_kv_append",
                         mutates_args=("query", "key", "key_cache", "value_cache"))
def _rope_kv_append_op(query: Optional[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                       positions: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, block_ids: torch.Tensor, slots: torch.Tensor,
                       cos_sin_cache: Optional[torch.Tensor], freqs: Optional[torch.Tensor],
                       interleaved: bool, mscale: float, mla_layout: bool,
                       key_scale: Optional[torch.Tensor] = None,
                       value_scale: Optional[torch.Tensor] = None) -> None:
    rope_kv_append(query, key, value, positions, key_cache, value_cache, block_ids, slots,
                   cos_sin_cache=cos_sin_cache, freqs=freqs, interleaved=interleaved,
                   mscale=mscale, mla_layout=mla_layout, key_scale=key_scale,
                   value_scale=value_scale, backend=None)


@_rope_kv_append_op.register_fake
def _rope_kv_append_fake(query, key, value, positions, key_cache, value_cache, block_ids, slots,
                         cos_sin_cache, freqs, interleaved, mscale, mla_layout, key_scale=None,
                         value_scale=None) -> None:
    return None
