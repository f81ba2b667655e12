"""Rotary embeddings of the step: Megatron-Core's ``apply_rotary_emb_*`` methods, in place.

Every function rotates through ``dynctx.kernels.rope`` (or FlashInfer when asked) at the
positions the context hands in (the step's per-token arrays); the context checks the tensors
and the tables against the step first (``inputs.check_rope_call``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


def layout(config: Any) -> dict:
    """The rope layout fields of a Megatron ``TransformerConfig`` (or None: half-split)."""
    return {"interleaved": bool(getattr(config, "rotary_interleaved", False)),
            "mla_layout": bool(getattr(config, "multi_latent_attention", False))}


def check_cp_group(cp_group: Any) -> None:
    if cp_group is not None and getattr(cp_group, "size", lambda: 1)() != 1:
        raise NotImplementedError("cp_group of size > 1: context parallelism is not supported")


def rotate(query: Optional[torch.Tensor], key: Optional[torch.Tensor],
           positions: torch.Tensor, freqs: torch.Tensor, config: Any, mscale: float,
           backend: Optional[str]) -> None:
    """Rotate ``query`` and/or ``key`` in place with Megatron's angle table ``freqs``
    ``[max_seq, 1, 1, rot]`` at ``positions`` (one launch)."""
    from dynctx.kernels.rope import fused_qk_rope

    fused_qk_rope(query, key, positions, freqs=freqs, mscale=mscale, backend=backend,
                  **layout(config))


def rotate_qk(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
              cos_sin_emb: torch.Tensor, config: Any, *, use_flashinfer: Optional[bool],
              device: torch.device, backend: Optional[str]
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key in place, in one launch, from a ``cos_sin_emb`` ``[max_seq, rot]``
    cache (cos half, then sin half) at ``positions``: FlashInfer when ``use_flashinfer`` (None:
    where it can run and the layout is not MLA's), else ours. Returns ``[n, 1, H, D]`` views
    of the ``n = len(positions)`` tokens, as Megatron-Core does."""
    from dynctx.kernels import rope, rope_flashinfer

    fields = layout(config)
    if use_flashinfer is None:
        use_flashinfer = (rope_flashinfer.flashinfer_rope_available(device)
                          and not fields["mla_layout"])
    if use_flashinfer:
        if fields["mla_layout"]:
            raise ValueError("use_flashinfer_fused_rope: FlashInfer has no MLA rope layout "
                             "(config.multi_latent_attention)")
        rope_flashinfer.apply_rope_flashinfer(query, key, positions, cos_sin_emb,
                                              fields["interleaved"])
    else:
        rope.fused_qk_rope(query, key, positions, cos_sin_cache=cos_sin_emb, backend=backend,
                           **fields)
    n = positions.shape[0]
    query, key = query[:n], key[:n]
    return (query.unsqueeze(1) if query.dim() == 3 else query,
            key.unsqueeze(1) if key.dim() == 3 else key)
