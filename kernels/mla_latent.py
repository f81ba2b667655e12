"""MLA latent caching: write each token's compressed KV latent and rope key into the latent cache.

``latent_cache[block_ids[t], slots[t]] = cat(kv_latent[t], k_rope[t])`` for every ``t < n`` with
``n = block_ids.numel()``, one launch. Pure data movement: bit-exact in every dtype. An FP8
cache (``kernels/fp8.py``) takes a ``latent_scale`` and a ``rope_scale`` (fp32 ``[1]``) and
stores both parts quantized in the kernel, bit-exact against ``quantize_ref``.
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
from ._shapes import DEEPSEEK_V2_LITE
from .autotune import KernelConfig, KernelTuning
from .backend import HAS_TRITON, resolve_backend
from .fp8 import FP8_DTYPES, check_head_scale, fp8_constexprs, is_fp8, quantize_ref
from .launch_plan import KernelLaunch, PlanCache

NAME = "mla_latent_append"
# Per launch key (launch_plan.py): the checks passed, the config, the grid, the arguments.
_PLANS = PlanCache(NAME)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8 import round_to_fp8

    @triton.jit(do_not_specialize=["num_tokens"])
    def _mla_latent_append_kernel(
        latent_cache_ptr, kv_latent_ptr, k_rope_ptr, block_ids_ptr, slots_ptr,
        latent_scale_ptr, rope_scale_ptr, num_tokens, kv_lora_rank, rope_dim,
        stride_cache_block, stride_cache_slot, stride_cache_col,
        stride_latent_token, stride_latent_dim, stride_rope_token, stride_rope_dim,
        stride_block_ids, stride_slots,
        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
        FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        """Copy a [BLOCK_T, BLOCK_C] tile of cache rows; column c < rank comes from the latent,
        the others from the rope key (an FP8 cache: each quantized with its part's scale)."""
        pid_t = tl.program_id(0).to(tl.int64)
        pid_c = tl.program_id(1).to(tl.int64)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_t = offs_t < num_tokens
        block = tl.load(block_ids_ptr + offs_t * stride_block_ids, mask=mask_t,
                        other=0).to(tl.int64)
        slot = tl.load(slots_ptr + offs_t * stride_slots, mask=mask_t, other=0).to(tl.int64)
        is_latent = offs_c < kv_lora_rank
        is_rope = (offs_c >= kv_lora_rank) & (offs_c < kv_lora_rank + rope_dim)
        # [BLOCK_T, BLOCK_C]
        latent = tl.load(kv_latent_ptr + offs_t[:, None] * stride_latent_token
                         + offs_c[None, :] * stride_latent_dim,
                         mask=mask_t[:, None] & is_latent[None, :])
        rope = tl.load(k_rope_ptr + offs_t[:, None] * stride_rope_token
                       + (offs_c - kv_lora_rank)[None, :] * stride_rope_dim,
                       mask=mask_t[:, None] & is_rope[None, :])
        dst = ((block * stride_cache_block + slot * stride_cache_slot)[:, None]
               + offs_c[None, :] * stride_cache_col)
        row = tl.where(is_latent[None, :], latent, rope)
        if FP8_MAX > 0:
            scale = tl.where(is_latent, tl.load(latent_scale_ptr), tl.load(rope_scale_ptr))
            row = round_to_fp8(row.to(tl.float32) / scale[None, :], FP8_MANTISSA, FP8_MIN_EXP,
                               FP8_MAX)
        tl.store(latent_cache_ptr + dst, row.to(latent_cache_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & (is_latent | is_rope)[None, :])


def _check_inputs(latent_cache, kv_latent, k_rope, block_ids, slots, latent_scale=None,
                  rope_scale=None):
    """Validate the contract; return ``kv_latent``, ``k_rope`` as 2-D views."""
    if latent_cache.dim() != 3:
        raise ValueError("latent_cache must be [num_blocks, block_size, kv_lora_rank + rope_dim], "
                         f"got {tuple(latent_cache.shape)}")
    if latent_cache.dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise ValueError(f"latent_cache dtype {latent_cache.dtype} is not one of "
                         f"{FLOAT_DTYPES + FP8_DTYPES}")
    check_writable(("latent_cache", latent_cache))
    kv_latent = squeeze_singleton("kv_latent", kv_latent, 2, "dim")
    k_rope = squeeze_singleton("k_rope", k_rope, 2, "dim")
    n = block_ids.numel()
    if kv_latent.shape[1] + k_rope.shape[1] != latent_cache.shape[2]:
        raise ValueError(f"kv_latent dim {kv_latent.shape[1]} + k_rope dim {k_rope.shape[1]} != "
                         f"latent_cache row {latent_cache.shape[2]}")
    for name, tensor in (("kv_latent", kv_latent), ("k_rope", k_rope)):
        if tensor.shape[0] < n:
            raise ValueError(f"{name} has {tensor.shape[0]} rows, fewer than the {n} tokens")
        if is_fp8(latent_cache.dtype):
            if tensor.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} dtype {tensor.dtype} is not one of {FLOAT_DTYPES}")
        elif tensor.dtype != latent_cache.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} != latent_cache dtype "
                             f"{latent_cache.dtype}")
    if is_fp8(latent_cache.dtype):
        if latent_scale is None or rope_scale is None:
            raise ValueError(f"an {latent_cache.dtype} latent cache needs latent_scale and "
                             "rope_scale")
        check_head_scale("latent_scale", latent_scale, 1, latent_cache.device)
        check_head_scale("rope_scale", rope_scale, 1, latent_cache.device)
    elif latent_scale is not None or rope_scale is not None:
        raise ValueError(f"latent_scale/rope_scale are for an FP8 cache, not "
                         f"{latent_cache.dtype}")
    check_block_slots(block_ids, slots)
    check_same_device((("kv_latent", kv_latent), ("k_rope", k_rope), ("block_ids", block_ids),
                       ("slots", slots)), "latent_cache", latent_cache)
    return kv_latent, k_rope


