"""The FP8 KV cache options: the cache dtype and the scales, checked at construction; and the
rule that calibrates dynamic scales (docs/SEMANTICS.md §20).

``kv_cache_dtype``: None (the default) or ``params_dtype`` keeps today's cache; ``"fp8"`` or
``torch.float8_e4m3fn`` stores e4m3, ``torch.float8_e5m2`` e5m2. Any other dtype is refused.

``kv_scales`` (FP8 only): ``"dynamic"`` (the default: one scale per layer for K and one for V),
``"dynamic_per_head"`` (one per KV head), or given values (from a checkpoint): a tensor or
nested sequence ``[2, layers]`` (per layer) or ``[2, layers, heads]`` (per KV head this rank
stores), index 0 for K and 1 for V, positive and finite. With ``cache_mla_latent`` the two rows
are the latent (``kv_lora_rank``) part and the rope key part, per layer only. A stored value
``x`` is ``fp8(clamp(x / scale, -max, max))`` (kernels/fp8.py) and reads back as ``q * scale``.

Dynamic scales are calibrated once per attention layer, by the first forward pass that writes
the layer's K/V with real tokens (the first prefill; CUDA graph capture steps, whose tokens are
dummies, never calibrate): ``scale = DYNAMIC_HEADROOM * amax / max`` over the step's real
tokens (padding excluded), per layer or per KV head, with ``amax`` the absolute maximum (an
all-zero or non-finite ``amax`` gives scale 1). They are computed on the device and never read
back; they are kept for the context's lifetime (suspend/resume and ``reset`` keep them), so
later values past ``DYNAMIC_HEADROOM`` times the first prefill's maximum saturate.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from dynctx.kernels.fp8 import FP8_FORMATS, is_fp8

# Dynamic scales leave this factor of room above the first prefill's absolute maximum: one
# binade of e4m3 (bench/fp8_kv.py measures the choice).
DYNAMIC_HEADROOM = 2.0
DYNAMIC_MODES = ("dynamic", "dynamic_per_head")
_NAMES = {"fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}


class ScaleSpec(NamedTuple):
    """What the scales are: ``mode`` ``"dynamic"``, ``"dynamic_per_head"`` or ``"given"``; the
    given values ``[2, layers, heads]`` fp32 on the CPU (None when dynamic)."""

    mode: str
    values: Optional[torch.Tensor]


def resolve_kv_cache_dtype(kv_cache_dtype: Any, params_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype: ``params_dtype`` (None), or an FP8 dtype; anything else raises."""
    if kv_cache_dtype is None:
        return params_dtype
    dtype = _NAMES.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else kv_cache_dtype
    if not isinstance(dtype, torch.dtype) or not (dtype == params_dtype or is_fp8(dtype)):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} must be None or params_dtype={params_dtype} "
            f"(the cache as it is), 'fp8' or torch.float8_e4m3fn, or torch.float8_e5m2")
    return dtype


def check_kv_scales(kv_scales: Any, kv_dtype: torch.dtype, layers: int, heads: int,
                    mla: bool) -> Optional[ScaleSpec]:
    """The scales of an FP8 cache of ``layers`` attention layers of ``heads`` KV heads (MLA:
    one "head", the latent and rope rows); None for a cache that is not FP8 (``kv_scales``
    must then be left at ``"dynamic"``)."""
    if not is_fp8(kv_dtype):
        if not (isinstance(kv_scales, str) and kv_scales == "dynamic"):
            raise ValueError(f"kv_scales={_describe(kv_scales)} needs an FP8 kv_cache_dtype "
                             f"(the cache is {kv_dtype})")
        return None
    if isinstance(kv_scales, str):
        if kv_scales not in DYNAMIC_MODES:
            raise ValueError(f"kv_scales={kv_scales!r} must be one of {DYNAMIC_MODES} or "
                             f"given scales [2, {layers}] / [2, {layers}, {heads}]")
        if mla and kv_scales == "dynamic_per_head":
            raise ValueError("kv_scales='dynamic_per_head' is for the K/V cache; the MLA latent "
                             "cache has one scale per layer for each part: use 'dynamic'")
        return ScaleSpec(kv_scales, None)
    if isinstance(kv_scales, torch.Tensor) and (kv_scales.dtype.is_complex
                                                or kv_scales.dtype == torch.bool):
        raise TypeError(f"kv_scales must hold real numbers, got dtype {kv_scales.dtype}")
    try:
        values = torch.as_tensor(kv_scales).detach().to("cpu", torch.float32)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"kv_scales must be 'dynamic', 'dynamic_per_head' or a tensor of "
                        f"scales, got {_describe(kv_scales)} ({error})") from None
    shapes = [(2, layers)] + ([] if mla else [(2, layers, heads)])
    if tuple(values.shape) not in shapes:
        what = "latent and rope scales per layer" if mla else "K and V scales per layer or " \
            "per KV head of this rank"
        raise ValueError(f"kv_scales has shape {tuple(values.shape)}, expected "
                         f"{' or '.join(str(list(s)) for s in shapes)} ({what})")
    bad = ~(values.isfinite() & (values > 0))
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"kv_scales{list(index)}={values[index].item()} must be positive and "
                         "finite (a stored value reads back as q * scale)")
    if values.dim() == 2:
        values = values[:, :, None].expand(2, layers, heads)
    return ScaleSpec("given", values.contiguous())


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return repr(value)


def dynamic_scale(x: torch.Tensor, kv_dtype: torch.dtype, per_head: bool,
                  heads: int) -> torch.Tensor:
    """``DYNAMIC_HEADROOM * amax / max`` of ``x`` ``[tokens, heads, D]`` (or ``[tokens, D]``),
    per head or over all (broadcast to ``[heads]``), fp32, on ``x``'s device; no read-back."""
    fmax = FP8_FORMATS[kv_dtype].max
    magnitude = x.detach().abs().float()
    if per_head:
        amax = magnitude.amax(dim=(0, 2)) if magnitude.numel() else \
            torch.zeros(heads, device=x.device)
    else:
        amax = (magnitude.amax() if magnitude.numel() else
                torch.zeros((), device=x.device)).expand(heads)
    usable = amax.isfinite() & (amax > 0)
    return torch.where(usable, amax * (DYNAMIC_HEADROOM / fmax), torch.ones_like(amax))
