"""Hybrid (Mamba) models: the public Mamba methods of ``DynamicInferenceContext``.

The step's Mamba metadata is described by ``step.MambaStep`` and published by
``DeviceState.mamba_metadata``; this mixin reads the context's ``_table`` (slots) and
``_device`` (the state tensors) and nothing else.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from dynctx.kernels.mamba_state import mamba_state_gather, mamba_state_scatter

from ._fields import FIELD_MAMBA_SLOT
from .errors import NotHybridError


class MambaMetadata:
    """The Mamba side of the context, with Megatron-Core's names (``ctx.mamba_metadata`` of a
    hybrid model; None otherwise). Built with the context and kept across ``reset``:

    * ``request_to_mamba_state_idx``: int32 ``[max_requests]``, each row's state slot (-1
      none), the context's slot field (a view: ``request_ids`` says how writes reach it);
    * ``mamba_state_free_slot_count``: free slots; settable by hand like
      ``block_allocator.total_avail`` (lowering it takes the top of the free stack);
    * ``allocate_slot()``: pop a free slot (None when none is free), as Megatron-Core's;
    * the step's fields (``STEP_FIELDS``: batch indices of the decode, prefill and chunked rows,
      ``cu_seqlens``, ``seq_idx``, the decode/prefill split), set by
      ``initialize_attention_state`` and None again after ``reset_attention_state``.
    """

    STEP_FIELDS = ("batch_indices_decode", "batch_indices_prefill",
                   "batch_indices_chunked_prefill", "cu_seqlens", "seq_idx",
                   "device_decode_prefill", "device_chunked_prefill")

    def __init__(self, context):
        self._context = context
        self.reset_varlen_metadata()

    def reset_varlen_metadata(self) -> None:
        """Forget the step's fields (the slot map and the free slots stay)."""
        for name in self.STEP_FIELDS:
            setattr(self, name, None)

    def update_step(self, fields: dict) -> None:
        for name in self.STEP_FIELDS:
            setattr(self, name, fields[name])

    @property
    def request_to_mamba_state_idx(self) -> torch.Tensor:
        return self._context._device_field(FIELD_MAMBA_SLOT)

    def _slots(self):
        self._context._check_allocated()
        return self._context._table.slots

    @property
    def mamba_state_free_slot_count(self) -> int:
        return self._slots().free_count

    @mamba_state_free_slot_count.setter
    def mamba_state_free_slot_count(self, value: int) -> None:
        slots = self._slots()
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"mamba_state_free_slot_count={value!r} must be an int")
        if not 0 <= value <= slots.count:
            raise ValueError(f"mamba_state_free_slot_count={value} must lie in [0, "
                             f"{slots.count}] (the slots, one per request row)")
        slots.free_count = int(value)

    def allocate_slot(self) -> Optional[int]:
        """Pop a free slot for a request the caller places by hand (None when none is free)."""
        return self._slots().allocate()


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
            raise NotHybridError(f"{method}() needs a hybrid model "
                                 "(mamba_inference_state_config)")

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
