"""Megatron-Core 0.19's ``InferenceConfig`` and the enums it uses (``megatron/core/inference/
config.py`` at tag ``core_v0.19.0``), named and defaulted as there.

A 0.19 user builds the context from a model config and this one (``DynamicInferenceContext(
model_config, inference_config)``, 0.19's form); every field, its default and the checks of
``__post_init__`` are 0.19's, no more and no less: what a field's value means for the context
is checked where the context reads it, naming the argument. ``PrefixCachingEvictionPolicy`` is
the context's own enum (``context/prefix_cache.py``), which is 0.19's.

``verbose`` is an init-only argument, as in 0.19: it is kept as ``_verbose`` and is not a field.
``pg_collection`` takes any object with ``tp`` and ``pp`` groups (0.19 types it
``ProcessGroupCollection``; dynctx does not import Megatron-Core), and ``metrics_writer`` any
object with ``log`` (0.19: a ``WandbModule``).
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass
from enum import Enum
from typing import Any, List, Literal, Optional, Tuple

import torch

from .batch_dimensions import MambaInferenceStateConfig
from .prefix_cache import PrefixCachingEvictionPolicy

__all__ = [
    "AsyncScheduleMode",
    "CudaGraphSizingDistribution",
    "InferenceConfig",
    "KVCacheManagementMode",
    "PrefixCachingCoordinatorPolicy",
    "PrefixCachingEvictionPolicy",
]

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


class PrefixCachingCoordinatorPolicy(str, Enum):
    """How 0.19's data-parallel coordinator routes requests when prefix caching is on."""

    LONGEST_PREFIX = "longest_prefix"
    """The rank with the longest run of matching blocks."""

    FIRST_PREFIX_BLOCK = "first_prefix_block"
    """The rank that holds the first block's hash."""

    LOAD_BALANCED = "load_balanced"
    """The rank with the fewest requests in flight (prefix affinity ignored)."""


class KVCacheManagementMode(str, Enum):
    """What suspend and resume do with the large tensors (KV cache, Mamba states)."""

    PERSIST = "persist"
    """Keep them allocated."""

    OFFLOAD = "offload"
    """Copy them to the host on suspend and back on resume."""

    RECOMPUTE = "recompute"
    """Free them on suspend and allocate them anew on resume."""


class CudaGraphSizingDistribution(str, Enum):
    """How the token counts of the captured CUDA graphs are spaced.

    ``EXPONENTIAL`` halves from ``cuda_graph_max_tokens`` down to the tensor-parallel size;
    ``LINEAR`` takes ``[1, 2, 4]``, then every 8 tokens up to 256, then every 16.
    """

    EXPONENTIAL = "exponential"
    LINEAR = "linear"


class AsyncScheduleMode(str, Enum):
    """When the host resolves a step's requests relative to preparing the next one."""

    LEGACY = "legacy"
    """Resolve the requests, then prepare the next forward pass."""

    ASYNC = "async"
    """Prepare the next forward pass first, then resolve (the phases overlap)."""


