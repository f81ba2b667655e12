"""KV append: write the step's K and V into their (block, slot) of the paged cache, one launch.

``key_cache[block_ids[t], slots[t]] = key[t]`` and the same for V, for every ``t < n`` with
``n = block_ids.numel()``. Padding tokens carry the dummy block and slot 0 and write there like
any token. Pure data movement: bit-exact in every dtype. An FP8 cache (``kernels/fp8.py``)
takes K and V of any float dtype with a per-KV-head scale for each, and stores them quantized
in the kernel (saturating, round to nearest even), bit-exact against ``quantize_ref``.
"""

from __future__ import annotations

import torch

from . import autotune
from ._common import (
    FLOAT_DTYPES,
    BufferWriteCase,
    check_block_slots,
    check_same_device,
    check_writable,
    custom_op,
    next_pow2,
    paged_targets,
    squeeze_singleton,
)
from ._shapes import LLAMA_3_8B
from .autotune import KernelConfig, KernelTuning
from .backend import HAS_TRITON, resolve_backend
from .fp8 import FP8_DTYPES, check_head_scale, fp8_constexprs, is_fp8, quantize_ref
from .launch_plan import KernelLaunch, PlanCache

NAME = "kv_append"
# Per launch key (module docstring of launch_plan.py): the checks passed, the config, the grid.
_PLANS = PlanCache(NAME)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8 import round_to_fp8

    @triton.jit(do_not_specialize=["num_tokens"])
    def _kv_append_kernel(
        key_cache_ptr, value_cache_ptr, key_ptr, value_ptr, block_ids_ptr, slots_ptr,
        key_scale_ptr, value_scale_ptr, num_tokens, num_heads, head_dim,
        stride_key_cache_block, stride_key_cache_slot, stride_key_cache_head, stride_key_cache_dim,
        stride_value_cache_block, stride_value_cache_slot, stride_value_cache_head,
        stride_value_cache_dim,
        stride_key_token, stride_key_head, stride_key_dim,
        stride_value_token, stride_value_head, stride_value_dim,
        stride_block_ids, stride_slots, stride_key_scale, stride_value_scale,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        """Copy a [BLOCK_T, BLOCK_H, head_dim] tile of K and of V to each token's (block, slot);
        an FP8 cache (``FP8_MAX > 0``) takes ``round_to_fp8(x / scale[head])``."""
        pid_t = tl.program_id(0).to(tl.int64)
        pid_h = tl.program_id(1).to(tl.int64)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_t = offs_t < num_tokens
        block = tl.load(block_ids_ptr + offs_t * stride_block_ids, mask=mask_t,
                        other=0).to(tl.int64)
        slot = tl.load(slots_ptr + offs_t * stride_slots, mask=mask_t, other=0).to(tl.int64)
        # [BLOCK_T, BLOCK_H, BLOCK_D]
        mask = (mask_t[:, None, None] & (offs_h < num_heads)[None, :, None]
                & (offs_d < head_dim)[None, None, :])
        key_dst = ((block * stride_key_cache_block + slot * stride_key_cache_slot)[:, None, None]
                   + offs_h[None, :, None] * stride_key_cache_head
                   + offs_d[None, None, :] * stride_key_cache_dim)
        value_dst = ((block * stride_value_cache_block
                      + slot * stride_value_cache_slot)[:, None, None]
                     + offs_h[None, :, None] * stride_value_cache_head
                     + offs_d[None, None, :] * stride_value_cache_dim)
        key_src = (offs_t[:, None, None] * stride_key_token
                   + offs_h[None, :, None] * stride_key_head
                   + offs_d[None, None, :] * stride_key_dim)
        value_src = (offs_t[:, None, None] * stride_value_token
                     + offs_h[None, :, None] * stride_value_head
                     + offs_d[None, None, :] * stride_value_dim)
        key = tl.load(key_ptr + key_src, mask=mask)
        value = tl.load(value_ptr + value_src, mask=mask)
        if FP8_MAX > 0:
            mask_h = offs_h < num_heads
            key_scale = tl.load(key_scale_ptr + offs_h * stride_key_scale, mask=mask_h, other=1.0)
            value_scale = tl.load(value_scale_ptr + offs_h * stride_value_scale, mask=mask_h,
                                  other=1.0)
            key = round_to_fp8(key.to(tl.float32) / key_scale[None, :, None],
                               FP8_MANTISSA, FP8_MIN_EXP, FP8_MAX)
            value = round_to_fp8(value.to(tl.float32) / value_scale[None, :, None],
                                 FP8_MANTISSA, FP8_MIN_EXP, FP8_MAX)
        tl.store(key_cache_ptr + key_dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + value_dst, value.to(value_cache_ptr.dtype.element_ty),
                 mask=mask)


def _check_inputs(key_cache, value_cache, key, value, block_ids, slots, key_scale, value_scale):
    """Validate the contract; return ``key``, ``value`` as [>=n, H, D] views."""
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, H, D], "
                         f"got {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
                         f"{tuple(key_cache.shape)}")
    if key_cache.dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise ValueError(f"key_cache dtype {key_cache.dtype} is not one of "
                         f"{FLOAT_DTYPES + FP8_DTYPES}")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} != key_cache dtype "
                         f"{key_cache.dtype}")
    check_writable(("key_cache", key_cache), ("value_cache", value_cache))
    key = squeeze_singleton("key", key, 3, "H, D")
    value = squeeze_singleton("value", value, 3, "H, D")
    num_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    n = block_ids.numel()
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape[1:]) != (num_heads, head_dim):
            raise ValueError(f"{name} heads/dim {tuple(tensor.shape[1:])} != cache's "
                             f"{(num_heads, head_dim)}")
        if tensor.shape[0] < n:
            raise ValueError(f"{name} has {tensor.shape[0]} rows, fewer than the {n} tokens")
        if is_fp8(key_cache.dtype):
            if tensor.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} dtype {tensor.dtype} is not one of {FLOAT_DTYPES} "
                                 f"(an {key_cache.dtype} cache quantizes them)")
        elif tensor.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} != cache dtype {key_cache.dtype}")
    if is_fp8(key_cache.dtype):
        if key_scale is None or value_scale is None:
            raise ValueError(f"an {key_cache.dtype} cache needs key_scale and value_scale")
        check_head_scale("key_scale", key_scale, num_heads, key_cache.device)
        check_head_scale("value_scale", value_scale, num_heads, key_cache.device)
    elif key_scale is not None or value_scale is not None:
        raise ValueError(f"key_scale/value_scale are for an FP8 cache, not {key_cache.dtype}")
    check_block_slots(block_ids, slots)
    check_same_device((("value_cache", value_cache), ("key", key), ("value", value),
                       ("block_ids", block_ids), ("slots", slots)), "key_cache", key_cache)
    return key, value


