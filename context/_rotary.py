"""Rotary embeddings of the context (Megatron-Core's ``apply_rotary_emb_*`` methods).

Every method rotates in place through ``dynctx.kernels.rope`` (or FlashInfer when asked) at the
step's positions; the tables are checked against the step's largest position on the host.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class RotaryMixin:
    """``apply_rotary_emb_query/key``, ``apply_fused_qk_rotary_emb`` and the fused rope + KV
    append extension of ``DynamicInferenceContext``."""

    def _rope_positions(self, tensor: torch.Tensor, name: str, table: Optional[torch.Tensor] = None,
                        table_name: str = "") -> int:
        """Check a rope call against the step; returns the step's padded token count."""
        self._check_allocated()
        meta = self._require_attention_state(f"rotary embedding of {name}")
        max_position = meta.max_seqlen_k - 1
        n = self.padded_active_token_count
        for arg, tensor_ in ((name, tensor), (table_name, table)):
            if tensor_ is None:
                continue
            if not isinstance(tensor_, torch.Tensor):
                raise TypeError(f"{arg} must be a torch.Tensor, got {type(tensor_).__name__}")
            if tensor_.device != self.device:
                raise ValueError(f"{arg} is on {tensor_.device}, the context on {self.device}")
        if tensor.shape[0] < n:
            raise ValueError(f"{name} has {tensor.shape[0]} tokens, the step has {n}")
        if table is not None and table.shape[0] <= max_position:
            raise ValueError(f"{table_name} has {table.shape[0]} positions, the step reaches "
                             f"position {max_position}")
        return n

    @staticmethod
    def _rope_layout(config: Any) -> dict:
        """The rope layout fields of a Megatron ``TransformerConfig`` (or None: half-split)."""
        return {"interleaved": bool(getattr(config, "rotary_interleaved", False)),
                "mla_layout": bool(getattr(config, "multi_latent_attention", False))}

    @staticmethod
    def _check_cp_group(cp_group: Any) -> None:
        if cp_group is not None and getattr(cp_group, "size", lambda: 1)() != 1:
            raise NotImplementedError("cp_group of size > 1: context parallelism is not supported")

    def apply_rotary_emb_query(self, query: torch.Tensor, query_emb: torch.Tensor, config: Any,
                               cu_seqlens_q: Any = None, cp_group: Any = None,
                               mscale: float = 1.0) -> torch.Tensor:
        """Rotate ``query[:n]`` in place with Megatron's angle table ``query_emb``
        ``[max_seq, 1, 1, rot]`` at the step's positions; returns ``query``."""
        from dynctx.kernels.rope import fused_qk_rope

        self._check_cp_group(cp_group)
        n = self._rope_positions(query, "query", query_emb, "query_emb")
        fused_qk_rope(query, None, self.token_to_pos_ids[:n], freqs=query_emb, mscale=mscale,
                      backend=self.kernel_backend, **self._rope_layout(config))
        return query

    def apply_rotary_emb_key(self, key: torch.Tensor, key_emb: torch.Tensor, config: Any,
                             cp_group: Any = None, mscale: float = 1.0) -> torch.Tensor:
        """Rotate ``key[:n]`` in place (decode steps included); returns ``key``."""
        from dynctx.kernels.rope import fused_qk_rope

        self._check_cp_group(cp_group)
        n = self._rope_positions(key, "key", key_emb, "key_emb")
        fused_qk_rope(None, key, self.token_to_position_in_request[:n], freqs=key_emb,
                      mscale=mscale, backend=self.kernel_backend, **self._rope_layout(config))
        return key

    def apply_fused_qk_rotary_emb(self, query: torch.Tensor, key: torch.Tensor,
                                  cos_sin_emb: torch.Tensor, config: Any
                                  ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate query and key in place, in one launch, from a ``cos_sin_emb``
        ``[max_seq, rot]`` cache (cos half, then sin half); FlashInfer when
        ``use_flashinfer_fused_rope`` asks for it. Returns ``[n, 1, H, D]`` views of the
        step's ``n`` tokens, as Megatron-Core does."""
        from dynctx.kernels import rope, rope_flashinfer

        n = self._rope_positions(query, "query", cos_sin_emb, "cos_sin_emb")
        self._rope_positions(key, "key")
        positions = self.token_to_pos_ids[:n]
        layout = self._rope_layout(config)
        use_flashinfer = self.use_flashinfer_fused_rope
        if use_flashinfer is None:
            use_flashinfer = (rope_flashinfer.flashinfer_rope_available(self.device)
                              and not layout["mla_layout"])
        if use_flashinfer:
            if layout["mla_layout"]:
                raise ValueError("use_flashinfer_fused_rope: FlashInfer has no MLA rope layout "
                                 "(config.multi_latent_attention)")
            rope_flashinfer.apply_rope_flashinfer(query, key, positions, cos_sin_emb,
                                                  layout["interleaved"])
        else:
            rope.fused_qk_rope(query, key, positions, cos_sin_cache=cos_sin_emb,
                               backend=self.kernel_backend, **layout)
        query, key = query[:n], key[:n]
        return (query.unsqueeze(1) if query.dim() == 3 else query,
                key.unsqueeze(1) if key.dim() == 3 else key)

    def apply_rotary_emb_and_append_key_value_cache(
            self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            *, rotary_pos_emb: Optional[torch.Tensor] = None,
            cos_sin_emb: Optional[torch.Tensor] = None, config: Any = None,
            mscale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Extension: rotate query and key in place and append K/V, in one launch.

        Give either Megatron's angle table ``rotary_pos_emb`` or a ``cos_sin_emb`` cache.
        Returns ``(query, key)``.
        """
        from dynctx.kernels.rope_kv_append import rope_kv_append

        self._check_allocated()
        if self.cache_mla_latent:
            raise NotImplementedError("fused rope + KV append is for the MHA cache, not MLA")
        layer = self._layer_index(layer_number)
        table = rotary_pos_emb if rotary_pos_emb is not None else cos_sin_emb
        n = self._rope_positions(query, "query", table,
                                 "rotary_pos_emb" if rotary_pos_emb is not None else "cos_sin_emb")
        self._check_step_tensor("key", key, n)
        self._check_step_tensor("value", value, n)
        rope_kv_append(query, key, value, self.token_to_pos_ids[:n],
                       self.memory_buffer[0, layer], self.memory_buffer[1, layer],
                       self.token_to_block_idx[:n],
                       self.token_to_local_position_within_kv_block[:n],
                       cos_sin_cache=cos_sin_emb, freqs=rotary_pos_emb, mscale=mscale,
                       backend=self.kernel_backend, **self._rope_layout(config))
        return query, key
