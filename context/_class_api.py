"""Megatron-Core's class-level API of the context (a mixin of the facade): the rounding
helpers, which read the rounders from the class (Megatron-Core code sets them there), and
``from_config``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional

from .batch_dimensions import MambaInferenceStateConfig
from .sizing import config_from_model
from .step import rounded

if TYPE_CHECKING:
    from .dynamic_context import DynamicInferenceContext


class ClassAPIMixin:
    """``round_up_tokens``, ``round_up_requests``, ``round_up`` and ``from_config``."""

    @classmethod
    def round_up_tokens(cls, value: int, tp_size: Optional[int] = None) -> int:
        """Round up to a multiple of ``TOKEN_ROUNDER`` that is also divisible by ``tp_size``."""
        return rounded(value, cls.TOKEN_ROUNDER, tp_size)

    @classmethod
    def round_up_requests(cls, value: int, tp_size: Optional[int] = None) -> int:
        """Round up to a multiple of ``REQUEST_ROUNDER`` that is also divisible by ``tp_size``."""
        return rounded(value, cls.REQUEST_ROUNDER, tp_size)

    @classmethod
    def round_up(cls, value: int) -> int:
        """Deprecated: ``round_up_tokens``."""
        warnings.warn("round_up is deprecated; use round_up_tokens or round_up_requests",
                      DeprecationWarning, stacklevel=2)
        return cls.round_up_tokens(value)

    @classmethod
    def from_config(cls, inference_config: Any, model: Any, max_batch_size: int,
                    buffer_size_gb: float = 40, num_cuda_graphs: Optional[int] = None,
                    mamba_inference_state_config: Optional[MambaInferenceStateConfig] = None,
                    unified_memory_level: int = 0, **kwargs: Any) -> "DynamicInferenceContext":
        """Build a context from plain configs (``sizing.config_from_model`` says what it
        reads); extra keyword arguments go to the constructor."""
        return cls(**config_from_model(inference_config, model, max_batch_size),
                   buffer_size_gb=buffer_size_gb, num_cuda_graphs=num_cuda_graphs,
                   materialize_only_last_token_logits=False,
                   mamba_inference_state_config=mamba_inference_state_config,
                   use_flashinfer_fused_rope=None, unified_memory_level=unified_memory_level,
                   **kwargs)
