"""FlashInfer's fused rope, for a context built with ``use_flashinfer_fused_rope`` (CUDA only).

The same rotation as ``fused_qk_rope`` (``rope.py``) with FlashInfer's ``cos_sin_cache``;
``flashinfer`` is an optional dependency (``pip install 'dynctx[flashinfer]'``).
"""

from __future__ import annotations

import importlib.util

import torch

from .rope_rotation import as_head_view


def flashinfer_rope_available(device) -> bool:
    """True when ``apply_rope_flashinfer`` can run on ``device``: CUDA, flashinfer importable."""
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