def mla_latent_append(latent_cache: torch.Tensor, kv_latent: torch.Tensor, k_rope: torch.Tensor,
                      block_ids: torch.Tensor, slots: torch.Tensor, *,
                      latent_scale: torch.Tensor | None = None,
                      rope_scale: torch.Tensor | None = None,
                      config: KernelConfig | None = None, backend: str | None = None,
                      check: bool = True) -> None:
    """Write the latent and rope key of ``n = block_ids.numel()`` tokens into the cache, in place.

    - ``latent_cache``: ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` fp32/fp16/bf16, any
      strides (usually a view ``buf[layer]`` of ``[L, blocks, bs, rank + rope]``).
      Written in place: columns ``[:rank]`` take the latent, ``[rank:]`` the rope key. Or
      float8_e4m3fn/float8_e5m2, with ``latent_scale`` and ``rope_scale`` fp32 ``[1]``: stored
      as ``fp8(clamp(x / scale))``, K/V of any float dtype.
    - ``kv_latent``: ``[>=n, rank]`` or ``[>=n, 1, rank]``; ``k_rope``: ``[>=n, rope]`` or
      ``[>=n, 1, rope]``; the cache's dtype, each with its own strides; rows past ``n`` ignored.
    - ``block_ids``, ``slots``: ``[n]`` int32/int64, any stride, in range (not checked: that
      would sync).
    - ``check=False`` skips the checks: for a caller (the context) that checked its inputs once
      and passes ``kv_latent``, ``k_rope`` as 2-D views.

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied at the edge. Every argument is checked before anything is written.
    """
    plan, plan_key = _PLANS.find((latent_cache, kv_latent, k_rope, block_ids, slots, latent_scale,
                                  rope_scale), (check, backend), config, backend=backend)
    if plan is not None:
        plan.launch((latent_cache, kv_latent, k_rope, block_ids, slots,
                     kv_latent if latent_scale is None else latent_scale,
                     kv_latent if rope_scale is None else rope_scale))
        return
    if check:
        kv_latent, k_rope = _check_inputs(latent_cache, kv_latent, k_rope, block_ids, slots,
                                          latent_scale, rope_scale)
    n = block_ids.numel()
    if n == 0:
        return
    if resolve_backend(backend, latent_cache.device) == "torch":
        mla_latent_append_ref(latent_cache, kv_latent, k_rope, block_ids, slots,
                              latent_scale=latent_scale, rope_scale=rope_scale)
        return
    rank, rope_dim = kv_latent.shape[1], k_rope.shape[1]
    if config is None:
        tune_key = mla_latent_append_tune_key(num_tokens=n, kv_lora_rank=rank, rope_dim=rope_dim,
                                              dtype=kv_latent.dtype, kv_dtype=latent_cache.dtype)
        config, _ = autotune.resolve_config(NAME, tune_key, latent_cache.device)
    meta = config.kwargs
    grid = (-(-n // meta["BLOCK_T"]), -(-(rank + rope_dim) // meta["BLOCK_C"]))
    # A [n, 1, C] argument's 2-D view starts where it does: a plan's launch passes the argument.
    pointers = dict(
        latent_cache_ptr=latent_cache, kv_latent_ptr=kv_latent, k_rope_ptr=k_rope,
        block_ids_ptr=block_ids, slots_ptr=slots,
        # Without scales the kernel reads none: any pointer stands in.
        latent_scale_ptr=kv_latent if latent_scale is None else latent_scale,
        rope_scale_ptr=kv_latent if rope_scale is None else rope_scale)
    _PLANS.put(plan_key, KernelLaunch(_mla_latent_append_kernel, grid, dict(
        **pointers, num_tokens=n, kv_lora_rank=rank, rope_dim=rope_dim,
        stride_cache_block=latent_cache.stride(0), stride_cache_slot=latent_cache.stride(1),
        stride_cache_col=latent_cache.stride(2),
        stride_latent_token=kv_latent.stride(0), stride_latent_dim=kv_latent.stride(1),
        stride_rope_token=k_rope.stride(0), stride_rope_dim=k_rope.stride(1),
        stride_block_ids=block_ids.stride(0), stride_slots=slots.stride(0),
        **fp8_constexprs(latent_cache.dtype), **config.launch_kwargs(),
    ), pointers))


def mla_latent_append_ref(latent_cache: torch.Tensor, kv_latent: torch.Tensor, k_rope: torch.Tensor,
                          block_ids: torch.Tensor, slots: torch.Tensor, *,
                          latent_scale: torch.Tensor | None = None,
                          rope_scale: torch.Tensor | None = None) -> None:
    """Reference: concatenate latent and rope key (an FP8 cache: each ``quantize_ref``'d with
    its scale), then one advanced-index assignment."""
    n = block_ids.numel()
    kv_latent = kv_latent[:, 0] if kv_latent.dim() == 3 else kv_latent
    k_rope = k_rope[:, 0] if k_rope.dim() == 3 else k_rope
    kv_latent, k_rope = kv_latent[:n], k_rope[:n]
    if is_fp8(latent_cache.dtype):
        kv_latent = quantize_ref(kv_latent, latent_scale, latent_cache.dtype)
        k_rope = quantize_ref(k_rope, rope_scale, latent_cache.dtype)
    rows = torch.cat([kv_latent, k_rope], dim=-1)
    latent_cache[block_ids.long(), slots.long()] = rows


def mla_latent_append_configs(key: dict) -> list[KernelConfig]:
    """Search space: tokens per program x row columns per program (256 or the whole row) x warps."""
    row_pow2 = next_pow2(key["kv_lora_rank"] + key["rope_dim"])
    configs: list[KernelConfig] = []
    for block_t in (1, 4, 16):
        for block_c in sorted({min(256, row_pow2), row_pow2}):
            tile = block_t * block_c
            if tile > 16384 and block_t > 1:
                continue
            for num_warps in (4, 8):
                if num_warps == 8 and tile < 32 * 8:
                    continue
                configs.append(KernelConfig.make(BLOCK_T=block_t, BLOCK_C=block_c,
                                                 num_warps=num_warps))
    return configs


def mla_latent_append_default_config(key: dict) -> KernelConfig:
    """The whole row per program; 4 tokens per program from 64 tokens on."""
    block_c = next_pow2(key["kv_lora_rank"] + key["rope_dim"])
    block_t = 4 if key["num_tokens"] >= 64 else 1
    config = KernelConfig.make(BLOCK_T=block_t, BLOCK_C=block_c,
                               num_warps=8 if block_t * block_c >= 2048 else 4)
    space = mla_latent_append_configs(key)
    return config if config in space else space[0]


def mla_latent_append_tune_key(*, num_tokens: int, kv_lora_rank: int, rope_dim: int, dtype,
                               kv_dtype=None) -> dict:
    """Latent rank, rope dim and dtype exact; the token count bucketed to a power of two;
    ``kv_dtype``, the cache's, only where it differs (an FP8 cache)."""
    dtype = dtype if isinstance(dtype, str) else autotune.dtype_name(dtype)
    key = {"num_tokens": autotune.bucket_tokens(num_tokens), "kv_lora_rank": int(kv_lora_rank),
           "rope_dim": int(rope_dim), "dtype": dtype}
    kv_dtype = kv_dtype if kv_dtype is None or isinstance(kv_dtype, str) \
        else autotune.dtype_name(kv_dtype)
    if kv_dtype is not None and kv_dtype != dtype:
        key["kv_dtype"] = kv_dtype
    return key


def mla_latent_append_presets() -> list[dict]:
    """DeepSeek-V2-Lite MLA (kv_lora_rank 512, rope 64, bf16) at decode and prefill sizes, into
    a bf16 and an e4m3 cache."""
    return [mla_latent_append_tune_key(num_tokens=n, kv_lora_rank=DEEPSEEK_V2_LITE["kv_lora_rank"],
                                       rope_dim=DEEPSEEK_V2_LITE["qk_rope_head_dim"],
                                       dtype=DEEPSEEK_V2_LITE["dtype"], kv_dtype=kv_dtype)
            for kv_dtype in (None, "float8_e4m3fn") for n in (1, 16, 64, 256, 2048, 8192)]


def _make_case(key: dict, device: torch.device) -> "MlaLatentAppendCase":
    return MlaLatentAppendCase(key, device)


autotune.register(KernelTuning(
    name=NAME, configs=mla_latent_append_configs, default_config=mla_latent_append_default_config,
    tune_key=mla_latent_append_tune_key, make_case=_make_case, presets=mla_latent_append_presets,
))


class MlaLatentAppendCase(BufferWriteCase):
    """Scratch buffers for one key, the tokens at ``paged_targets``."""

    NAME = NAME
    BLOCK_SIZE = 64

    def __init__(self, key: dict, device: torch.device):
        n, rank, rope_dim = key["num_tokens"], key["kv_lora_rank"], key["rope_dim"]
        dtype = getattr(torch, key["dtype"])
        kv_dtype = getattr(torch, key.get("kv_dtype", key["dtype"]))
        bs = self.BLOCK_SIZE
        gen = torch.Generator().manual_seed(0)
        num_blocks, block_ids, slots = paged_targets(n, bs, gen)
        self.buffer = torch.randn(1, num_blocks, bs, rank + rope_dim,
                                  generator=gen).to(device, kv_dtype)
        self.scales = {} if not is_fp8(kv_dtype) else dict(
            latent_scale=torch.full((1,), 1 / 64, device=device),
            rope_scale=torch.full((1,), 1 / 32, device=device))
        self.initial = self.buffer.clone()
        self.kv_latent = torch.randn(n, rank, generator=gen).to(device, dtype)
        self.k_rope = torch.randn(n, rope_dim, generator=gen).to(device, dtype)
        self.block_ids = block_ids.to(device, torch.int32)
        self.slots = slots.to(device, torch.int32)
        self.bytes_moved = 2 * n * (rank + rope_dim) * self.k_rope.element_size() + 2 * 4 * n

    def _args(self):
        return (self.buffer[0], self.kv_latent, self.k_rope, self.block_ids, self.slots)

    def run(self, config: KernelConfig) -> None:
        mla_latent_append(*self._args(), **self.scales, config=config, backend="triton")

    def run_reference(self) -> None:
        mla_latent_append_ref(*self._args(), **self.scales)


@custom_op("dynctx::mla_latent_append", mutates_args=("latent_cache",))
def _mla_latent_append_op(latent_cache: torch.Tensor, kv_latent: torch.Tensor, k_rope: torch.Tensor,
                          block_ids: torch.Tensor, slots: torch.Tensor,
                          latent_scale: torch.Tensor | None = None,
                          rope_scale: torch.Tensor | None = None) -> None:
    mla_latent_append(latent_cache, kv_latent, k_rope, block_ids, slots,
                      latent_scale=latent_scale, rope_scale=rope_scale, backend=None)


@_mla_latent_append_op.register_fake
def _mla_latent_append_fake(latent_cache, kv_latent, k_rope, block_ids, slots, latent_scale=None,
                            rope_scale=None) -> None:
    return None


mla_latent_append_op = torch.ops.dynctx.mla_latent_append