def kv_append(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, block_ids: torch.Tensor, slots: torch.Tensor, *,
              key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None,
              config: KernelConfig | None = None, backend: str | None = None,
              check: bool = True) -> None:
    """Write K and V of ``n = block_ids.numel()`` tokens into the paged cache, in place.

    - ``key_cache``, ``value_cache``: ``[num_blocks, block_size, H, D]`` fp32/fp16/bf16 (or
      float8_e4m3fn/float8_e5m2, then ``key_scale``, ``value_scale`` fp32 ``[H]``), the same
      shape, each with its own strides (usually views ``buf[0, layer]``, ``buf[1, layer]`` of the
      ``[2, L, num_blocks, block_size, H, D]`` buffer, last dim contiguous). Written in place.
    - ``key``, ``value``: ``[>=n, H, D]`` or ``[>=n, 1, H, D]``, the cache's dtype (an FP8 cache:
      any of fp32/fp16/bf16, stored as ``fp8(clamp(x / scale[h]))``), any strides; rows past
      ``n`` are ignored.
    - ``block_ids``, ``slots``: ``[n]`` int32/int64, any stride, in range (not checked: that
      would sync). Tokens sharing a (block, slot), such as padding tokens, leave one of their
      rows there.
    - ``check=False`` skips the checks: for a caller (the context) that checked its inputs once
      and passes ``key``, ``value`` as ``[>=n, H, D]``.

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied at the edge. Every argument is checked before anything is written.
    """
    plan, plan_key = _PLANS.find((key_cache, value_cache, key, value, block_ids, slots, key_scale,
                                  value_scale), (check, backend), config, backend=backend)
    if plan is not None:
        plan.launch((key_cache, value_cache, key, value, block_ids, slots,
                     key if key_scale is None else key_scale,
                     value if value_scale is None else value_scale))
        return
    if check:
        key, value = _check_inputs(key_cache, value_cache, key, value, block_ids, slots,
                                   key_scale, value_scale)
    n = block_ids.numel()
    if n == 0:
        return
    if resolve_backend(backend, key_cache.device) == "torch":
        kv_append_ref(key_cache, value_cache, key, value, block_ids, slots,
                      key_scale=key_scale, value_scale=value_scale)
        return
    num_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if config is None:
        tune_key = kv_append_tune_key(num_tokens=n, num_heads=num_heads, head_dim=head_dim,
                                      dtype=key.dtype, kv_dtype=key_cache.dtype)
        config, _ = autotune.resolve_config(NAME, tune_key, key_cache.device)
    meta = config.kwargs
    grid = (-(-n // meta["BLOCK_T"]), -(-num_heads // meta["BLOCK_H"]))
    pointers = dict(
        key_cache_ptr=key_cache, value_cache_ptr=value_cache, key_ptr=key, value_ptr=value,
        block_ids_ptr=block_ids, slots_ptr=slots,
        # Without scales the kernel reads none: any pointer stands in.
        key_scale_ptr=key if key_scale is None else key_scale,
        value_scale_ptr=value if value_scale is None else value_scale)
    _PLANS.put(plan_key, KernelLaunch(_kv_append_kernel, grid, dict(
        **pointers, num_tokens=n, num_heads=num_heads, head_dim=head_dim,
        stride_key_cache_block=key_cache.stride(0), stride_key_cache_slot=key_cache.stride(1),
        stride_key_cache_head=key_cache.stride(2), stride_key_cache_dim=key_cache.stride(3),
        stride_value_cache_block=value_cache.stride(0),
        stride_value_cache_slot=value_cache.stride(1),
        stride_value_cache_head=value_cache.stride(2),
        stride_value_cache_dim=value_cache.stride(3),
        stride_key_token=key.stride(0), stride_key_head=key.stride(1), stride_key_dim=key.stride(2),
        stride_value_token=value.stride(0), stride_value_head=value.stride(1),
        stride_value_dim=value.stride(2),
        stride_block_ids=block_ids.stride(0), stride_slots=slots.stride(0),
        stride_key_scale=0 if key_scale is None else key_scale.stride(0),
        stride_value_scale=0 if value_scale is None else value_scale.stride(0),
        BLOCK_D=next_pow2(head_dim), **fp8_constexprs(key_cache.dtype), **config.launch_kwargs(),
    ), pointers))


def kv_append_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, block_ids: torch.Tensor, slots: torch.Tensor, *,
                  key_scale: torch.Tensor | None = None,
                  value_scale: torch.Tensor | None = None) -> None:
    """Reference: one advanced-index assignment per cache (an FP8 cache: of ``quantize_ref``)."""
    n = block_ids.numel()
    key = key[:, 0] if key.dim() == 4 else key
    value = value[:, 0] if value.dim() == 4 else value
    block_ids, slots = block_ids.long(), slots.long()
    key, value = key[:n], value[:n]
    if is_fp8(key_cache.dtype):
        key = quantize_ref(key, key_scale[:, None], key_cache.dtype)
        value = quantize_ref(value, value_scale[:, None], value_cache.dtype)
    key_cache[block_ids, slots] = key
    value_cache[block_ids, slots] = value


# Largest tile (tokens x heads x padded head dim) one program moves per tensor.
_MAX_TILE = 16384


def kv_append_configs(key: dict) -> list[KernelConfig]:
    """Search space: tokens per program x heads per program x warps, tiles up to 16K elements."""
    heads_pow2, dim_pow2 = next_pow2(key["num_heads"]), next_pow2(key["head_dim"])
    configs: list[KernelConfig] = []
    for block_t in (1, 4, 16):
        for block_h in sorted({min(2, heads_pow2), min(8, heads_pow2)}):
            tile = block_t * block_h * dim_pow2
            smallest = block_t == 1 and block_h == min(2, heads_pow2)
            if tile > _MAX_TILE and not smallest:
                continue
            for num_warps in (4, 8):
                if num_warps == 8 and tile < 32 * 8:
                    continue
                configs.append(KernelConfig.make(BLOCK_T=block_t, BLOCK_H=block_h,
                                                 num_warps=num_warps))
    return configs


def kv_append_default_config(key: dict) -> KernelConfig:
    """A whole token's heads per program (up to 8); 4 tokens per program from 64 tokens on."""
    block_h = min(8, next_pow2(key["num_heads"]))
    block_t = 4 if key["num_tokens"] >= 64 else 1
    tile = block_t * block_h * next_pow2(key["head_dim"])
    config = KernelConfig.make(BLOCK_T=block_t, BLOCK_H=block_h, num_warps=8 if tile >= 2048 else 4)
    space = kv_append_configs(key)
    return config if config in space else space[0]


def kv_append_tune_key(*, num_tokens: int, num_heads: int, head_dim: int, dtype,
                       kv_dtype=None) -> dict:
    """Heads, head dim and dtype (of K and V) exact; the token count bucketed to a power of
    two; ``kv_dtype``, the cache's, only where it differs (an FP8 cache)."""
    dtype = dtype if isinstance(dtype, str) else autotune.dtype_name(dtype)
    key = {"num_tokens": autotune.bucket_tokens(num_tokens), "num_heads": int(num_heads),
           "head_dim": int(head_dim), "dtype": dtype}
    kv_dtype = kv_dtype if kv_dtype is None or isinstance(kv_dtype, str) \
        else autotune.dtype_name(kv_dtype)
    if kv_dtype is not None and kv_dtype != dtype:
        key["kv_dtype"] = kv_dtype
    return key


def kv_append_presets() -> list[dict]:
    """Llama-3-8B GQA (8 KV heads of 128, bf16) at decode and prefill token counts, into a
    bf16 and an e4m3 cache."""
    return [kv_append_tune_key(num_tokens=n, num_heads=LLAMA_3_8B["num_key_value_heads"],
                               head_dim=LLAMA_3_8B["head_dim"], dtype=LLAMA_3_8B["dtype"],
                               kv_dtype=kv_dtype)
            for kv_dtype in (None, "float8_e4m3fn") for n in (1, 16, 64, 256, 2048, 8192)]


def _make_case(key: dict, device: torch.device) -> "KvAppendCase":
    return KvAppendCase(key, device)


autotune.register(KernelTuning(
    name=NAME, configs=kv_append_configs, default_config=kv_append_default_config,
    tune_key=kv_append_tune_key, make_case=_make_case, presets=kv_append_presets,
))


class KvAppendCase(BufferWriteCase):
    """Scratch buffers for one key, the tokens at ``paged_targets``."""

    NAME = NAME
    BLOCK_SIZE = 256

    def __init__(self, key: dict, device: torch.device):
        n, heads, dim = key["num_tokens"], key["num_heads"], key["head_dim"]
        dtype = getattr(torch, key["dtype"])
        kv_dtype = getattr(torch, key.get("kv_dtype", key["dtype"]))
        bs = self.BLOCK_SIZE
        gen = torch.Generator().manual_seed(0)
        num_blocks, block_ids, slots = paged_targets(n, bs, gen)
        self.buffer = torch.randn(2, 1, num_blocks, bs, heads, dim, generator=gen).to(device,
                                                                                     kv_dtype)
        scales = None if not is_fp8(kv_dtype) else torch.full((2, heads), 1 / 64, device=device)
        self.scales = {} if scales is None else dict(key_scale=scales[0], value_scale=scales[1])
        self.initial = self.buffer.clone()
        self.key = torch.randn(n, heads, dim, generator=gen).to(device, dtype)
        self.value = torch.randn(n, heads, dim, generator=gen).to(device, dtype)
        self.block_ids = block_ids.to(device, torch.int32)
        self.slots = slots.to(device, torch.int32)
        elems = n * heads * dim
        self.bytes_moved = (2 * elems * (self.key.element_size() + self.buffer.element_size())
                            + 2 * 4 * n)

    def _args(self):
        return (self.buffer[0, 0], self.buffer[1, 0], self.key, self.value, self.block_ids,
                self.slots)

    def run(self, config: KernelConfig) -> None:
        kv_append(*self._args(), **self.scales, config=config, backend="triton")

    def run_reference(self) -> None:
        kv_append_ref(*self._args(), **self.scales)


@custom_op("dynctx::kv_append", mutates_args=("key_cache", "value_cache"))
def _kv_append_op(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, block_ids: torch.Tensor, slots: torch.Tensor,
                  key_scale: torch.Tensor | None = None,
                  value_scale: torch.Tensor | None = None) -> None:
    kv_append(key_cache, value_cache, key, value, block_ids, slots, key_scale=key_scale,
              value_scale=value_scale, backend=None)


@_kv_append_op.register_fake
def _kv_append_fake(key_cache, value_cache, key, value, block_ids, slots, key_scale=None,
                    value_scale=None) -> None:
    return None


kv_append_op = torch.ops.dynctx.kv_append
