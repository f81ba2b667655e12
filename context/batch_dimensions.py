"""Batch dimensions of one forward pass, and the Mamba state configuration type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple


@dataclass(frozen=True, order=True)
class InferenceBatchDimensions:
    """Token and request counts of a forward pass (real or padded)."""

    token_count: int = 0
    prefill_req_count: int = 0
    decode_req_count: int = 0
    has_explicit_chunked_prefill_req: bool = False

    @property
    def req_count(self) -> int:
        return self.prefill_req_count + self.decode_req_count

    def __str__(self) -> str:
        return f"[{self.token_count}]: {self.prefill_req_count} P + {self.decode_req_count} D"


@dataclass(frozen=True)
class MambaInferenceStateConfig:
    """Shapes of a hybrid model's per-request Mamba states: Megatron-Core 0.19's fields (its
    ``megatron/core/inference/config.py``), positional as in 0.16, whose two shape fields are
    read-only aliases here (``mamba_conv_states_shape``, ``mamba_ssm_states_shape``).

    ``layer_type_list`` uses ``M`` (Mamba), ``*`` (attention), ``-`` (MLP) and ``E`` (MoE).
    The dtypes default to the context's ``params_dtype`` (0.19 requires them);
    ``mamba_chunk_size`` is the SSM kernels' chunk size, stored for the model.
    """

    layer_type_list: Tuple[str, ...]
    conv_states_shape: Tuple[int, ...]
    ssm_states_shape: Tuple[int, ...]
    conv_states_dtype: Optional[object] = None
    ssm_states_dtype: Optional[object] = None
    mamba_chunk_size: int = 128

    mamba_conv_states_shape = property(lambda self: self.conv_states_shape)
    mamba_ssm_states_shape = property(lambda self: self.ssm_states_shape)

    @classmethod
    def from_model(cls, model: Any, conv_states_dtype: Optional[object] = None,
                   ssm_states_dtype: Optional[object] = None
                   ) -> Optional["MambaInferenceStateConfig"]:
        """0.19's ``from_model``: the config of a Megatron hybrid model (its ``decoder`` has a
        ``layer_type_list`` with Mamba layers and ``mamba_state_shapes_per_request()``), else
        None; the dtypes default to ``model.config.params_dtype``, the chunk size to the first
        Mamba mixer's ``chunk_size`` (128 without one)."""
        while not hasattr(model, "decoder") and hasattr(model, "module"):
            model = model.module  # Megatron's wrappers (DDP, Float16Module)
        decoder = getattr(model, "decoder", None)
        layer_types = getattr(decoder, "layer_type_list", None)
        if layer_types is None or "M" not in layer_types:
            return None
        conv_shape, ssm_shape = decoder.mamba_state_shapes_per_request()
        chunk = next((layer.mixer.chunk_size for kind, layer in zip(layer_types, decoder.layers)
                      if kind == "M" and hasattr(layer, "mixer")), 128)
        dtype = model.config.params_dtype
        return cls(layer_types, conv_shape, ssm_shape, conv_states_dtype or dtype,
                   ssm_states_dtype or dtype, chunk)
