"""dynctx.models: model adapters that run a step's packed tokens through the context."""

from ._common import TensorParallel
from .deepseek import DeepseekV2Adapter
from .generic import GenericAdapter
from .llama import LlamaAdapter
from .nemotron_h import NemotronHAdapter
from .paged_attention import PagedAttention, paged_attention_torch, resolve_attention_backend

__all__ = ["DeepseekV2Adapter", "GenericAdapter", "LlamaAdapter", "NemotronHAdapter",
           "PagedAttention", "TensorParallel", "paged_attention_torch", "resolve_attention_backend"]
