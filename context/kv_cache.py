"""The KV cache: the paged K/V (or MLA latent) buffer, and the step's writes into it.

``KVCache`` owns the buffer, ``[2, attention layers, blocks, block_size, heads per rank,
head_dim]`` (with ``cache_mla_latent``: ``[attention layers, blocks, block_size, kv_lora_rank +
qk_pos_emb_head_dim]``), allocated with the context's tensors and dropped on suspend; the last
block is the dummy block that padding tokens write into. ``append`` writes a step's K and V (one
``kv_append`` or ``mla_latent_append`` launch), ``rope_append`` rotates Q and K and appends in
one launch, ``views`` hands out one layer. The caller's tensors are checked once, here at the
context's edge (``inputs.check_step_tensor``), and the kernels run without their own checks.

An FP8 cache (``kv_cache_dtype``, ``context/kv_scales.py``) holds the buffer in its FP8 dtype
and the scales, fp32 ``[2, layers, heads]`` on the device (MLA: ``[2, layers, 1]``, latent and
rope); the appends quantize in the kernel, ``layer_scales`` hands a layer's scales to the
attention. Dynamic scales are calibrated by ``begin_step``'s step on each layer's first write.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from dynctx.kernels.fp8 import is_fp8
from dynctx.kernels.kv_append import kv_append
from dynctx.kernels.mla_latent import mla_latent_append

from .inputs import check_step_tensor
from .kv_scales import ScaleSpec, dynamic_scale


class KVCache:
    """The paged buffer of one context.

    Args:
        layers: attention layers on this stage; total_blocks: blocks, the dummy included;
        block_size: tokens per block; heads, head_dim: the KV heads this rank stores;
        dtype: of the K/V the model appends (params_dtype), device: of the buffer;
        backend: the resolved kernel backend of the appends, kernel_backend: the context's
        backend name (rope); mla: ``(kv_lora_rank, qk_pos_emb_head_dim)`` for the MLA latent
        cache, else None; kv_dtype: the buffer's dtype (default ``dtype``; FP8: ``scales``
        says how they are set, ``kv_scales.check_kv_scales``).
    """

    def __init__(self, *, layers: int, total_blocks: int, block_size: int, heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, backend: str,
                 kernel_backend: Optional[str], mla: Optional[Tuple[int, int]] = None,
                 kv_dtype: Optional[torch.dtype] = None, scales: Optional[ScaleSpec] = None):
        self.dtype, self.device = dtype, device
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.fp8 = is_fp8(self.kv_dtype)
        self.backend, self.kernel_backend = backend, kernel_backend
        self.mla = mla
        self.heads = (heads, head_dim)
        if mla is not None:
            self.shape = (layers, total_blocks, block_size, mla[0] + mla[1])
        else:
            self.shape = (2, layers, total_blocks, block_size, heads, head_dim)
        self.buffer: Optional[torch.Tensor] = None
        # FP8: the scales live for the context's lifetime (a suspend keeps them).
        self.scales: Optional[torch.Tensor] = None
        self.scale_mode = None if scales is None else scales.mode
        self.calibrated = [True] * layers
        self.calibrating = False   # this step calibrates the layers not calibrated yet
        self.real_tokens = 0
        if self.fp8:
            scale_heads = 1 if mla is not None else heads
            self.scales = torch.ones(2, layers, scale_heads, dtype=torch.float32, device=device)
            if scales.values is not None:
                self.scales.copy_(scales.values)
            else:
                self.calibrated = [False] * layers

    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.kv_dtype).element_size()

    def allocate(self) -> None:
        self.buffer = torch.empty(self.shape, dtype=self.kv_dtype, device=self.device)

    def begin_step(self, real_tokens: int, capture: bool) -> bool:
        """Note the step's real (unpadded) token count; returns True when the step calibrates
        dynamic scales (its first write of an uncalibrated layer), which must run eagerly: a
        CUDA graph replay would not run the calibration. Capture steps (dummies) never do."""
        self.real_tokens = real_tokens
        self.calibrating = (not capture and real_tokens > 0
                            and not all(self.calibrated))
        return self.calibrating

    def layer_scales(self, layer: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(K scales, V scales)`` fp32 ``[heads]`` views of layer ``layer`` (MLA: the latent
        and rope scales ``[1]``); ``(None, None)`` for a cache that is not FP8."""
        if not self.fp8:
            return None, None
        return self.scales[0, layer], self.scales[1, layer]

    def _calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Set layer ``layer``'s dynamic scales from this step's real tokens (device ops only)."""
        if not (self.calibrating and not self.calibrated[layer]):
            return
        real = self.real_tokens
        heads = self.scales.shape[2]
        per_head = self.scale_mode == "dynamic_per_head"
        self.scales[0, layer] = dynamic_scale(key[:real], self.kv_dtype, per_head, heads)
        self.scales[1, layer] = dynamic_scale(value[:real], self.kv_dtype, per_head, heads)
        self.calibrated[layer] = True

    def release(self) -> None:
        self.buffer = None

    def views(self, layer: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(K, V)`` ``[blocks, block_size, H, D]`` of attention layer ``layer`` (0-based);
        with MLA ``(latent [blocks, block_size, rank + rope], None)``."""
        if self.mla is not None:
            return self.buffer[layer], None
        return self.buffer[0, layer], self.buffer[1, layer]

    def append(self, layer: int, key: torch.Tensor, value: Optional[torch.Tensor],
               blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the step's ``n = len(blocks)`` tokens of K and V (``[>= n, (1,) H, D]``; MLA:
        ``key`` the latent ``[>= n, (1,) rank + rope]``, ``value`` ignored) at ``blocks`` and
        ``slots``. Tensors that require grad are written detached."""
        n = blocks.shape[0]
        if self.mla is not None:
            rank, rope = self.mla
            latent = check_step_tensor("key", key, n, self.device, self.dtype, (rank + rope,),
                                       "kv_lora_rank + qk_pos_emb_head_dim")
            scales = {}
            if self.fp8:
                self._calibrate(layer, latent[:, :rank], latent[:, rank:])
                scales = dict(latent_scale=self.scales[0, layer], rope_scale=self.scales[1, layer])
            mla_latent_append(self.buffer[layer], latent[:, :rank], latent[:, rank:], blocks,
                              slots, backend=self.backend, check=False, **scales)
            return
        key = check_step_tensor("key", key, n, self.device, self.dtype, self.heads, "H, D")
        value = check_step_tensor("value", value, n, self.device, self.dtype, self.heads,
                                  "H, D")
        buffer = self.buffer
        scales = {}
        if self.fp8:
            self._calibrate(layer, key, value)
            scales = dict(key_scale=self.scales[0, layer], value_scale=self.scales[1, layer])
        kv_append(buffer[0, layer], buffer[1, layer], key, value, blocks, slots,
                  backend=self.backend, check=False, **scales)

    def rope_append(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor,
                    slots: torch.Tensor, **rope) -> None:
        """Rotate ``query`` and ``key`` in place at ``positions`` and append K and V, in one
        launch (``rope``: ``rope_kv_append``'s table and layout arguments)."""
        from dynctx.kernels.rope_kv_append import rope_kv_append

        if self.mla is not None:
            raise NotImplementedError("fused rope + KV append is for the MHA cache, not MLA")
        n = blocks.shape[0]
        check_step_tensor("key", key, n, self.device, self.dtype)
        check_step_tensor("value", value, n, self.device, self.dtype)
        if self.calibrating and not self.calibrated[layer]:
            # The scales come from the rotated key: rotate first, then append (this step only).
            from dynctx.kernels.rope import fused_qk_rope

            fused_qk_rope(query, key, positions, backend=self.kernel_backend, **rope)
            self.append(layer, key, value, blocks, slots)
            return
        scales = {} if not self.fp8 else dict(key_scale=self.scales[0, layer],
                                              value_scale=self.scales[1, layer])
        rope_kv_append(query, key, value, positions, self.buffer[0, layer],
                       self.buffer[1, layer], blocks, slots, backend=self.kernel_backend,
                       **rope, **scales)
