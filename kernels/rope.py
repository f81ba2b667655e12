"""Fused QK rope: rotate query and key in place from per-token positions, one launch for both.

The rotation table is either FlashInfer's ``cos_sin_cache [max_pos, rot]`` (cos of the rot/2
angles, then their sin; fp32) or Megatron's angle table ``freqs [max_pos, 1, 1, rot]`` /
``[max_pos, rot]`` (fp32 angles laid out as Megatron's ``RotaryEmbedding`` returns them:
``cat(f, f)`` for the half-split layout, ``f`` repeated pairwise for the interleaved one).
Layouts (``kernels/README.md``): half-split ("neox"), interleaved ("gptj", pairs ``2i, 2i+1``),
and Megatron's ``multi_latent_attention`` de-interleave (``mla_layout=True``): the rotary dims
are read as pairs ``2i, 2i+1`` and written back half-split, which is what
``_apply_rotary_pos_emb_bshd(..., multi_latent_attention=True)`` returns. With ``freqs`` every
output dim ``p`` uses the angle ``freqs[pos, p]`` exactly as Megatron does. ``mscale``
multiplies cos and sin. Dims ``>= rot`` are left untouched. Math in fp32, cast on store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _autotune
from ._autotune import KernelConfig, KernelTuning, TuneCase, bucket_tokens, dtype_name
from ._backend import HAS_TRITON, resolve_backend
from ._common import FLOAT_DTYPES, check_writable, custom_op, next_pow2
from ._shapes import DEEPSEEK_V2_LITE, LLAMA_3_8B

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
                             stride_table_dim, stride_positions, ROT_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, LAYOUT: tl.constexpr,
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

    @triton.heuristics({"HAS_QUERY": lambda args: args["query_ptr"] is not None,
                        "HAS_KEY": lambda args: args["key_ptr"] is not None})
    @triton.jit
    def _fused_qk_rope_kernel(
        query_ptr, key_ptr,
        table_ptr, positions_ptr,
        num_tokens, num_q_heads, num_k_heads, mscale,
        stride_query_token, stride_query_head, stride_query_dim,
        stride_key_token, stride_key_head, stride_key_dim,
        stride_table_pos, stride_table_dim, stride_positions,
        ROT_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, LAYOUT: tl.constexpr,
        TABLE_IS_FREQS: tl.constexpr, HAS_QUERY: tl.constexpr, HAS_KEY: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """Grid (token tiles, query head tiles + key head tiles)."""
        pid_h = tl.program_id(1)
        num_q_tiles = tl.cdiv(num_q_heads, BLOCK_H)
        if HAS_QUERY:
            if pid_h < num_q_tiles:
                _rope_rotate_program(query_ptr, table_ptr, positions_ptr, pid_h, num_tokens,
                                     num_q_heads, mscale, stride_query_token, stride_query_head,
                                     stride_query_dim, stride_table_pos, stride_table_dim,
                                     stride_positions, ROT_DIM, HALF_BLOCK, LAYOUT,
                                     TABLE_IS_FREQS, BLOCK_T, BLOCK_H)
        if HAS_KEY:
            if pid_h >= num_q_tiles:
                _rope_rotate_program(key_ptr, table_ptr, positions_ptr, pid_h - num_q_tiles,
                                     num_tokens, num_k_heads, mscale, stride_key_token,
                                     stride_key_head, stride_key_dim, stride_table_pos,
                                     stride_table_dim, stride_positions, ROT_DIM, HALF_BLOCK,
                                     LAYOUT, TABLE_IS_FREQS, BLOCK_T, BLOCK_H)


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
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device}, expected {first.device}")
    layout = LAYOUTS[int(bool(interleaved)) + 2 * int(bool(mla_layout))]
    return RopeProblem(views.get("query"), views.get("key"), positions, table, table_kind, layout,
                       rot_dim, first.shape[2], num_tokens)


def rope_meta(problem: RopeProblem) -> dict:
    """Constexpr meta-parameters shared by the rope kernels."""
    return {"ROT_DIM": problem.rot_dim, "HALF_BLOCK": next_pow2(problem.rot_dim // 2),
            "LAYOUT": LAYOUTS.index(problem.layout),
            "TABLE_IS_FREQS": problem.table_kind == "freqs"}


def fused_qk_rope(query: Optional[torch.Tensor], key: Optional[torch.Tensor],
                  positions: torch.Tensor, *, cos_sin_cache: Optional[torch.Tensor] = None,
                  freqs: Optional[torch.Tensor] = None, interleaved: bool = False,
                  mscale: float = 1.0, mla_layout: bool = False,
                  config: KernelConfig | None = None, backend: str | None = None) -> None:
    """Rotate ``query[:n]`` and ``key[:n]`` IN PLACE, ``n = positions.numel()``; one launch.

    query: ``[>=n, Hq, D]`` or ``[>=n, 1, Hq, D]``, fp32/fp16/bf16, any strides; or None.
        key: the same with ``Hk`` heads, same dtype and ``D``. Both are rotated in place through
        their own strides; query and key must not overlap (not checked).
    positions: ``[n]`` int32/int64, any stride; each must be ``< max_pos`` (not checked: no sync).
    cos_sin_cache: ``[max_pos, rot]`` fp32, cos then sin (FlashInfer); or
    freqs: ``[max_pos, 1, 1, rot]`` / ``[max_pos, rot]`` fp32 angles (Megatron). Exactly one;
        any strides.
    interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of half-split ``(i, i + rot/2)``.
    mla_layout: Megatron's ``multi_latent_attention`` de-interleave (read pairs, write half-split).
    mscale: multiplies cos and sin. Rows ``>= n`` and dims ``>= rot`` are never touched.
    """
    problem = check_rope_args(query, key, positions, cos_sin_cache, freqs, interleaved, mla_layout)
    if problem.num_tokens == 0:
        return
    device = positions.device
    if resolve_backend(backend, device) == "torch":
        fused_qk_rope_ref(query, key, positions, cos_sin_cache=cos_sin_cache, freqs=freqs,
                          interleaved=interleaved, mscale=mscale, mla_layout=mla_layout)
        return
    if config is None:
        config, _ = _autotune.resolve_config("fused_qk_rope", problem.tune_key(), device)
    block_t, block_h = config.kwargs["BLOCK_T"], config.kwargs["BLOCK_H"]
    q, k = problem.query, problem.key
    grid = (triton.cdiv(problem.num_tokens, block_t),
            triton.cdiv(problem.num_q_heads, block_h) + triton.cdiv(problem.num_k_heads, block_h))
    _fused_qk_rope_kernel[grid](
        query_ptr=q, key_ptr=k,
        table_ptr=problem.table, positions_ptr=positions,
        num_tokens=problem.num_tokens, num_q_heads=problem.num_q_heads,
        num_k_heads=problem.num_k_heads, mscale=float(mscale),
        stride_query_token=0 if q is None else q.stride(0),
        stride_query_head=0 if q is None else q.stride(1),
        stride_query_dim=0 if q is None else q.stride(2),
        stride_key_token=0 if k is None else k.stride(0),
        stride_key_head=0 if k is None else k.stride(1),
        stride_key_dim=0 if k is None else k.stride(2),
        stride_table_pos=problem.table.stride(0), stride_table_dim=problem.table.stride(1),
        stride_positions=positions.stride(0),
        **rope_meta(problem), **config.launch_kwargs(),
    )


def flashinfer_rope_available(device) -> bool:
    """True when ``apply_rope_flashinfer`` can run on ``device``: CUDA, flashinfer importable."""
    import importlib.util

    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available()
            and importlib.util.find_spec("flashinfer") is not None)


def apply_rope_flashinfer(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, interleaved: bool) -> None:
    """Rotate ``query[:n]``/``key[:n]`` in place with FlashInfer's fused rope (CUDA only).

    Shapes as ``fused_qk_rope``; each of ``query[:n]``/``key[:n]`` must be viewable as
    ``[n, H * D]``. Raises ``RuntimeError`` when CUDA or flashinfer is missing.
    """
    if query.device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"apply_rope_flashinfer needs CUDA tensors and a CUDA device; "
                           f"query is on {query.device}")
    try:
        import flashinfer.rope
    except ImportError as error:
        raise RuntimeError("apply_rope_flashinfer needs flashinfer (flashinfer-python), "
                           f"which is not importable: {error}") from error
    n = positions.numel()
    q = as_head_view(query, "query", n)[:n]
    k = as_head_view(key, "key", n)[:n]
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
        positions=positions, query=q.view(n, -1), key=k.view(n, -1), head_size=q.shape[-1],
        cos_sin_cache=cos_sin_cache, is_neox=not interleaved)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def cos_sin_cache_from_freqs(freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Megatron's angle table -> FlashInfer's ``[max_pos, rot]`` fp32 ``cat(cos f, sin f)``."""
    freqs = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    angles = freqs[:, 0::2] if interleaved else freqs[:, : freqs.shape[1] // 2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


def _emb_cos_sin(positions, cos_sin_cache, freqs, interleaved: bool, mscale: float):
    """Per-token cos/sin ``[n, rot]`` in Megatron's layout (one angle per output dim)."""
    if freqs is not None:
        emb = freqs.reshape(freqs.shape[0], freqs.shape[-1])[positions.long()]
        return torch.cos(emb) * mscale, torch.sin(emb) * mscale
    table = cos_sin_cache[positions.long()]
    cos, sin = table.chunk(2, dim=-1)
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos * mscale, sin * mscale


def fused_qk_rope_ref(query, key, positions, *, cos_sin_cache=None, freqs=None,
                      interleaved: bool = False, mscale: float = 1.0,
                      mla_layout: bool = False) -> None:
    """Readable torch reference of ``fused_qk_rope`` (in place, fp32 math, cast on store)."""
    n = positions.numel()
    cos, sin = _emb_cos_sin(positions, cos_sin_cache, freqs, interleaved, mscale)
    rot = cos.shape[-1]
    for x in (query, key):
        if x is None or n == 0:
            continue
        heads = x[:, 0] if x.dim() == 4 else x
        rotary = heads[:n, :, :rot].float()
        if mla_layout:
            rotary = torch.cat((rotary[..., 0::2], rotary[..., 1::2]), dim=-1)
        rotated = rotary * cos[:, None] + _rotate_half(rotary, interleaved) * sin[:, None]
        heads[:n, :, :rot] = rotated.to(x.dtype)


def make_rope_tables(max_pos: int, rot_dim: int, interleaved: bool, *, base: float = 10000.0,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(freqs [max_pos, 1, 1, rot], cos_sin_cache [max_pos, rot])`` as Megatron builds them."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device)
                              / rot_dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=device), inv_freq)
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), -1)
    return emb[:, None, None, :].contiguous(), cos_sin_cache_from_freqs(emb, interleaved)


