"""FP8 KV blocks: the two formats, the rounding both the kernels and the references apply, and
the scale checks the launchers share.

A cached value ``x`` is stored as ``q = fp8(clamp(x / scale, -max, max))``, rounded to nearest
(ties to even), and read back as ``q * scale``: saturating, so an outlier past ``max * scale``
costs its excess and never becomes inf or NaN. ``scale`` is fp32, one per KV head (a per-layer
scale is the same value for every head).

The kernels round in fp32 arithmetic themselves (``round_to_fp8``) and only then convert a value
that the format holds exactly: Triton's interpreter converts fp32 to fp8 without carrying a
rounded-up mantissa into the exponent (0.123 -> 0.0625), rounds ties away from zero and
mishandles subnormals, whereas an exactly representable value converts exactly there and on a
GPU. So the kernels are bit-exact against ``quantize_ref`` on both.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .backend import HAS_TRITON
from .devices import same_device

if HAS_TRITON:
    import triton
    import triton.language as tl


class Fp8Format(NamedTuple):
    """Mantissa bits, the smallest normal exponent and the largest finite value."""

    mantissa_bits: int
    min_exponent: int
    max: float


FP8_FORMATS = {torch.float8_e4m3fn: Fp8Format(3, -6, 448.0),
               torch.float8_e5m2: Fp8Format(2, -14, 57344.0)}
FP8_DTYPES = tuple(FP8_FORMATS)
# What an FP8 cache takes in: K/V in any of the float dtypes.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def fp8_constexprs(dtype: torch.dtype) -> dict:
    """The ``round_to_fp8`` constants of a cache dtype, as kernel keyword arguments (zeros for
    a cache that is not FP8: the kernels then never round)."""
    fmt = FP8_FORMATS.get(dtype)
    if fmt is None:
        return dict(FP8_MANTISSA=0, FP8_MIN_EXP=0, FP8_MAX=0.0)
    return dict(FP8_MANTISSA=fmt.mantissa_bits, FP8_MIN_EXP=fmt.min_exponent, FP8_MAX=fmt.max)


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference: ``x / scale`` in fp32 (``scale`` broadcasts over ``x``'s leading dims),
    saturated to the format's largest value and rounded to nearest even by torch's cast."""
    fmax = FP8_FORMATS[dtype].max
    return (x.float() / scale.float()).clamp(-fmax, fmax).to(dtype)


def dequantize_ref(q: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Reference: ``q * scale`` in fp32 (no scale: ``q`` as fp32)."""
    return q.float() if scale is None else q.float() * scale.float()


def check_head_scale(name: str, scale, heads: int, device: torch.device) -> torch.Tensor:
    """A per-KV-head scale: fp32 ``[heads]`` (any stride: a per-layer scale may be an expanded
    view) on ``device``. Values are not read (that would sync): the context checks the scales
    it is given once, at construction."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [{heads}] of fp32 scales, got "
                        f"{type(scale).__name__}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (heads,):
        raise ValueError(f"{name} must be fp32 [{heads}] (one scale per KV head), got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    if not same_device(scale.device, device):
        raise ValueError(f"{name} is on {scale.device}, the cache on {device}")
    return scale


if HAS_TRITON:

    @triton.jit
    def round_to_fp8(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, FMAX: tl.constexpr):
        """``x`` (fp32) saturated to ``[-FMAX, FMAX]`` and rounded to nearest even at the
        precision of an fp8 format with ``MANTISSA`` bits and smallest normal exponent
        ``MIN_EXP``; returns fp32 that the format holds exactly (sign of zero kept).

        Adding and subtracting ``1.5 * 2**23 * ulp`` rounds to a multiple of ``ulp`` (the
        fp8 spacing at ``x``'s exponent, subnormals included) in fp32's own round-to-nearest."""
        magnitude = tl.minimum(tl.abs(x), FMAX)
        exponent = tl.maximum((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXP + 127)
        magic = (((exponent - MANTISSA + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
        rounded = (magnitude + magic) - magic
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