@dataclass
class InferenceConfig:
    """Megatron-Core 0.19's inference configuration: 39 fields, in 0.19's order and defaults.

    Sizes: ``block_size_tokens``, ``buffer_size_gb`` (the KV budget per rank; with
    ``unified_memory_level=1`` the paused budget comes on top of it), ``paused_buffer_size_gb``,
    ``mamba_inference_state_config`` (hybrids), ``mamba_memory_ratio`` (the share of the budget
    for Mamba states; ``None``: one state per KV block, or exactly ``max_requests`` states when
    that is given), ``max_requests``, ``max_tokens`` (``None``: 16384),
    ``unified_memory_level``, ``kv_cache_management_mode``.
    CUDA graphs: ``num_cuda_graphs``, ``cuda_graph_mixed_prefill_count``,
    ``cuda_graph_sizing_distribution``, ``use_cuda_graphs_for_non_decode_steps``,
    ``cuda_graph_all_prefills``, ``cuda_graph_max_tokens``, ``static_kv_memory_pointers``.
    Model: ``max_sequence_length``, ``pg_collection``, ``use_flashinfer_fused_rope``
    (``None``: when FlashInfer is installed), ``materialize_only_last_token_logits``.
    Engine: ``enable_chunked_prefill``, ``num_speculative_tokens``, ``enable_prefix_caching``,
    ``prefix_caching_eviction_policy``, ``prefix_caching_coordinator_policy``,
    ``prefix_caching_routing_alpha`` (in [0, 1]), ``prefix_caching_mamba_gb``.
    Logging and the rest: ``track_paused_request_events``, ``track_generated_token_events``,
    ``metrics_writer``, ``logging_step_interval``, ``sampling_backend`` (``"torch"`` or
    ``"flashinfer"``), ``offset_sampling_seed_by_dp_rank``, ``async_sched_mode``,
    ``logprobs_mode`` (``"raw_logprobs"`` or ``"processed_logprobs"``),
    ``request_metadata_types``, ``use_synchronous_zmq_collectives``, ``disable_ep_consensus``,
    ``ep_consensus_interval``.

    ``__post_init__`` (0.19's checks, in 0.19's order): ``async_sched_mode`` becomes an
    ``AsyncScheduleMode`` (an unknown value raises ``ValueError``);
    ``prefix_caching_routing_alpha`` outside [0, 1], an unknown ``logprobs_mode``, and
    ``"processed_logprobs"`` with ``num_speculative_tokens > 0`` raise ``ValueError``;
    ``sampling_backend="flashinfer"`` without FlashInfer installed warns and becomes
    ``"torch"``.
    """

    # KV cache and Mamba states.
    block_size_tokens: int = 256
    buffer_size_gb: int = 20
    paused_buffer_size_gb: Optional[int] = None
    mamba_inference_state_config: Optional[MambaInferenceStateConfig] = None
    mamba_memory_ratio: Optional[float] = None
    max_requests: Optional[int] = None
    max_tokens: Optional[int] = None
    unified_memory_level: int = 0
    kv_cache_management_mode: KVCacheManagementMode = KVCacheManagementMode.PERSIST

    # CUDA graphs.
    num_cuda_graphs: Optional[int] = None
    cuda_graph_mixed_prefill_count: Optional[int] = 16
    cuda_graph_sizing_distribution: CudaGraphSizingDistribution = (
        CudaGraphSizingDistribution.EXPONENTIAL
    )
    use_cuda_graphs_for_non_decode_steps: bool = True
    cuda_graph_all_prefills: bool = False
    cuda_graph_max_tokens: int = 512
    static_kv_memory_pointers: bool = False

    # Model.
    max_sequence_length: int = 2560
    pg_collection: Optional[Any] = None
    use_flashinfer_fused_rope: Optional[bool] = False
    materialize_only_last_token_logits: bool = True

    # Engine.
    enable_chunked_prefill: bool = False
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = False
    prefix_caching_eviction_policy: PrefixCachingEvictionPolicy = (
        PrefixCachingEvictionPolicy.REF_ZERO
    )
    prefix_caching_coordinator_policy: PrefixCachingCoordinatorPolicy = (
        PrefixCachingCoordinatorPolicy.LOAD_BALANCED
    )
    prefix_caching_routing_alpha: float = 0.5
    prefix_caching_mamba_gb: Optional[float] = None

    # Logging and the rest.
    track_paused_request_events: bool = False
    track_generated_token_events: bool = False
    metrics_writer: Optional[Any] = None
    logging_step_interval: int = 0
    sampling_backend: Literal["torch", "flashinfer"] = "torch"
    offset_sampling_seed_by_dp_rank: bool = True
    async_sched_mode: AsyncScheduleMode = AsyncScheduleMode.LEGACY
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    request_metadata_types: Optional[List[Tuple[str, torch.dtype]]] = None
    use_synchronous_zmq_collectives: bool = False
    disable_ep_consensus: bool = False
    ep_consensus_interval: int = 20

    verbose: InitVar[bool] = False

    def __post_init__(self, verbose: bool):
        self._verbose = verbose
        self.async_sched_mode = AsyncScheduleMode(self.async_sched_mode)
        if not (0.0 <= self.prefix_caching_routing_alpha <= 1.0):
            raise ValueError(
                f"prefix_caching_routing_alpha must be in [0, 1], "
                f"got {self.prefix_caching_routing_alpha}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"Unsupported logprobs_mode {self.logprobs_mode!r}. "
                "Supported modes: raw_logprobs, processed_logprobs."
            )
        if self.logprobs_mode == "processed_logprobs" and self.num_speculative_tokens > 0:
            raise ValueError(
                "logprobs_mode='processed_logprobs' is not yet supported with speculative "
                "decoding (num_speculative_tokens > 0)."
            )
        if self.sampling_backend == "flashinfer":
            try:
                import flashinfer  # noqa: F401
            except ImportError:
                warnings.warn(
                    "sampling_backend='flashinfer' was requested but the flashinfer "
                    "package is not installed; falling back to sampling_backend='torch'."
                )
                self.sampling_backend = "torch"
