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

from typing import Optional

import torch

from . import autotune
from ._common import custom_op, next_pow2
from ._shapes import DEEPSEEK_V2_LITE, LLAMA_3_8B
from .autotune import KernelConfig, KernelTuning
from .backend import HAS_TRITON, resolve_backend
from .launch_plan import KernelLaunch, PlanCache

# The rotation's names models and tests reach through this module, the rope launcher's.
from .rope_rotation import (  # noqa: F401
    LAYOUTS,
    TABLES,
    RopeProblem,
    RopeTuneCase,
    check_rope_args,
    cos_sin_cache_from_freqs,
    fused_qk_rope_tune_key,
    make_rope_tables,
    rope_block_configs,
    rope_block_default,
    rope_meta,
    tune_check_rotation,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .rope_rotation import _rope_rotate_program

# Per launch key (launch_plan.py): the checks passed, the config, the grid, the arguments.
_PLANS = PlanCache("fused_qk_rope")


if HAS_TRITON:

    @triton.heuristics({"HAS_QUERY": lambda args: args["query_ptr"] is not None,
                        "HAS_KEY": lambda args: args["key_ptr"] is not None})
    @triton.jit(do_not_specialize=["num_tokens"])
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
    plan, plan_key = _PLANS.find((query, key, positions, cos_sin_cache, freqs),
                                 (interleaved, mscale, mla_layout, backend), config,
                                 backend=backend)
    if plan is not None:
        plan.launch((query, key, freqs if cos_sin_cache is None else cos_sin_cache, positions))
        return
    problem = check_rope_args(query, key, positions, cos_sin_cache, freqs, interleaved, mla_layout)
    if problem.num_tokens == 0:
        return
    device = positions.device
    if resolve_backend(backend, device) == "torch":
        fused_qk_rope_ref(query, key, positions, cos_sin_cache=cos_sin_cache, freqs=freqs,
                          interleaved=interleaved, mscale=mscale, mla_layout=mla_layout)
        return
    if config is None:
        config, _ = autotune.resolve_config("fused_qk_rope", problem.tune_key(), device)
    block_t, block_h = config.kwargs["BLOCK_T"], config.kwargs["BLOCK_H"]
    q, k = problem.query, problem.key
    grid = (triton.cdiv(problem.num_tokens, block_t),
            triton.cdiv(problem.num_q_heads, block_h) + triton.cdiv(problem.num_k_heads, block_h))
    # The plan's pointers are the arguments as given: a [T, 1, H, D] tensor's head view and a
    # [max_pos, 1, 1, rot] table's 2-D view start where they do.
    pointers = dict(query_ptr=q, key_ptr=k, table_ptr=problem.table, positions_ptr=positions)
    _PLANS.put(plan_key, KernelLaunch(_fused_qk_rope_kernel, grid, dict(
        **pointers, num_tokens=problem.num_tokens, num_q_heads=problem.num_q_heads,
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
    ), pointers))


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


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


# Their sm_90 builds spill (tests/kernels/test_sm90_build.py): the first at Llama's heads under
# Triton 3.9, the second at the MLA preset under Triton 3.6.
_SPILLING = (KernelConfig.make(BLOCK_T=4, BLOCK_H=1, num_warps=4),
             KernelConfig.make(BLOCK_T=16, BLOCK_H=1, num_warps=1))


def fused_qk_rope_configs(key: dict) -> list[KernelConfig]:
    half_block = next_pow2(key["rot_dim"] // 2)
    return [config for config in
            rope_block_configs(half_block, max(key["num_q_heads"], key["num_k_heads"]))
            if config not in _SPILLING]


def fused_qk_rope_default_config(key: dict) -> KernelConfig:
    """The shared rope default, moved to its other warp count where that config spills."""
    half_block = next_pow2(key["rot_dim"] // 2)
    config = rope_block_default(half_block, max(key["num_q_heads"], key["num_k_heads"]),
                                key["num_tokens"])
    if config in _SPILLING:
        meta = dict(config.meta)
        config = KernelConfig.make(**meta, num_warps=4 if config.num_warps == 1 else 1)
    return config


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


autotune.register(KernelTuning(
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
