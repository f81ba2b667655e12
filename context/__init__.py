"""The dynamic inference context: errors, requests, block allocator and the context itself."""

from .batch_dimensions import InferenceBatchDimensions, MambaInferenceStateConfig
from .block_allocator import BlockAllocator
from .config import (
    AsyncScheduleMode,
    CudaGraphSizingDistribution,
    InferenceConfig,
    KVCacheManagementMode,
    PrefixCachingCoordinatorPolicy,
)
from .dynamic_context import DynamicInferenceContext
from .errors import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextErrorFactory,
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    NotHybridError,
    RequestOverflowError,
    StepShapeError,
    TensorStateDeallocatedError,
    TokenOverflowError,
    get_mem_size_str,
)
from .inference_request import compute_block_hashes_batched
from .kv_block_allocator import KVBlockAllocator
from .megatron019 import MAX_INTERMEDIATE_OFFSETS_PER_REQUEST, ConfigAssertionError
from .prefix_cache import PrefixCachingEvictionPolicy
from .requests import DEFAULT_METADATA_TYPES, DynamicInferenceRequest, SamplingParams

__all__ = [
    "ActiveRequestCountOverflowError", "BlockAllocator", "BlockOverflowError",
    "ContextErrorFactory", "ContextOverflowError", "DEFAULT_METADATA_TYPES",
    "DynamicInferenceContext", "DynamicInferenceRequest", "InferenceBatchDimensions",
    "MambaInferenceStateConfig", "MaxSequenceLengthOverflowError", "NotHybridError",
    "PrefixCachingEvictionPolicy",
    "RequestOverflowError", "StepShapeError",
    "SamplingParams", "TensorStateDeallocatedError", "TokenOverflowError", "get_mem_size_str",
]
# Megatron-Core 0.19's configuration and block hashes (context/config.py, inference_request.py).
__all__ += [
    "AsyncScheduleMode", "CudaGraphSizingDistribution", "InferenceConfig",
    "KVCacheManagementMode", "PrefixCachingCoordinatorPolicy", "compute_block_hashes_batched",
]
# Megatron-Core 0.19's constructor (context/megatron019.py).
__all__ += ["ConfigAssertionError", "MAX_INTERMEDIATE_OFFSETS_PER_REQUEST"]
# Megatron-Core 0.19's step API (context/step_api.py, context/gpu_view.py).
from .gpu_view import ContextGPUView  # noqa: E402

__all__ += ["ContextGPUView"]
# Megatron-Core 0.19's allocator (context/kv_block_allocator.py).
__all__ += ["KVBlockAllocator"]
# Megatron-Core 0.19's sampling backends (context/sampling.py).
from .sampling import Sampling, TorchSampling  # noqa: E402

__all__ += ["Sampling", "TorchSampling"]
