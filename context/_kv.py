"""The KV cache of the context: layer numbers, the step's K/V append and the cache views.

The append checks the caller's tensors once, at this edge (``inputs.check_step_tensor``), and
calls the kernels without their own checks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from dynctx.kernels.kv_append import kv_append
from dynctx.kernels.mla_latent import mla_latent_append

from ._fields import _LAYER_SYMBOLS
from .inputs import check_step_tensor


class KVCacheMixin:
    """``append_key_value_cache``, ``key_value_cache`` and the layer-number check."""

    def _layer_index(self, layer_number: int, kind: str = "*") -> int:
        """Index within its type of a 1-based layer number of this stage, checked to be of
        ``kind`` (``*`` attention, ``M`` Mamba)."""
        layers = len(self.layer_types)
        if isinstance(layer_number, bool) or not isinstance(layer_number, (int, np.integer)) \
                or not 1 <= layer_number <= layers:
            raise ValueError(f"layer_number={layer_number!r} must be an int in [1, {layers}] "
                             "(1-based, local to this stage)")
        actual = self.layer_types[int(layer_number) - 1]
        if actual != kind:
            raise ValueError(f"layer_number={layer_number} is a {_LAYER_SYMBOLS[actual]} layer, "
                             f"not a {_LAYER_SYMBOLS[kind]} layer")
        return self.layer_map[int(layer_number) - 1]

    def _check_step_tensor(self, name: str, tensor: torch.Tensor, n: int) -> torch.Tensor:
        return check_step_tensor(name, tensor, n, self.device, self.params_dtype)

    def append_key_value_cache(self, layer_number: int, key: torch.Tensor,
                               value: Optional[torch.Tensor]) -> None:
        """Write the step's K and V (``[>= n, 1, H, D]`` or ``[>= n, H, D]``) into the cache;
        with ``cache_mla_latent``, ``key`` is the concatenated latent ``[>= n, 1, rank + rope]``
        and ``value`` is ignored. Tensors that require grad are written detached."""
        self._require_attention_state("append_key_value_cache")
        layer = self._layer_index(layer_number)
        n = self.padded_active_token_count
        blocks = self.token_to_block_idx[:n]
        slots = self.token_to_local_position_within_kv_block[:n]
        if self.cache_mla_latent:
            width = self.kv_reduced_dim
            latent = check_step_tensor("key", key, n, self.device, self.params_dtype, (width,),
                                       "kv_lora_rank + qk_pos_emb_head_dim")
            rank = self.kv_lora_rank
            mla_latent_append(self.memory_buffer[layer], latent[:, :rank], latent[:, rank:],
                              blocks, slots, backend=self._backend, check=False)
            return
        heads = (self.num_attention_heads_per_partition, self.kv_channels)
        key = check_step_tensor("key", key, n, self.device, self.params_dtype, heads, "H, D")
        value = check_step_tensor("value", value, n, self.device, self.params_dtype, heads,
                                  "H, D")
        buffer = self.memory_buffer
        kv_append(buffer[0, layer], buffer[1, layer], key, value, blocks, slots,
                  backend=self._backend, check=False)

    def key_value_cache(self, layer_number: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(K, V)`` views ``[num_blocks, block_size, H, D]`` of one layer; with MLA
        ``(latent [num_blocks, block_size, rank + rope], None)``. The block table of the step
        is ``active_attn_metadata.block_table``."""
        self._check_allocated()
        layer = self._layer_index(layer_number)
        if self.cache_mla_latent:
            return self.memory_buffer[layer], None
        return self.memory_buffer[0, layer], self.memory_buffer[1, layer]
