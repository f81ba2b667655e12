"""Batch dimensions of one forward pass, and the Mamba state configuration type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


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
    """Shapes of a hybrid model's per-request Mamba states (Megatron-Core's fields).

    ``layer_type_list`` uses ``M`` (Mamba), ``*`` (attention), ``-`` (MLP) and ``E`` (MoE).
    """

    layer_type_list: Tuple[str, ...]
    mamba_conv_states_shape: Tuple[int, ...]
    mamba_ssm_states_shape: Tuple[int, ...]
    conv_states_dtype: Optional[object] = None
    ssm_states_dtype: Optional[object] = None