MAX_BLOCK_ELEMENTS = 8192


def rope_block_configs(row_block: int, num_heads: int) -> list[KernelConfig]:
    """Tiles of ``BLOCK_T`` tokens x ``BLOCK_H`` heads x ``row_block`` dims, capped in size."""
    head_cap = next_pow2(max(1, num_heads))
    configs = []
    for block_t in (1, 4, 16):
        for block_h in (1, 4, 8):
            elements = block_t * block_h * row_block
            if block_h > head_cap or elements > MAX_BLOCK_ELEMENTS:
                continue
            warps = (1, 4) if elements <= 512 else (4, 8) if elements >= 4096 else (4,)
            configs += [KernelConfig.make(BLOCK_T=block_t, BLOCK_H=block_h, num_warps=w)
                        for w in warps]
    return configs


def rope_block_default(row_block: int, num_heads: int, num_tokens: int) -> KernelConfig:
    """Decode: one token, four heads per program; prefill: more tokens per program."""
    block_t = 1 if num_tokens <= 16 else 4 if num_tokens <= 256 else 16
    block_h = min(4, next_pow2(max(1, num_heads)))
    while block_t > 1 and block_t * block_h * row_block > MAX_BLOCK_ELEMENTS:
        block_t //= 4
    elements = block_t * block_h * row_block
    return KernelConfig.make(BLOCK_T=block_t, BLOCK_H=block_h,
                             num_warps=1 if elements <= 512 else 4)


