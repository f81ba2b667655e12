"""Hybrid (Mamba) models: the public Mamba methods of ``DynamicInferenceContext``.

The step's Mamba metadata is described by ``step.MambaStep`` and published by
``DeviceState.mamba_metadata``; this mixin reads the context's ``_table`` (slots) and
``_device`` (the state tensors) and nothing else.
"""

from __future__ import annotations

from typing import Tuple

import torch

from dynctx.kernels.mamba_state import mamba_state_gather, mamba_state_scatter


class MambaMixin:
    """The Mamba side of ``DynamicInferenceContext`` (active when ``is_hybrid_model``)."""

    def reset_mamba_state(self) -> None:
        """Every Mamba slot free again (part of ``reset``; the state bytes are kept)."""
        if not self.is_hybrid_model:
            return
        self._check_allocated()
        if self.total_request_count:
            raise RuntimeError(f"reset_mamba_state() with {self.total_request_count} live "
                               "requests would orphan their Mamba slots; use reset()")
        self._table.reset_slots()
        self._device.arena.dirty = True

    def _require_hybrid(self, method: str) -> None:
        self._check_allocated()
        if not self.is_hybrid_model:
            raise RuntimeError(f"{method}() needs a hybrid model (mamba_inference_state_config)")

    def mamba_states_cache(self, layer_number: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(conv [max_requests, *conv_shape], ssm [max_requests, *ssm_shape])`` views of one
        Mamba layer; a request reaches its state through its slot
        (``mamba_metadata.request_to_mamba_state_idx`` and the batch indices)."""
        self._require_hybrid("mamba_states_cache")
        layer = self._layer_index(layer_number, "M")
        return self.mamba_conv_states[layer], self.mamba_ssm_states[layer]

    def gather_mamba_states(self, layer_number: int, slots: torch.Tensor
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Conv and SSM states ``[len(slots), ...]`` of one Mamba layer at ``slots`` (e.g.
        ``mamba_metadata.batch_indices_decode``); rows of slot -1 are zero. One launch each."""
        conv, ssm = self.mamba_states_cache(layer_number)
        return (mamba_state_gather(conv, slots, backend=self.kernel_backend),
                mamba_state_gather(ssm, slots, backend=self.kernel_backend))

    def scatter_mamba_states(self, layer_number: int, slots: torch.Tensor, conv: torch.Tensor,
                             ssm: torch.Tensor) -> None:
        """Write conv and SSM states back to ``slots`` of one Mamba layer (slot -1 skipped)."""
        conv_states, ssm_states = self.mamba_states_cache(layer_number)
        mamba_state_scatter(conv_states, slots, conv, backend=self.kernel_backend)
        mamba_state_scatter(ssm_states, slots, ssm, backend=self.kernel_backend)
