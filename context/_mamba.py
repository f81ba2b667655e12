"""Hybrid (Mamba) models: slots, the step's Mamba metadata and state gather/scatter."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Tuple

import numpy as np
import torch

from dynctx.kernels.mamba_state import mamba_state_gather, mamba_state_scatter

from ._fields import FIELD_MAMBA_SLOT
from .batch_dimensions import InferenceBatchDimensions


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
        self._mamba_slots.reset()
        self._h_req[FIELD_MAMBA_SLOT] = -1
        self._mamba_zero_count = 0
        self._arena.dirty = True

    def _mamba_host_metadata(self, P: int, A: int, decode: int, prefill: int, chunked: bool,
                             padded: InferenceBatchDimensions, cu_q: np.ndarray) -> dict:
        """Mamba slot indices and varlen offsets of the step, on the host (docs/SEMANTICS.md §7).

        Decode rows come first, then the regular prefills, then (``chunked``) the continuation
        chunk, which runs separately from its saved state.
        """
        arena = self._arena.host
        slots = self._h_req[FIELD_MAMBA_SLOT, P:P + A]
        regular = prefill - 1 if chunked else prefill
        padded_decode, padded_prefill = padded.decode_req_count, padded.prefill_req_count
        arena["mamba_decode_slots"][:decode] = slots[:decode]
        arena["mamba_decode_slots"][decode:padded_decode] = -1
        arena["mamba_prefill_slots"][:regular] = slots[decode:decode + regular]
        arena["mamba_prefill_slots"][regular:padded_prefill] = -1
        arena["mamba_chunked_slot"][0] = slots[decode + regular] if chunked else -1
        cu = arena["mamba_cu_seqlens"]
        cu[:regular + 1] = cu_q[decode:decode + regular + 1] - cu_q[decode]
        cu[regular + 1:padded_prefill + 1] = cu[regular]
        # seq_idx: which regular prefill each prefill token belongs to; -1 elsewhere.
        regular_tokens = int(cu[regular])
        lengths = np.diff(cu[:regular + 1])
        seq_idx = self._h_seq_idx
        seq_idx[:regular_tokens] = np.repeat(np.arange(regular, dtype=np.int32), lengths)
        zero_count, self._mamba_zero_count = self._mamba_zero_count, 0
        return dict(decode=decode, regular=regular, chunked=chunked,
                    padded_decode=padded_decode, padded_prefill=padded_prefill,
                    regular_tokens=regular_tokens,
                    chunked_tokens=int(cu_q[A] - cu_q[decode + regular]) if chunked else 0,
                    zero_count=zero_count)

    def _mamba_device_metadata(self, host: dict, padded_tokens: int) -> SimpleNamespace:
        """Zero the Mamba states of this step's new requests and publish the step's metadata."""
        device = self._arena.device
        if host["zero_count"]:
            new_slots = device["mamba_zero_slots"][:host["zero_count"]]
            self.mamba_conv_states.index_fill_(1, new_slots, 0)
            self.mamba_ssm_states.index_fill_(1, new_slots, 0)
        seq_len = host["regular_tokens"]
        if host["padded_prefill"]:
            self._h_seq_idx[seq_len:padded_tokens] = -1
            self._h2d.copy(self._mamba_seq_idx[:padded_tokens], self._h_seq_idx[:padded_tokens])
        return SimpleNamespace(
            request_to_mamba_state_idx=device["req"][FIELD_MAMBA_SLOT],
            batch_indices_decode=(device["mamba_decode_slots"][:host["padded_decode"]]
                                  if host["padded_decode"] else None),
            batch_indices_prefill=(device["mamba_prefill_slots"][:host["padded_prefill"]]
                                   if host["padded_prefill"] else None),
            batch_indices_chunked_prefill=(device["mamba_chunked_slot"]
                                           if host["chunked"] else None),
            cu_seqlens=(device["mamba_cu_seqlens"][:host["padded_prefill"] + 1]
                        if host["padded_prefill"] else None),
            seq_idx=(self._mamba_seq_idx[:padded_tokens].unsqueeze(0)
                     if host["padded_prefill"] else None),
            device_decode_prefill=(host["decode"], host["regular"]),
            device_chunked_prefill=((seq_len, host["chunked_tokens"])
                                    if host["chunked"] else None),
        )

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
