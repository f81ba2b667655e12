"""The rotation both rope kernels share (``rope.py``, ``rope_kv_append.py``).

Jit helpers for the pair layouts, the cos/sin of each pair and the in-place rotation of a tile
of heads; the argument checks (``check_rope_args`` -> ``RopeProblem``); Megatron's and
FlashInfer's rotation tables; the tile search space and tune-time check both tunings use. The
layouts and their derivation: ``kernels/README.md`` "Rope layouts".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._common import FLOAT_DTYPES, check_writable, next_pow2
from .autotune import KernelConfig, TuneCase, bucket_tokens, dtype_name
from .backend import HAS_TRITON
from .devices import same_device

if HAS_TRITON:
    import triton
    import triton.language as tl

LAYOUTS = ("neox", "gptj", "mla", "mla_gptj")
TABLES = ("cos_sin", "freqs")

if HAS_TRITON:

    @triton.jit
    def _rope_pair_offsets(LAYOUT: tl.constexpr, ROT_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr):
        """Per rotation pair i: the dims it reads (in1, in2) and writes (out1, out2)."""
        HALF: tl.constexpr = ROT_DIM // 2
        offs_pair = tl.arange(0, HALF_BLOCK)
        if LAYOUT == 0:
            out1 = offs_pair
            out2 = offs_pair + HALF
            in1 = out1
            in2 = out2
        elif LAYOUT == 1:
            out1 = 2 * offs_pair
            out2 = out1 + 1
            in1 = out1
            in2 = out2
        elif LAYOUT == 2:
            # MLA: read the interleaved pair, write it back half-split
            in1 = 2 * offs_pair
            in2 = in1 + 1
            out1 = offs_pair
            out2 = offs_pair + HALF
        else:
            # MLA de-interleave, then interleaved pairs of the de-interleaved vector
            out1 = 2 * offs_pair
            out2 = out1 + 1
            in1 = tl.where(out1 < HALF, 2 * out1, 2 * (out1 - HALF) + 1)
            in2 = tl.where(out2 < HALF, 2 * out2, 2 * (out2 - HALF) + 1)
        return offs_pair, offs_pair < HALF, in1, in2, out1, out2

    @triton.jit
    def _rope_cos_sin(table_ptr, positions, mask_t, stride_table_pos, stride_table_dim, offs_pair,
                      mask_pair, out1, out2, mscale, ROT_DIM: tl.constexpr,
                      TABLE_IS_FREQS: tl.constexpr):
        """cos/sin for the two outputs of every pair, [BLOCK_T, 1, HALF_BLOCK] each, fp32."""
        rows = table_ptr + positions[:, None] * stride_table_pos
        mask = mask_t[:, None] & mask_pair[None, :]
        if TABLE_IS_FREQS:
            # Megatron gives each output dim p its own angle freqs[pos, p]
            angle1 = tl.load(rows + out1[None, :] * stride_table_dim, mask=mask,
                             other=0.0).to(tl.float32)
            angle2 = tl.load(rows + out2[None, :] * stride_table_dim, mask=mask,
                             other=0.0).to(tl.float32)
            cos1 = tl.cos(angle1) * mscale
            sin1 = tl.sin(angle1) * mscale
            cos2 = tl.cos(angle2) * mscale
            sin2 = tl.sin(angle2) * mscale
        else:
            cos1 = tl.load(rows + offs_pair[None, :] * stride_table_dim, mask=mask,
                           other=0.0).to(tl.float32) * mscale
            sin1 = tl.load(rows + ((ROT_DIM // 2) + offs_pair[None, :]) * stride_table_dim,
                           mask=mask, other=0.0).to(tl.float32) * mscale
            cos2 = cos1
            sin2 = sin1
        return cos1[:, None, :], sin1[:, None, :], cos2[:, None, :], sin2[:, None, :]

    @triton.jit
    def _rope_rotate_tile(x_ptr, offs_t, mask_t, offs_h, mask_h, stride_x_token, stride_x_head,
                          stride_x_dim, in1, in2, out1, out2, mask_pair, cos1, sin1, cos2, sin2,
                          PERMUTES: tl.constexpr):
        """Rotate a [BLOCK_T, BLOCK_H] tile of heads in place; returns the fp32 outputs."""
        rows = (x_ptr + offs_t[:, None, None] * stride_x_token
                + offs_h[None, :, None] * stride_x_head)
        mask = mask_t[:, None, None] & mask_h[None, :, None] & mask_pair[None, None, :]
        # [BLOCK_T, BLOCK_H, HALF_BLOCK]
        x1 = tl.load(rows + in1[None, None, :] * stride_x_dim, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(rows + in2[None, None, :] * stride_x_dim, mask=mask, other=0.0).to(tl.float32)
        out_first = x1 * cos1 - x2 * sin1
        out_second = x2 * cos2 + x1 * sin2
        if PERMUTES:
            # MLA layouts write dims that other threads read: every load lands before any store
            tl.debug_barrier()
        tl.store(rows + out1[None, None, :] * stride_x_dim, out_first.to(x_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(rows + out2[None, None, :] * stride_x_dim, out_second.to(x_ptr.dtype.element_ty),
                 mask=mask)
        return out_first, out_second

    @triton.jit
    def _rope_rotate_program(x_ptr, table_ptr, positions_ptr, head_tile, num_tokens, num_heads,
                             mscale, stride_x_token, stride_x_head, stride_x_dim, stride_table_pos,
                             stride_table_dim, stride_positions, ROT_DIM: tl.constexpr,
                             HALF_BLOCK: tl.constexpr, LAYOUT: tl.constexpr,
                             TABLE_IS_FREQS: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_H: tl.constexpr):
        """Rotate this program's [BLOCK_T] tokens x head tile ``head_tile`` of ``x`` in place.

        Returns the tile's offsets and masks, the output dims of each pair and the fp32 outputs,
        for a caller that also writes them elsewhere (rope + KV append).
        """
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < num_tokens
        positions = tl.load(positions_ptr + offs_t * stride_positions, mask=mask_t,
                            other=0).to(tl.int64)
        offs_pair, mask_pair, in1, in2, out1, out2 = _rope_pair_offsets(LAYOUT, ROT_DIM, HALF_BLOCK)
        cos1, sin1, cos2, sin2 = _rope_cos_sin(table_ptr, positions, mask_t, stride_table_pos,
                                               stride_table_dim, offs_pair, mask_pair, out1, out2,
                                               mscale, ROT_DIM, TABLE_IS_FREQS)
        offs_h = (head_tile * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask_h = offs_h < num_heads
        out_first, out_second = _rope_rotate_tile(
            x_ptr, offs_t, mask_t, offs_h, mask_h, stride_x_token, stride_x_head, stride_x_dim,
            in1, in2, out1, out2, mask_pair, cos1, sin1, cos2, sin2, LAYOUT >= 2)
        return offs_t, mask_t, offs_h, mask_h, mask_pair, out1, out2, out_first, out_second


@dataclass(frozen=True)
class RopeProblem:
    """Validated rope arguments: 3-D head views, the 2-D table and the static dimensions."""

    query: Optional[torch.Tensor]
    key: Optional[torch.Tensor]
    positions: torch.Tensor
    table: torch.Tensor
    table_kind: str
    layout: str
    rot_dim: int
    head_dim: int
    num_tokens: int

    @property
    def num_q_heads(self) -> int:
        return 0 if self.query is None else self.query.shape[1]

    @property
    def num_k_heads(self) -> int:
        return 0 if self.key is None else self.key.shape[1]

    def tune_key(self) -> dict:
        dtype = (self.query if self.query is not None else self.key).dtype
        return fused_qk_rope_tune_key(
            num_tokens=self.num_tokens, num_q_heads=self.num_q_heads,
            num_k_heads=self.num_k_heads, head_dim=self.head_dim, rot_dim=self.rot_dim,
            layout=self.layout, table=self.table_kind, dtype=dtype)


def as_head_view(x: torch.Tensor, name: str, num_tokens: int) -> torch.Tensor:
    """``[T, H, D]`` or ``[T, 1, H, D]`` -> a ``[T, H, D]`` view (any strides), T >= n."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() == 4:
        if x.shape[1] != 1:
            raise ValueError(f"{name} of shape {tuple(x.shape)}: a 4-D {name} needs dim 1 == 1")
        x = x[:, 0]
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D] or [T, 1, H, D], got {tuple(x.shape)}")
    if x.shape[0] < num_tokens:
        raise ValueError(f"{name} has {x.shape[0]} rows, fewer than positions.numel()={num_tokens}")
    return x