def fused_qk_rope_tune_key(*, num_tokens: int, num_q_heads: int, num_k_heads: int, head_dim: int,
                           rot_dim: int, layout: str, table: str, dtype) -> dict:
    if layout not in LAYOUTS or table not in TABLES:
        raise ValueError(f"layout={layout!r} / table={table!r}: expected {LAYOUTS} / {TABLES}")
    return {"num_tokens": bucket_tokens(num_tokens), "num_q_heads": int(num_q_heads),
            "num_k_heads": int(num_k_heads), "head_dim": int(head_dim), "rot_dim": int(rot_dim),
            "layout": layout, "table": table,
            "dtype": dtype if isinstance(dtype, str) else dtype_name(dtype)}


def fused_qk_rope_configs(key: dict) -> list[KernelConfig]:
    half_block = next_pow2(key["rot_dim"] // 2)
    return rope_block_configs(half_block, max(key["num_q_heads"], key["num_k_heads"]))


def fused_qk_rope_default_config(key: dict) -> KernelConfig:
    half_block = next_pow2(key["rot_dim"] // 2)
    return rope_block_default(half_block, max(key["num_q_heads"], key["num_k_heads"]),
                              key["num_tokens"])


def fused_qk_rope_presets() -> list[dict]:
    """Llama-3-8B (GQA 32/8, D 128, half-split) and DeepSeek-V2-Lite's rope part (MLA)."""
    llama = dict(num_q_heads=LLAMA_3_8B["num_attention_heads"],
                 num_k_heads=LLAMA_3_8B["num_key_value_heads"], head_dim=LLAMA_3_8B["head_dim"],
                 rot_dim=LLAMA_3_8B["rotary_dim"], layout="neox", dtype=LLAMA_3_8B["dtype"])
    # MLA ropes the shared rope key (one head) and the rope part of every query head.
    rope_dim = DEEPSEEK_V2_LITE["qk_rope_head_dim"]
    deepseek = dict(num_q_heads=DEEPSEEK_V2_LITE["num_attention_heads"], num_k_heads=1,
                    head_dim=rope_dim, rot_dim=rope_dim, layout="mla", table="freqs",
                    dtype=DEEPSEEK_V2_LITE["dtype"])
    keys = [fused_qk_rope_tune_key(num_tokens=n, table="freqs", **llama)
            for n in (1, 16, 64, 256, 2048, 8192)]
    keys += [fused_qk_rope_tune_key(num_tokens=n, table="cos_sin", **llama) for n in (64, 2048)]
    keys += [fused_qk_rope_tune_key(num_tokens=n, **deepseek) for n in (64, 2048)]
    return keys


def _tune_check_bound(expected: torch.Tensor, dtype: torch.dtype, input_scale: float) -> torch.Tensor:
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


class _FusedQKRopeCase(RopeTuneCase):
    """Scratch query/key for one key; ``run`` rotates them again and again (norm-preserving)."""

    def __init__(self, key: dict, device: torch.device):
        self.key = key
        n, dim, dtype = key["num_tokens"], key["head_dim"], getattr(torch, key["dtype"])
        generator = self._init_rope(key, device)
        self.originals = [None if h == 0 else
                          (torch.rand(n, h, dim, generator=generator) * 2 - 1).to(device, dtype)
                          for h in (key["num_q_heads"], key["num_k_heads"])]
        self.query, self.key_states = [None if x is None else x.clone() for x in self.originals]
        touched = n * (key["num_q_heads"] + key["num_k_heads"]) * key["rot_dim"]
        self.bytes_moved = 2 * touched * dtype.itemsize + n * (8 + key["rot_dim"] * 4)

    def _launch(self, query, key, config, backend):
        fused_qk_rope(query, key, self.positions, interleaved=self.interleaved,
                      mla_layout=self.mla_layout, config=config, backend=backend, **self.table)

    def run(self, config: KernelConfig) -> None:
        self._launch(self.query, self.key_states, config, "triton")

    def run_reference(self) -> None:
        self._launch(self.query, self.key_states, None, "torch")

    def check(self, config: KernelConfig) -> None:
        actual = [None if x is None else x.clone() for x in self.originals]
        expected = [None if x is None else x.float() for x in self.originals]
        self._launch(*actual, config, "triton")
        self._launch(*expected, None, "torch")
        for name, got, want in zip(("query", "key"), actual, expected):
            if got is not None:
                tune_check_rotation(got, want, 1.0, name)


_autotune.register(KernelTuning(
    name="fused_qk_rope", configs=fused_qk_rope_configs,
    default_config=fused_qk_rope_default_config, tune_key=fused_qk_rope_tune_key,
    make_case=lambda key, device: _FusedQKRopeCase(key, torch.device(device)),
    presets=fused_qk_rope_presets,
))


@custom_op("dynctx::fused_qk_rope", mutates_args=("query", "key"))
def _fused_qk_rope_op(query: Optional[torch.Tensor], key: Optional[torch.Tensor],
                      positions: torch.Tensor, cos_sin_cache: Optional[torch.Tensor],
                      freqs: Optional[torch.Tensor], interleaved: bool, mscale: float,
                      mla_layout: bool) -> None:
    fused_qk_rope(query, key, positions, cos_sin_cache=cos_sin_cache, freqs=freqs,
                  interleaved=interleaved, mscale=mscale, mla_layout=mla_layout, backend=None)


@_fused_qk_rope_op.register_fake
def _fused_qk_rope_fake(query, key, positions, cos_sin_cache, freqs, interleaved, mscale,
                        mla_layout) -> None:
    return None
