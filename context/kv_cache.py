"""The KV cache: the paged K/V (or MLA latent) buffer, and the step's writes into it.

``KVCache`` owns the buffer, ``[2, attention layers, blocks, block_size, heads per rank,
head_dim]`` (with ``cache_mla_latent``: ``[attention layers, blocks, block_size, kv_lora_rank +
qk_pos_emb_head_dim]``), allocated with the context's tensors and dropped on suspend; the last
block is the dummy block that padding tokens write into. ``append`` writes a step's K and V (one
``kv_append`` or ``mla_latent_append`` launch), ``rope_append`` rotates Q and K and appends in
one launch, ``views`` hands out one layer. The caller's tensors are checked once, here at the
context's edge (``inputs.check_step_tensor``), and the kernels run without their own checks.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from dynctx.kernels.kv_append import kv_append
from dynctx.kernels.mla_latent import mla_latent_append

from .inputs import check_step_tensor


class KVCache:
    """The paged buffer of one context.

    Args:
        layers: attention layers on this stage; total_blocks: blocks, the dummy included;
        block_size: tokens per block; heads, head_dim: the KV heads this rank stores;
        dtype, device: of the buffer; backend: the resolved kernel backend of the appends,
        kernel_backend: the context's backend name (rope);
        mla: ``(kv_lora_rank, qk_pos_emb_head_dim)`` for the MLA latent cache, else None.
    """

    def __init__(self, *, layers: int, total_blocks: int, block_size: int, heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, backend: str,
                 kernel_backend: Optional[str], mla: Optional[Tuple[int, int]] = None):
        self.dtype, self.device = dtype, device
        self.backend, self.kernel_backend = backend, kernel_backend
        self.mla = mla
        self.heads = (heads, head_dim)
        if mla is not None:
            self.shape = (layers, total_blocks, block_size, mla[0] + mla[1])
        else:
            self.shape = (2, layers, total_blocks, block_size, heads, head_dim)
        self.buffer: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self) -> None:
        self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)

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
            mla_latent_append(self.buffer[layer], latent[:, :rank], latent[:, rank:], blocks,
                              slots, backend=self.backend, check=False)
            return
        key = check_step_tensor("key", key, n, self.device, self.dtype, self.heads, "H, D")
        value = check_step_tensor("value", value, n, self.device, self.dtype, self.heads,
                                  "H, D")
        buffer = self.buffer
        kv_append(buffer[0, layer], buffer[1, layer], key, value, blocks, slots,
                  backend=self.backend, check=False)

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
        rope_kv_append(query, key, value, positions, self.buffer[0, layer],
                       self.buffer[1, layer], blocks, slots, backend=self.kernel_backend, **rope)