def check_rope_args(query, key, positions, cos_sin_cache, freqs, interleaved: bool,
                    mla_layout: bool) -> RopeProblem:
    """Validate dtype, shape, device and strides; raise ``ValueError`` naming the argument."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
        raise ValueError("positions must be a 1-D tensor")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    num_tokens = positions.numel()
    if query is None and key is None:
        raise ValueError("query and key are both None: nothing to rotate")
    if (cos_sin_cache is None) == (freqs is None):
        raise ValueError("give exactly one of cos_sin_cache and freqs")
    if cos_sin_cache is not None:
        table, table_name, table_kind = cos_sin_cache, "cos_sin_cache", "cos_sin"
        if table.dim() != 2:
            raise ValueError(f"cos_sin_cache must be [max_pos, rot], got {tuple(table.shape)}")
    else:
        table, table_name, table_kind = freqs, "freqs", "freqs"
        if table.dim() == 4 and table.shape[1] == 1 and table.shape[2] == 1:
            table = table[:, 0, 0]
        if table.dim() != 2:
            raise ValueError(f"freqs must be [max_pos, 1, 1, rot] or [max_pos, rot], "
                             f"got {tuple(freqs.shape)}")
    if table.dtype != torch.float32:
        raise ValueError(f"{table_name} must be float32, got {table.dtype}")
    rot_dim = table.shape[1]
    if rot_dim < 2 or rot_dim % 2:
        raise ValueError(f"{table_name}: rotary dim {rot_dim} must be even and >= 2")
    views = {}
    for name, x in (("query", query), ("key", key)):
        if x is None:
            continue
        x = as_head_view(x, name, num_tokens)
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
        if rot_dim > x.shape[2]:
            raise ValueError(f"{name} head dim {x.shape[2]} is smaller than the rotary dim "
                             f"{rot_dim}")
        check_writable((name, x[:num_tokens]))
        views[name] = x
    first = views.get("query", views.get("key"))
    for name, x in views.items():
        if x.dtype != first.dtype or x.shape[2] != first.shape[2]:
            raise ValueError(f"{name}: query and key need the same dtype and head dim")
    for name, x in (*views.items(), ("positions", positions), (table_name, table)):
        if not same_device(x.device, first.device):
            raise ValueError(f"{name} is on {x.device}, expected {first.device}")
    layout = LAYOUTS[int(bool(interleaved)) + 2 * int(bool(mla_layout))]
    return RopeProblem(views.get("query"), views.get("key"), positions, table, table_kind, layout,
                       rot_dim, first.shape[2], num_tokens)


def rope_meta(problem: RopeProblem) -> dict:
    """Constexpr meta-parameters shared by the rope kernels."""
    return {"ROT_DIM": problem.rot_dim, "HALF_BLOCK": next_pow2(problem.rot_dim // 2),
            "LAYOUT": LAYOUTS.index(problem.layout),
            "TABLE_IS_FREQS": problem.table_kind == "freqs"}


def cos_sin_cache_from_freqs(freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Megatron's angle table -> FlashInfer's ``[max_pos, rot]`` fp32 ``cat(cos f, sin f)``."""
    freqs = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    angles = freqs[:, 0::2] if interleaved else freqs[:, : freqs.shape[1] // 2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


def make_rope_tables(max_pos: int, rot_dim: int, interleaved: bool, *, base: float = 10000.0,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(freqs [max_pos, 1, 1, rot], cos_sin_cache [max_pos, rot])`` as Megatron builds them."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device)
                              / rot_dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=device), inv_freq)
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), -1)
    return emb[:, None, None, :].contiguous(), cos_sin_cache_from_freqs(emb, interleaved)


MAX_BLOCK_ELEMENTS = 8192


def rope_block_configs(row_block: int, num_heads: int,
                       max_elements: int = MAX_BLOCK_ELEMENTS) -> list[KernelConfig]:
    """Tiles of ``BLOCK_T`` tokens x ``BLOCK_H`` heads x ``row_block`` dims, capped in size.

    The largest tiles take 8 warps only: at 4 their sm_90 builds spill
    (tests/kernels/test_sm90_build.py)."""
    head_cap = next_pow2(max(1, num_heads))
    configs = []
    for block_t in (1, 4, 16):
        for block_h in (1, 4, 8):
            elements = block_t * block_h * row_block
            if block_h > head_cap or elements > max_elements:
                continue
            warps = ((1, 4) if elements <= 512 else (8,) if elements >= MAX_BLOCK_ELEMENTS
                     else (4, 8) if elements >= 4096 else (4,))
            configs += [KernelConfig.make(BLOCK_T=block_t, BLOCK_H=block_h, num_warps=w)
                        for w in warps]
    return configs


def rope_block_default(row_block: int, num_heads: int, num_tokens: int,
                       max_elements: int = MAX_BLOCK_ELEMENTS) -> KernelConfig:
    """Decode: one token, four heads per program; prefill: more tokens per program."""
    block_t = 1 if num_tokens <= 16 else 4 if num_tokens <= 256 else 16
    block_h = min(4, next_pow2(max(1, num_heads)))
    while block_t > 1 and block_t * block_h * row_block > max_elements:
        block_t //= 4
    elements = block_t * block_h * row_block
    return KernelConfig.make(BLOCK_T=block_t, BLOCK_H=block_h,
                             num_warps=1 if elements <= 512 else
                             8 if elements >= MAX_BLOCK_ELEMENTS else 4)


def fused_qk_rope_tune_key(*, num_tokens: int, num_q_heads: int, num_k_heads: int, head_dim: int,
                           rot_dim: int, layout: str, table: str, dtype) -> dict:
    if layout not in LAYOUTS or table not in TABLES:
        raise ValueError(f"layout={layout!r} / table={table!r}: expected {LAYOUTS} / {TABLES}")
    return {"num_tokens": bucket_tokens(num_tokens), "num_q_heads": int(num_q_heads),
            "num_k_heads": int(num_k_heads), "head_dim": int(head_dim), "rot_dim": int(rot_dim),
            "layout": layout, "table": table,
            "dtype": dtype if isinstance(dtype, str) else dtype_name(dtype)}


def _tune_check_bound(expected: torch.Tensor, dtype: torch.dtype,
                      input_scale: float) -> torch.Tensor:
    """The tune-time acceptance bound of a candidate config (not a test tolerance: the tests
    state theirs in ``tests/tolerances.py``): one ulp of ``dtype`` at the fp32 reference value,
    plus 8 fp32 eps times the input scale for fp32 cos/sin and FMA differences."""
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
    exponent = torch.frexp(expected.float()).exponent
    ulp = torch.ldexp(torch.ones_like(expected, dtype=torch.float32), exponent - 1 - mantissa)
    ulp = torch.where(expected == 0, torch.zeros_like(ulp), ulp)
    return ulp + 8 * torch.finfo(torch.float32).eps * input_scale


def tune_check_rotation(actual: torch.Tensor, expected: torch.Tensor, input_scale: float,
                        name: str = "output") -> None:
    """A tune case's check: ``actual`` within ``_tune_check_bound`` of the fp32 ``expected``."""
    error = (actual.float() - expected.float()).abs()
    allowed = _tune_check_bound(expected, actual.dtype, input_scale)
    bad = ~(error <= allowed)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} elements differ, first at "
                             f"{index}: {float(actual[index])} vs {float(expected[index])} "
                             f"(allowed {float(allowed[index]):.3g})")


class RopeTuneCase(TuneCase):
    """Base of the rope tune cases: the key's layout flags, table and random positions."""

    def _init_rope(self, key: dict, device: torch.device) -> torch.Generator:
        """Set ``interleaved``, ``mla_layout``, ``table`` and ``positions``; return the seeded
        generator, positions drawn, for the rest of the scratch inputs."""
        n = key["num_tokens"]
        self.interleaved = key["layout"] in ("gptj", "mla_gptj")
        self.mla_layout = key["layout"].startswith("mla")
        max_pos = max(4096, n)
        freqs, cos_sin = make_rope_tables(max_pos, key["rot_dim"], self.interleaved, device=device)
        self.table = {"freqs": freqs} if key["table"] == "freqs" else {"cos_sin_cache": cos_sin}
        generator = torch.Generator(device="cpu").manual_seed(0)
        self.positions = torch.randint(0, max_pos, (n,), generator=generator).to(device)
        return generator
