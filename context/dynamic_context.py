"""``DynamicInferenceContext``: paged KV cache and in-flight batching state.

How state is kept. The host knows every request's lengths, so it holds the authoritative copy
of all per-request integers (ids, lengths, offsets, block counts, the block table) and the
request metadata, in numpy arrays laid out in one byte arena (``staging.HostArena``). The
device holds the same arena, the block table, the pending next token of every row, the token
arrays of the step and the KV buffer. Changes reach the device in bulk:

* ``update_requests`` reads back the finish mask (the step's one sync), runs the whole state
  machine on the host (finish, compact, pause, resume, evict: docs/SEMANTICS.md §9, the fixed
  version), uploads the arena (one copy, with the plan) and applies the plan to the device
  block table and next tokens with one ``compact_requests`` launch;
* ``add_request`` validates and reserves on the host at once (errors raise there, before any
  change) and stages its device writes;
* ``initialize_attention_state`` computes the attention metadata on the host, uploads the
  arena, the block-table rows of new requests and the prompt tokens, and builds the per-token
  arrays with one ``step_metadata`` launch.

Rows are laid out ``[paused | active | free]`` as in Megatron-Core; active rows hold decode
requests first, then prefills, a chunked prefill last.
"""

from __future__ import annotations

import logging
import math
import warnings
from types import SimpleNamespace
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dynctx.kernels import _backend
from dynctx.kernels.kv_append import kv_append
from dynctx.kernels.mla_latent import mla_latent_append
from dynctx.kernels.step_metadata import step_metadata

from .cuda_graphs import context_cuda_graph_ladder, select_step_dimensions
from ._graph_capture import GraphCaptureMixin
from ._fields import (
    _FIELD_RESET,
    _LAYER_SYMBOLS,
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_OUTPUT,
    FIELD_QUERY,
    NUM_FIELDS,
)
from ._logits import LogitsMixin
from ._mamba import MambaMixin
from ._rotary import RotaryMixin
from ._update import UpdateMixin
from .batch_dimensions import InferenceBatchDimensions, MambaInferenceStateConfig
from .block_allocator import BlockAllocator, SlotAllocator
from .errors import (
    BlockOverflowError,
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TensorStateDeallocatedError,
    TokenOverflowError,
    get_mem_size_str,
)
from .requests import DynamicInferenceRequest
from .staging import HostArena, HostToDevice, numpy_dtype

logger = logging.getLogger("dynctx.context")

_GIB = 1024 ** 3


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


class DynamicInferenceContext(RotaryMixin, LogitsMixin, UpdateMixin, MambaMixin,
                              GraphCaptureMixin):
    """Paged KV cache plus in-flight batching bookkeeping (Megatron-Core's API).

    Args (keyword only, Megatron-Core's names):
        params_dtype: dtype of the KV cache.
        num_layers: attention layers on this pipeline stage (hybrids: ignored, the layer
            type list decides).
        kv_channels: head dimension.
        num_attention_heads: heads the cache STORES, i.e. the KV heads (GQA query groups),
            as Megatron-Core's callers pass it; divided by ``tensor_model_parallel_size``.
        max_sequence_length: prompt + generated tokens of one request, at most.
        buffer_size_gb: GiB of KV blocks (per rank).
        paused_buffer_size_gb: GiB of the paused budget (Megatron-Core 0.16). When None:
            half of the buffer at ``unified_memory_level=0``; at level 1 a paused region as
            large as the buffer on top of it (managed memory on CUDA; CPU tensors and CUDA
            devices without managed memory behave as level 0).
        max_requests: request rows; default: about one block per request.
        max_tokens: tokens of one forward pass (default ``DEFAULT_MAX_TOKENS``).
        block_size_tokens: tokens per KV block.
        tensor_model_parallel_size: TP size (default 1).
        cache_mla_latent, kv_lora_rank, qk_pos_emb_head_dim: MLA latent cache.
        materialize_only_last_token_logits: stored for the model (as in Megatron-Core).
        use_flashinfer_fused_rope: True: FlashInfer (error where it cannot run); None:
            FlashInfer where it can run, else ours; False: ours.
        unified_memory_level: 0 or 1 (see ``paused_buffer_size_gb``).
        mamba_inference_state_config: makes the model a hybrid: its ``layer_type_list``
            decides which layers are attention (``*``) and Mamba (``M``); every request gets a
            Mamba state slot; ``mamba_states_cache``, ``mamba_metadata`` and the Mamba state
            gather/scatter serve the Mamba layers.
        metrics_writer: any object with a wandb-style ``log(dict)``; receives the utilization
            stats after every ``update_requests``.
        request_metadata_types: ``[(label, dtype, on_device)]``; default
            ``DynamicInferenceRequest.get_metadata_types()``.
        device: where the state lives (default: the current CUDA device, else the CPU).
        kernel_backend: ``"auto"`` (Triton on CUDA, torch references on a CPU), ``"triton"``
            or ``"torch"``; None reads ``$DYNCTX_KERNEL_BACKEND``.
        fused_rope_kv_append: model adapters rotate K and append K/V in one launch
            (``apply_rotary_emb_and_append_key_value_cache``).
        vocab_size: when given, token ids are checked against it: prompt tokens always (they
            are on the host), sampled tokens when ``validate`` is on.
        validate: turn on the checks that need a device read-back (sampled token ids in range,
            NaN/inf logits); off by default so that a decode step keeps its one sync.
    """

    DEFAULT_MAX_TOKENS = 16384
    TOKEN_ROUNDER = 64
    REQUEST_ROUNDER = 4

    def __init__(
        self,
        *,
        params_dtype: torch.dtype,
        num_layers: int,
        kv_channels: int,
        num_attention_heads: int,
        max_sequence_length: int,
        buffer_size_gb: float,
        paused_buffer_size_gb: Optional[float] = None,
        max_requests: Optional[int] = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        block_size_tokens: int = 256,
        tensor_model_parallel_size: Optional[int] = None,
        pipeline_model_parallel_size: Optional[int] = None,
        pg_collection: Any = None,
        cache_mla_latent: bool = False,
        kv_lora_rank: Optional[int] = None,
        qk_pos_emb_head_dim: Optional[int] = None,
        num_cuda_graphs: Optional[int] = None,
        materialize_only_last_token_logits: Optional[bool] = True,
        mamba_inference_state_config: Optional[MambaInferenceStateConfig] = None,
        use_cuda_graphs_for_non_decode_steps: bool = True,
        use_flashinfer_fused_rope: Optional[bool] = False,
        unified_memory_level: Optional[int] = 1,
        cuda_graph_max_tokens: Optional[int] = None,
        cuda_graph_mixed_prefill_count: Optional[int] = 16,
        metrics_writer: Any = None,
        request_metadata_types: Optional[List[Tuple[str, torch.dtype, bool]]] = None,
        persist_cuda_graphs: Optional[bool] = False,
        offload_kv_cache: Optional[bool] = False,
        context_parallel_size: Optional[int] = None,
        expert_model_parallel_size: Optional[int] = None,
        device: Optional[torch.device | str] = None,
        kernel_backend: Optional[str] = None,
        fused_rope_kv_append: bool = False,
        vocab_size: Optional[int] = None,
        validate: bool = False,
    ):
        # Everything is validated before anything is allocated.
        if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
            raise ValueError(f"params_dtype={params_dtype!r} must be a floating torch.dtype")
        num_layers = _positive_int("num_layers", num_layers)
        kv_channels = _positive_int("kv_channels", kv_channels)
        num_attention_heads = _positive_int("num_attention_heads", num_attention_heads)
        max_sequence_length = _positive_int("max_sequence_length", max_sequence_length)
        block_size_tokens = _positive_int("block_size_tokens", block_size_tokens)
        if not isinstance(buffer_size_gb, (int, float)) or not math.isfinite(buffer_size_gb) \
                or buffer_size_gb <= 0:
            raise ValueError(f"buffer_size_gb={buffer_size_gb!r} must be a positive number")
        if paused_buffer_size_gb is not None and (
                not isinstance(paused_buffer_size_gb, (int, float))
                or not math.isfinite(paused_buffer_size_gb) or paused_buffer_size_gb < 0):
            raise ValueError(f"paused_buffer_size_gb={paused_buffer_size_gb!r} must be >= 0 or None")
        tp = 1 if tensor_model_parallel_size is None else _positive_int(
            "tensor_model_parallel_size", tensor_model_parallel_size)
        for name, value in (("pipeline_model_parallel_size", pipeline_model_parallel_size),
                            ("context_parallel_size", context_parallel_size),
                            ("expert_model_parallel_size", expert_model_parallel_size)):
            if value not in (None, 1):
                raise NotImplementedError(
                    f"{name}={value} is not supported: dynctx runs one pipeline stage without "
                    "context or expert parallelism (pass None or 1)")
        if pg_collection is not None:
            raise NotImplementedError("pg_collection is not supported: pass "
                                      "tensor_model_parallel_size instead")
        if num_attention_heads % tp:
            raise ValueError(f"num_attention_heads={num_attention_heads} must be divisible by "
                             f"tensor_model_parallel_size={tp}")
        if unified_memory_level not in (None, 0, 1):
            raise ValueError(f"unified_memory_level={unified_memory_level!r} must be 0 or 1")
        if persist_cuda_graphs:
            raise NotImplementedError("persist_cuda_graphs=True: CUDA graphs are not supported yet")
        if offload_kv_cache:
            raise NotImplementedError("offload_kv_cache=True: KV offload is not supported")
        if cache_mla_latent:
            kv_lora_rank = _positive_int("kv_lora_rank", kv_lora_rank)
            qk_pos_emb_head_dim = _positive_int("qk_pos_emb_head_dim", qk_pos_emb_head_dim)
        if cuda_graph_max_tokens is not None:
            warnings.warn("cuda_graph_max_tokens is deprecated and ignored", DeprecationWarning,
                          stacklevel=2)
        self.device = torch.device(device) if device is not None else _default_device()
        _backend.check_backend_name(kernel_backend)
        self.kernel_backend = kernel_backend
        if use_flashinfer_fused_rope is True:
            from dynctx.kernels.rope import flashinfer_rope_available

            if not flashinfer_rope_available(self.device):
                raise RuntimeError(
                    "use_flashinfer_fused_rope=True needs flashinfer and a CUDA device; "
                    "pass None (FlashInfer where it can run, else ours) or False")

        self.params_dtype = params_dtype
        self.num_layers = num_layers
        self._configure_layers(num_layers, mamba_inference_state_config)
        self.kv_channels = kv_channels
        self.hidden_size_per_attention_head = kv_channels
        self.num_attention_heads = num_attention_heads
        self.tensor_model_parallel_size = tp
        self.num_attention_heads_per_partition = num_attention_heads // tp
        self.max_sequence_length = max_sequence_length
        self.block_size_tokens = block_size_tokens
        self.cache_mla_latent = bool(cache_mla_latent)
        self.kv_lora_rank = kv_lora_rank
        self.qk_pos_emb_head_dim = qk_pos_emb_head_dim
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.use_flashinfer_fused_rope = use_flashinfer_fused_rope
        self.use_cuda_graphs_for_non_decode_steps = use_cuda_graphs_for_non_decode_steps
        self.cuda_graph_mixed_prefill_count = cuda_graph_mixed_prefill_count
        self.metrics_writer = metrics_writer
        self.fused_rope_kv_append = bool(fused_rope_kv_append)
        self.vocab_size = None if vocab_size is None else _positive_int("vocab_size", vocab_size)
        self.validate = bool(validate)

        # Memory model (docs/SEMANTICS.md §2.5).
        itemsize = torch.empty((), dtype=params_dtype).element_size()
        if self.cache_mla_latent:
            self.kv_reduced_dim = kv_lora_rank + qk_pos_emb_head_dim
            self.block_size_bytes = (itemsize * self.num_attention_layers * block_size_tokens
                                     * self.kv_reduced_dim)
        else:
            self.block_size_bytes = (itemsize * 2 * self.num_attention_layers * block_size_tokens
                                     * self.num_attention_heads_per_partition * kv_channels)
        level = 0 if unified_memory_level is None else unified_memory_level
        if level == 1 and self.device.type != "cuda":
            level = 0  # CPU tensors behave as level 0.
        if level == 1:
            warnings.warn("unified_memory_level=1: CUDA managed memory is not available in "
                          "dynctx; the paused region is allocated as ordinary device memory",
                          stacklevel=2)
        self.unified_memory_level = level
        buffer_bytes = int(buffer_size_gb * _GIB)
        # Hybrids budget one request's Mamba state per block (as the reference does).
        bytes_per_block = self.block_size_bytes + self.mamba_bytes_per_request
        block_count = max(2, buffer_bytes // bytes_per_block)
        if paused_buffer_size_gb is not None:
            paused_count = int(paused_buffer_size_gb * _GIB) // bytes_per_block
            total_count = block_count + paused_count if level == 1 else block_count
        else:
            blocks = 2 * block_count if level == 1 else block_count
            active = max(1, (blocks - 1) // 2)
            paused_count = active
            total_count = 2 * active + 1
        if total_count - paused_count - 1 < 1:
            raise ValueError(
                f"paused_buffer_size_gb={paused_buffer_size_gb} leaves no active blocks: "
                f"{total_count} blocks in all, {paused_count} paused (block of "
                f"{get_mem_size_str(self.block_size_bytes)})")
        self.paused_buffer_size_gb = paused_buffer_size_gb
        self.buffer_size_gb = buffer_size_gb
        self.block_allocator = BlockAllocator(total_count, paused_count)
        self.block_allocator.get_active_used = self._active_used_blocks
        self.block_allocator.get_paused_used = self._paused_used_blocks
        self.block_allocator.get_active_avail = (
            lambda: self.block_allocator.active_count - self._active_used_blocks())
        self.block_allocator.get_paused_avail = (
            lambda: self.block_allocator.paused_count - self._paused_used_blocks())

        if max_requests is None:
            value = total_count - 1
            value -= value % tp
            value -= value % self.REQUEST_ROUNDER
            max_requests = max(value, tp)
        self.max_requests = _positive_int("max_requests", max_requests)
        self.max_tokens = _positive_int("max_tokens", max_tokens or self.DEFAULT_MAX_TOKENS)
        if self.max_tokens < self.max_requests:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= max_requests="
                             f"{self.max_requests} (every request needs a token slot at decode)")
        self.max_kv_block_count = math.ceil(max_sequence_length / block_size_tokens)
        # CUDA graph batch dimensions: Megatron's ladder (context/cuda_graphs.py).
        ladder = context_cuda_graph_ladder(
            num_cuda_graphs=num_cuda_graphs, max_requests=self.max_requests,
            max_tokens=self.max_tokens, max_sequence_length=max_sequence_length, tp_size=tp,
            use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
            cuda_graph_mixed_prefill_count=cuda_graph_mixed_prefill_count)
        self.num_cuda_graphs = num_cuda_graphs
        self._cuda_graph_ladder = ladder
        self.cuda_graph_batch_dimensions_list = list(ladder.cuda_graph_batch_dimensions_list)
        self.cuda_graph_token_counts = (None if ladder.cuda_graph_token_counts is None
                                        else list(ladder.cuda_graph_token_counts))

        types = request_metadata_types or DynamicInferenceRequest.get_metadata_types()
        for label, dtype, _ in types:
            numpy_dtype(dtype)
        self.request_metadata_types = list(types)

        self.is_tensor_state_allocated = False
        self.allocate_all_tensors(is_init=True)
        logger.info("allocated context with active buffer size %s (%d blocks)",
                    get_mem_size_str(self.block_allocator.active_count * self.block_size_bytes),
                    self.block_allocator.active_count)

    def _configure_layers(self, num_layers: int, mamba: Optional[MambaInferenceStateConfig]) -> None:
        """Layer bookkeeping: ``layer_types`` (``*`` attention, ``M`` Mamba, ``-`` MLP, ``E``
        MoE), ``layer_map`` (global 0-based index -> index within its type), Mamba shapes."""
        self.is_hybrid_model = mamba is not None
        self.mamba_bytes_per_request = 0
        if mamba is None:
            self.layer_types = ["*"] * num_layers
            self.mamba_conv_states_shape = self.mamba_ssm_states_shape = None
        else:
            self.layer_types = list(mamba.layer_type_list)
            unknown = set(self.layer_types) - set(_LAYER_SYMBOLS)
            if unknown:
                raise ValueError(f"mamba_inference_state_config.layer_type_list has unknown "
                                 f"symbols {sorted(unknown)}; known: {_LAYER_SYMBOLS}")
            shapes = []
            for name in ("mamba_conv_states_shape", "mamba_ssm_states_shape"):
                shape = getattr(mamba, name)
                if shape is None or not len(shape) or not all(
                        isinstance(d, (int, np.integer)) and d > 0 for d in shape):
                    raise ValueError(f"mamba_inference_state_config.{name}={shape!r} must be a "
                                     "tuple of positive ints")
                shapes.append(tuple(int(d) for d in shape))
            self.mamba_conv_states_shape, self.mamba_ssm_states_shape = shapes
            self.mamba_conv_states_dtype = getattr(mamba, "conv_states_dtype", None) or self.params_dtype
            self.mamba_ssm_states_dtype = getattr(mamba, "ssm_states_dtype", None) or self.params_dtype
        attention = [i for i, t in enumerate(self.layer_types) if t == "*"]
        mamba_layers = [i for i, t in enumerate(self.layer_types) if t == "M"]
        if not attention:
            raise NotImplementedError("a model without attention layers has no KV cache: "
                                      "layer_type_list needs at least one '*'")
        self.num_attention_layers = len(attention)
        self.num_mamba_layers = len(mamba_layers)
        self.layer_map = {g: local for local, g in enumerate(attention)}
        self.layer_map.update({g: local for local, g in enumerate(mamba_layers)})
        if mamba is not None:
            conv_item = torch.empty((), dtype=self.mamba_conv_states_dtype).element_size()
            ssm_item = torch.empty((), dtype=self.mamba_ssm_states_dtype).element_size()
            self.mamba_bytes_per_request = self.num_mamba_layers * (
                conv_item * math.prod(self.mamba_conv_states_shape)
                + ssm_item * math.prod(self.mamba_ssm_states_shape))

    # ------------------------------------------------------------------ allocation
    def allocate_all_tensors(self, *, is_init: bool) -> None:
        """Allocate the device state (at init, and on resume after a suspend).

        After a resume the context is empty: the requests that were in flight when
        ``deallocate_all_tensors`` ran must be added again, as in Megatron-Core.
        """
        if self.is_tensor_state_allocated:
            return
        device, R = self.device, self.max_requests
        sections = [("req", torch.int32, (NUM_FIELDS, R))]
        sections += [(f"meta:{label}", dtype, (R,)) for label, dtype, _ in self.request_metadata_types]
        sections += [("attn_query_lengths", torch.int32, (R,)),
                     ("attn_cu_query", torch.int32, (R + 1,)),
                     ("attn_cu_kv", torch.int32, (R + 1,)),
                     ("attn_kv_lengths", torch.int32, (R,)),
                     ("plan_src", torch.int32, (R,)),
                     ("plan_col", torch.int32, (R,)),
                     ("plan_block", torch.int32, (R,))]
        if self.is_hybrid_model:
            sections += [("mamba_decode_slots", torch.int32, (R,)),
                         ("mamba_prefill_slots", torch.int32, (R,)),
                         ("mamba_chunked_slot", torch.int32, (1,)),
                         ("mamba_cu_seqlens", torch.int32, (R + 1,)),
                         ("mamba_zero_slots", torch.int64, (R,))]
        self._arena = HostArena(sections, device)
        self._h_req = self._arena.host["req"]
        self._h_bt = np.full((R, self.max_kv_block_count), -1, dtype=np.int32)
        self._h_prompt = np.zeros(self.max_tokens, dtype=np.int64)
        self._max_position = -1
        capacity = self._arena.nbytes + self._h_bt.nbytes + 2 * self._h_prompt.nbytes + 4096
        self._h2d = HostToDevice(device, capacity)

        self._block_tables = [torch.full((R, self.max_kv_block_count), -1, dtype=torch.int32,
                                         device=device) for _ in range(2)]
        self._next_tokens = [torch.zeros(R, dtype=torch.int64, device=device) for _ in range(2)]
        self._current = 0
        self._rows_used = [0, 0]
        self._attn_block_table = torch.full((R, self.max_kv_block_count), -1,
                                            dtype=torch.int32, device=device)
        T = self.max_tokens
        self.token_to_input_ids = torch.zeros(T, dtype=torch.int64, device=device)
        self.token_to_pos_ids = torch.zeros(T, dtype=torch.int64, device=device)
        self.token_to_request_idx = torch.full((T,), -1, dtype=torch.int64, device=device)
        self.token_to_block_idx = torch.full((T,), -1, dtype=torch.int64, device=device)
        self.token_to_position_in_request = torch.zeros(T, dtype=torch.int64, device=device)
        self.token_to_local_position_within_kv_block = torch.zeros(T, dtype=torch.int64,
                                                                   device=device)
        self._prompt_tokens = torch.zeros(T, dtype=torch.int64, device=device)
        total = self.block_allocator.total_count
        if self.cache_mla_latent:
            shape = (self.num_attention_layers, total, self.block_size_tokens, self.kv_reduced_dim)
        else:
            shape = (2, self.num_attention_layers, total, self.block_size_tokens,
                     self.num_attention_heads_per_partition, self.kv_channels)
        self.memory_buffer = torch.empty(shape, dtype=self.params_dtype, device=device)
        if self.is_hybrid_model:
            self.mamba_conv_states = torch.empty(
                (self.num_mamba_layers, R, *self.mamba_conv_states_shape),
                dtype=self.mamba_conv_states_dtype, device=device)
            self.mamba_ssm_states = torch.empty(
                (self.num_mamba_layers, R, *self.mamba_ssm_states_shape),
                dtype=self.mamba_ssm_states_dtype, device=device)
            self._mamba_seq_idx = torch.full((T,), -1, dtype=torch.int32, device=device)
            self._h_seq_idx = np.full(T, -1, dtype=np.int32)
            self._mamba_slots = SlotAllocator(R)
        self.is_tensor_state_allocated = True
        self.reset()

    def deallocate_all_tensors(self) -> None:
        """Free every device tensor (engine suspend). The in-flight requests are dropped: re-add
        them after ``allocate_all_tensors(is_init=False)``. Any use in between raises
        ``TensorStateDeallocatedError``."""
        if not self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = False
        for name in ("_arena", "_h2d", "_block_tables", "_next_tokens", "_attn_block_table",
                     "token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                     "token_to_block_idx", "token_to_position_in_request",
                     "token_to_local_position_within_kv_block", "_prompt_tokens",
                     "mamba_conv_states", "mamba_ssm_states", "_mamba_seq_idx", "_h_seq_idx",
                     "mamba_metadata",
                     "memory_buffer", "_h_req", "_h_bt", "_h_prompt"):
            setattr(self, name, None)
        self.active_attn_metadata = None
        self.block_allocator.reset()
        self._live_ids = set()
        self.paused_request_count = self.total_request_count = 0
        self.active_token_count = 0

    def _check_allocated(self, request_id: Optional[int] = None) -> None:
        if not self.is_tensor_state_allocated:
            raise TensorStateDeallocatedError(
                request_id, "the context's tensors are deallocated (suspended); call "
                "allocate_all_tensors(is_init=False) first")

    # ------------------------------------------------------------------ rounding
    @classmethod
    def _rounded(cls, value: int, rounder: int, tp_size: Optional[int]) -> int:
        tp = 1 if tp_size is None else int(tp_size)
        step = math.ceil(rounder / tp) * tp
        return step * math.ceil(value / step)

    @classmethod
    def round_up_tokens(cls, value: int, tp_size: Optional[int] = None) -> int:
        """Round up to a multiple of ``TOKEN_ROUNDER`` that is also divisible by ``tp_size``."""
        return cls._rounded(value, cls.TOKEN_ROUNDER, tp_size)

    @classmethod
    def round_up_requests(cls, value: int, tp_size: Optional[int] = None) -> int:
        """Round up to a multiple of ``REQUEST_ROUNDER`` that is also divisible by ``tp_size``."""
        return cls._rounded(value, cls.REQUEST_ROUNDER, tp_size)

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
        """Build a context from plain configs.

        Reads ``model.config`` (or ``model`` itself) for ``num_layers``, ``kv_channels``,
        ``num_query_groups`` (else ``num_attention_heads``), ``params_dtype``,
        ``tensor_model_parallel_size`` and, for learned absolute positions,
        ``max_position_embeddings``; and ``inference_config`` for ``inference_max_seq_length``
        (else ``max_sequence_length``) and optionally ``params_dtype``. Extra keyword arguments
        go to the constructor.
        """
        config = getattr(model, "config", model)

        def need(obj, *names):
            for name in names:
                value = getattr(obj, name, None)
                if value is not None:
                    return value
            raise ValueError(f"from_config: {type(obj).__name__} has none of {names}")

        max_seq = getattr(inference_config, "inference_max_seq_length", None) or \
            getattr(inference_config, "max_sequence_length", None)
        if getattr(config, "position_embedding_type", None) == "learned_absolute":
            model_max = need(config, "max_position_embeddings")
            max_seq = min(model_max, max_seq) if max_seq else model_max
            if max_batch_size > model_max:
                raise ValueError(f"max_batch_size={max_batch_size} exceeds the model's "
                                 f"max_position_embeddings={model_max}")
        if max_seq is None:
            max_seq = need(config, "max_sequence_length", "max_position_embeddings")
        max_seq = max(max_seq, max_batch_size)
        dtype = getattr(inference_config, "params_dtype", None) or need(config, "params_dtype")
        return cls(
            params_dtype=dtype,
            num_layers=need(config, "num_layers"),
            kv_channels=need(config, "kv_channels"),
            num_attention_heads=need(config, "num_query_groups", "num_attention_heads"),
            max_sequence_length=max_seq,
            buffer_size_gb=buffer_size_gb,
            num_cuda_graphs=num_cuda_graphs,
            materialize_only_last_token_logits=False,
            mamba_inference_state_config=mamba_inference_state_config,
            use_flashinfer_fused_rope=None,
            unified_memory_level=unified_memory_level,
            tensor_model_parallel_size=getattr(config, "tensor_model_parallel_size", None),
            **kwargs,
        )

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Empty the context: counters, bookkeeping and blocks (the KV buffer keeps its bytes)."""
        self._check_allocated()
        self.total_request_count = 0
        self.paused_request_count = 0
        self.active_token_count = 0
        self.num_prefill_requests = 0
        self.padded_active_token_count = 0
        self.padded_active_request_count = 0
        self.padding_slice = slice(0, 0)
        self.chunked_prefill_request_id = -1
        self.has_explicit_chunked_prefill_req = False
        self._continuation_added = False
        self.batch_dimensions = InferenceBatchDimensions()
        self.padded_batch_dimensions = InferenceBatchDimensions()
        self._using_cuda_graph_this_step = False
        self.newly_paused_request_ids = torch.empty(0, dtype=torch.int64)
        self.evicted_request_ids = torch.empty(0, dtype=torch.int64)
        self._live_ids: set[int] = set()
        self._bt_dirty_from = self.max_requests
        self._device_prompts: list[tuple[torch.Tensor, int]] = []
        self._arena.host_bytes[:] = 0
        for field, value in _FIELD_RESET.items():
            self._h_req[field] = value
        self._h_bt.fill(-1)
        self.block_allocator.reset()
        self._arena.flush(self._h2d)
        for table in self._block_tables:
            table.fill_(-1)
        for tokens in self._next_tokens:
            tokens.zero_()
        self._rows_used = [0, 0]
        self._attn_block_table.fill_(-1)
        self.token_to_request_idx.fill_(-1)
        self.token_to_block_idx.fill_(-1)
        for tensor in (self.token_to_input_ids, self.token_to_pos_ids,
                       self.token_to_position_in_request,
                       self.token_to_local_position_within_kv_block):
            tensor.zero_()
        self.reset_mamba_state()
        self.reset_attention_state()

    def reset_attention_state(self) -> None:
        """Forget this step's attention (and Mamba) metadata: ``cu_query_lengths``,
        ``mamba_metadata`` etc. become invalid until the next ``initialize_attention_state``."""
        self.active_attn_metadata = None
        self.mamba_metadata = None

    # ------------------------------------------------------------------ device views
    def _sync_device(self) -> None:
        if self._arena.dirty:
            self._arena.flush(self._h2d)

    def _device_field(self, field: int) -> torch.Tensor:
        self._check_allocated()
        self._sync_device()
        return self._arena.device["req"][field]

    request_ids = property(lambda self: self._device_field(FIELD_IDS),
                           doc="int32 [max_requests]: request id per row (-1 free)")
    request_query_lengths = property(lambda self: self._device_field(FIELD_QUERY))
    request_output_lengths = property(lambda self: self._device_field(FIELD_OUTPUT))
    request_kv_length_offsets = property(lambda self: self._device_field(FIELD_KV_OFFSET))
    request_kv_block_counts = property(lambda self: self._device_field(FIELD_BLOCKS))
    request_last_kv_block_id = property(lambda self: self._device_field(FIELD_LAST_BLOCK))
    request_last_kv_block_offset = property(lambda self: self._device_field(FIELD_LAST_OFFSET))

    @property
    def request_to_kv_block_ids(self) -> torch.Tensor:
        """int32 ``[max_requests, max_kv_block_count]`` block table (-1 unused)."""
        self._check_allocated()
        self._flush_block_rows()
        return self._block_tables[self._current]

    @property
    def request_metadata(self) -> dict[str, torch.Tensor]:
        """Per-label device tensors ``[max_requests]`` of the request metadata."""
        self._check_allocated()
        self._sync_device()
        return {label: self._arena.device[f"meta:{label}"]
                for label, _, _ in self.request_metadata_types}

    @property
    def paused_tokens(self) -> Optional[torch.Tensor]:
        """Pending next input token of each paused request (a view), or None."""
        if self.paused_request_count == 0:
            return None
        return self._next_tokens[self._current][:self.paused_request_count]

    @property
    def kv_block_counts_host(self) -> np.ndarray:
        """Host copy of the per-row block counts (no sync)."""
        self._check_allocated()
        return self._h_req[FIELD_BLOCKS]

    @property
    def block_table_host(self) -> np.ndarray:
        """Host copy of the block table (no sync)."""
        self._check_allocated()
        return self._h_bt

    def host_request_ids(self) -> np.ndarray:
        """Host copy of the request id of each row in ``[0, total_request_count)``."""
        self._check_allocated()
        return self._h_req[FIELD_IDS, :self.total_request_count]

    # ------------------------------------------------------------------ simple queries
    def is_static_batching(self) -> bool:
        return False

    def is_decode_only(self) -> bool:
        return self.num_prefill_requests == 0

    def using_cuda_graph_this_step(self) -> bool:
        return self._using_cuda_graph_this_step

    def has_unfinished_requests(self) -> bool:
        return self.total_request_count > 0

    def get_active_request_count(self) -> int:
        return self.total_request_count - self.paused_request_count

    @property
    def num_decode_requests(self) -> int:
        return self.total_request_count - self.paused_request_count - self.num_prefill_requests

    def _active_used_blocks(self) -> int:
        P, T = self.paused_request_count, self.total_request_count
        return int(self._h_req[FIELD_BLOCKS, P:T].sum())

    def _paused_used_blocks(self) -> int:
        return int(self._h_req[FIELD_BLOCKS, :self.paused_request_count].sum())

    def _require_attention_state(self, method: str) -> SimpleNamespace:
        self._check_allocated()
        if self.active_attn_metadata is None:
            raise RuntimeError(f"{method}() is valid only between initialize_attention_state() "
                               "and the next update_requests()/reset_attention_state()")
        return self.active_attn_metadata

    def cu_query_lengths(self) -> Tuple[torch.Tensor, int]:
        """``(cu_query_lengths [padded_requests + 1] int32, max_seqlen_q)``."""
        meta = self._require_attention_state("cu_query_lengths")
        return meta.cu_query_seq_lengths, meta.max_seqlen_q

    def cu_kv_lengths(self) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """``(cu_kv_lengths [padded_requests + 1], kv_seq_lengths [padded_requests], max_seqlen_k)``."""
        meta = self._require_attention_state("cu_kv_lengths")
        return meta.cu_kv_seq_lengths, meta.kv_seq_lengths, meta.max_seqlen_k

    def get_active_sequence_lengths(self) -> torch.Tensor:
        """int32 ``[active]``: tokens in the KV cache after this step, per active request."""
        P, T = self.paused_request_count, self.total_request_count
        return self.request_kv_length_offsets[P:T] + self.request_query_lengths[P:T]

    def get_max_sequence_lengths(self) -> torch.Tensor:
        """int32 ``[active]`` view: each active request's target total length."""
        P, T = self.paused_request_count, self.total_request_count
        return self.request_output_lengths[P:T]

    def get_index_of_chunked_prefill_request(self) -> int:
        """Row of the chunked prefill request (always the last active row), or -1."""
        if self.chunked_prefill_request_id == -1:
            return -1
        return self.total_request_count - 1

    # ------------------------------------------------------------------ admission
    def _request_lengths(self, req: DynamicInferenceRequest, chunk_length: Optional[int]):
        if not isinstance(req, DynamicInferenceRequest) and not hasattr(req, "remaining_prompt_tokens"):
            raise TypeError(f"req must be a DynamicInferenceRequest, got {type(req).__name__}")
        remaining = req.remaining_prompt_tokens
        if remaining is None:
            raise ValueError(f"request {req.request_id}: prompt_tokens is missing")
        if isinstance(remaining, torch.Tensor):
            if remaining.is_floating_point() or remaining.is_complex() or remaining.dtype == torch.bool:
                raise TypeError(f"request {req.request_id}: prompt tokens must be integer ids, "
                                f"got dtype {remaining.dtype}")
            if remaining.dim() != 1:
                raise ValueError(f"request {req.request_id}: prompt tokens must be 1-D, got shape "
                                 f"{tuple(remaining.shape)}")
        remaining_length = len(remaining)
        finished = int(req.finished_chunk_token_count)
        if remaining_length == 0:
            raise ValueError(f"request {req.request_id}: the prompt is empty "
                             "(remaining_prompt_tokens has no tokens)")
        chunk = remaining_length if chunk_length is None else chunk_length
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or \
                not 0 < chunk <= remaining_length:
            raise ValueError(f"chunk_length={chunk_length!r} must be an int in [1, "
                             f"{remaining_length}] (the remaining prompt length)")
        return int(chunk), remaining_length, finished

    @staticmethod
    def _check_request_id(request_id: Any) -> int:
        if isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer)):
            raise TypeError(f"request_id={request_id!r} must be an int")
        if not 0 <= request_id < 2 ** 31:
            raise ValueError(f"request_id={request_id} must lie in [0, 2**31) (-1 marks free rows)")
        return int(request_id)

    def _metadata_values(self, req: DynamicInferenceRequest) -> list:
        """The request's metadata as numpy scalars of the context's dtypes; raises ValueError
        naming the field when a value does not fit (before anything is reserved)."""
        values = []
        for (label, dtype, _), value in zip(self.request_metadata_types, req.tracked_metadata):
            np_type = numpy_dtype(dtype)
            if np.issubdtype(np_type, np.integer):
                info = np.iinfo(np_type)
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                        or not info.min <= value <= info.max:
                    raise ValueError(f"request {req.request_id}: {label}={value!r} must be an int "
                                     f"in [{info.min}, {info.max}] ({dtype})")
            elif np_type is np.bool_:
                if not isinstance(value, (bool, np.bool_, int, np.integer)):
                    raise ValueError(f"request {req.request_id}: {label}={value!r} must be a bool")
            else:
                if not isinstance(value, (int, float, np.number)) or math.isnan(value):
                    raise ValueError(f"request {req.request_id}: {label}={value!r} must be a "
                                     "number (not NaN)")
            values.append(np_type(value))
        return values

    def check_availability(self, req: DynamicInferenceRequest) -> Tuple[bool, bool, bool]:
        """``(request slot free, tokens fit, KV blocks available)`` for the whole remaining
        prompt; host only."""
        self._check_allocated(getattr(req, "request_id", None))
        remaining = req.remaining_prompt_length
        finished = req.finished_chunk_token_count
        bs = self.block_size_tokens
        request_ok = (self.total_request_count < self.max_requests
                      and self.paused_request_count == 0)
        token_ok = self.active_token_count + remaining <= self.max_tokens
        blocks = math.ceil((remaining + finished) / bs) - math.ceil(finished / bs)
        return request_ok, token_ok, self.block_allocator.total_avail >= blocks

    def add_request(self, req: DynamicInferenceRequest, chunk_length: Optional[int] = None) -> None:
        """Add a request (or the next chunk of the chunked prefill request).

        All checks run first and raise without changing anything; the device writes are staged
        and reach the device at ``initialize_attention_state``. The caller advances
        ``req.remaining_prompt_tokens`` and ``req.finished_chunk_token_count``.
        """
        request_id = getattr(req, "request_id", None)
        self._check_allocated(request_id)
        request_id = self._check_request_id(request_id)
        chunk, remaining_length, finished = self._request_lengths(req, chunk_length)
        bs = self.block_size_tokens
        P, T = self.paused_request_count, self.total_request_count
        is_continuation = finished > 0
        gen = req.sampling_params.num_tokens_to_generate
        if gen is None or gen < 0:
            raise ValueError(f"request {request_id}: num_tokens_to_generate={gen} must be >= 0")
        total_length = finished + remaining_length + gen
        if total_length > self.max_sequence_length:
            raise MaxSequenceLengthOverflowError(
                request_id, f"prompt ({finished + remaining_length}) + num_tokens_to_generate "
                f"({gen}) = {total_length} exceeds max_sequence_length "
                f"({self.max_sequence_length})")
        if is_continuation:
            last_id = int(self._h_req[FIELD_IDS, T - 1]) if T > P else None
            if last_id != request_id or self.num_prefill_requests:
                raise ValueError(
                    f"request {request_id}: finished_chunk_token_count={finished} marks a "
                    f"continuation, but the last active row holds request {last_id}: continue "
                    "a chunked prefill first thing in the step after its previous chunk")
            row = T - 1
            tokens_before = self.active_token_count - 1
        else:
            if request_id in self._live_ids:
                raise ValueError(f"request_id={request_id} is already in the context")
            if T >= self.max_requests:
                raise RequestOverflowError(request_id, f"all {self.max_requests} request rows "
                                                       "are in use (max_requests)")
            if self.chunked_prefill_request_id != -1:
                raise ValueError(f"request {request_id}: the chunked prefill request "
                                 f"{self.chunked_prefill_request_id} must stay the last active "
                                 "row; add new requests before its next chunk, not after it")
            if self.is_hybrid_model and self._continuation_added:
                raise ValueError(f"request {request_id}: on a hybrid model the continuation chunk "
                                 "added in this step must stay the last row (it alone starts "
                                 "from its saved Mamba state); add new requests in the next step")
            row = T
            tokens_before = self.active_token_count
        if tokens_before + chunk > self.max_tokens:
            raise TokenOverflowError(request_id, f"{tokens_before} tokens in the step + chunk "
                                                 f"{chunk} > max_tokens ({self.max_tokens})")
        already = math.ceil(finished / bs)
        needed = math.ceil((finished + chunk) / bs)
        if needed - already > self.block_allocator.total_avail:
            raise BlockOverflowError(request_id, f"needs {needed - already} blocks, "
                                                 f"{self.block_allocator.total_avail} free")
        prompt = req.remaining_prompt_tokens[:chunk]
        host_prompt = None
        if not (isinstance(prompt, torch.Tensor) and prompt.device.type != "cpu"):
            host_prompt = np.asarray(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt,
                                     dtype=np.int64)
            if host_prompt.size and host_prompt.min() < 0:
                raise ValueError(f"request {request_id}: prompt token ids must be >= 0")
            if self.vocab_size is not None and host_prompt.size and \
                    host_prompt.max() >= self.vocab_size:
                raise ValueError(f"request {request_id}: prompt token id {host_prompt.max()} is "
                                 f"outside the vocabulary (vocab_size={self.vocab_size})")
        elif prompt.device != self.device:
            raise ValueError(f"request {request_id}: prompt tokens live on {prompt.device}, the "
                             f"context on {self.device}")
        metadata = None if is_continuation else self._metadata_values(req)
        if self.is_hybrid_model and not is_continuation and self._mamba_slots.free_count == 0:
            raise ContextOverflowError(request_id, "No Mamba slots available")

        # From here on nothing raises: reserve and write.
        new_blocks = self.block_allocator.allocate_memory_blocks(needed - already)
        h = self._h_req
        if is_continuation:
            self.active_token_count -= 1
            self._continuation_added = True
        else:
            h[:, row] = 0
            h[FIELD_IDS, row] = request_id
            h[FIELD_MAMBA_SLOT, row] = -1
            if self.is_hybrid_model:
                # A new request starts from zero Mamba state; the zeroing is flushed per step.
                slot = self._mamba_slots.allocate()
                h[FIELD_MAMBA_SLOT, row] = slot
                self._arena.host["mamba_zero_slots"][self._mamba_zero_count] = slot
                self._mamba_zero_count += 1
            self._h_bt[row] = -1
            for (label, _, _), value in zip(self.request_metadata_types, metadata):
                self._arena.host[f"meta:{label}"][row] = value
            self._live_ids.add(request_id)
        self._h_bt[row, already:needed] = new_blocks
        h[FIELD_QUERY, row] = chunk
        h[FIELD_OUTPUT, row] = finished + chunk + gen
        h[FIELD_KV_OFFSET, row] = finished
        h[FIELD_BLOCKS, row] = needed
        h[FIELD_LAST_BLOCK, row] = self._h_bt[row, needed - 1]
        h[FIELD_LAST_OFFSET, row] = (finished + chunk - 1) % bs
        self._bt_dirty_from = min(self._bt_dirty_from, row)
        self._arena.dirty = True

        num_decode = self.total_request_count - self.paused_request_count - self.num_prefill_requests
        if is_continuation:
            num_decode -= 1
        offset = tokens_before - num_decode
        if host_prompt is not None:
            self._h_prompt[offset:offset + chunk] = host_prompt
        else:
            self._device_prompts.append((prompt, offset))
        self.active_token_count = tokens_before + chunk
        if not is_continuation:
            self.total_request_count += 1
        self.num_prefill_requests += 1

    # ------------------------------------------------------------------ the step
    def _flush_block_rows(self) -> None:
        """Upload the block-table rows that ``add_request`` changed."""
        lo, hi = self._bt_dirty_from, self.total_request_count
        if lo < hi:
            self._h2d.copy(self._block_tables[self._current][lo:hi], self._h_bt[lo:hi])
            self._rows_used[self._current] = max(self._rows_used[self._current], hi)
        self._bt_dirty_from = self.max_requests

    def initialize_attention_state(self, *, construct_graph_dimensions: Optional[
            InferenceBatchDimensions] = None) -> None:
        """Prepare the step's token arrays and attention metadata (eager path); with
        ``construct_graph_dimensions`` (an empty context), first add that graph's capture
        dummies (``add_dummy_requests_for_cudagraph_capture``)."""
        self._check_allocated()
        if construct_graph_dimensions is not None:
            self.add_dummy_requests_for_cudagraph_capture(construct_graph_dimensions)
        P, T = self.paused_request_count, self.total_request_count
        A = T - P
        active = self.active_token_count
        prefill = self.num_prefill_requests
        if self.chunked_prefill_request_id != -1 and prefill == 0 and A:
            # The chunked request's row holds a placeholder token, not a real one: forwarding it
            # would write K/V at a position whose block may not exist (docs/SEMANTICS.md §10).
            raise RuntimeError(
                f"the chunked prefill request {self.chunked_prefill_request_id} needs its next "
                "chunk (add_request) before this step; a step without it would forward its "
                "placeholder token")
        decode = A - prefill
        # A continuation chunk of a hybrid starts from its saved Mamba state (docs/SEMANTICS.md §0.3);
        # the context knows it added one, whatever the engine's explicit flag says.
        chunked = self.is_hybrid_model and self._continuation_added
        self.batch_dimensions = InferenceBatchDimensions(active, prefill, decode, chunked)
        # The CUDA graph that fits, else eager padding capped at max_tokens (cuda_graphs.py).
        choice = select_step_dimensions(
            self.batch_dimensions, self._cuda_graph_ladder, strict=self.is_hybrid_model,
            max_requests=self.max_requests, max_tokens=self.max_tokens,
            tp_size=self.tensor_model_parallel_size,
            token_rounder=self.TOKEN_ROUNDER, request_rounder=self.REQUEST_ROUNDER)
        self._using_cuda_graph_this_step = choice.using_cuda_graph_this_step
        padded = choice.padded_batch_dimensions
        padded_requests = padded.req_count
        self.padded_batch_dimensions = padded
        self.padded_active_token_count = padded.token_count
        self.padded_active_request_count = padded_requests
        self.padding_slice = slice(active, padded.token_count)

        # Attention metadata, on the host: padded rows get q = kv = 0, cu values carry over.
        arena = self._arena.host
        q = self._h_req[FIELD_QUERY, P:T]
        kv = self._h_req[FIELD_KV_OFFSET, P:T] + q
        arena["attn_query_lengths"][:A] = q
        arena["attn_query_lengths"][A:padded_requests] = 0
        arena["attn_kv_lengths"][:A] = kv
        arena["attn_kv_lengths"][A:padded_requests] = 0
        cu_q, cu_kv = arena["attn_cu_query"], arena["attn_cu_kv"]
        cu_q[0] = cu_kv[0] = 0
        np.cumsum(q, out=cu_q[1:A + 1])
        np.cumsum(kv, out=cu_kv[1:A + 1])
        cu_q[A + 1:padded_requests + 1] = cu_q[A]
        cu_kv[A + 1:padded_requests + 1] = cu_kv[A]
        if active != cu_q[A]:
            raise RuntimeError(f"internal: active_token_count={active} but the query lengths sum "
                               f"to {cu_q[A]}")
        if self.is_hybrid_model:
            mamba = self._mamba_host_metadata(P, A, decode, prefill, chunked, padded, cu_q)
        self._arena.flush(self._h2d)
        self._flush_block_rows()
        num_prompt = active - decode
        if num_prompt > 0:
            self._h2d.copy(self._prompt_tokens[:num_prompt], self._h_prompt[:num_prompt])
        for tensor, offset in self._device_prompts:
            self._prompt_tokens[offset:offset + tensor.numel()].copy_(tensor)
        self._device_prompts = []

        device = self._arena.device
        table = self._block_tables[self._current]
        step_metadata(
            self.token_to_input_ids, self.token_to_pos_ids, self.token_to_request_idx,
            self.token_to_block_idx, self.token_to_position_in_request,
            self.token_to_local_position_within_kv_block, self._attn_block_table,
            table[P:T], device["req"][FIELD_QUERY, P:T], device["req"][FIELD_KV_OFFSET, P:T],
            device["attn_cu_query"], self._next_tokens[self._current][P:T], self._prompt_tokens,
            num_requests=A, num_decode=decode, active_tokens=active,
            padded_tokens=padded.token_count, padded_requests=padded_requests, row_offset=P,
            block_size=self.block_size_tokens, dummy_block=self.block_allocator.dummy_block_idx,
            backend=self.kernel_backend)
        if self.is_hybrid_model:
            self.mamba_metadata = self._mamba_device_metadata(mamba, padded.token_count)
        self._h2d.advance()

        max_seqlen_q = int(q.max()) if A else 1
        max_seqlen_k = int(kv.max()) if A else 1
        self._max_position = max_seqlen_k - 1
        self.active_attn_metadata = SimpleNamespace(
            query_lengths=device["attn_query_lengths"][:padded_requests],
            cu_query_seq_lengths=device["attn_cu_query"][:padded_requests + 1],
            cu_kv_seq_lengths=device["attn_cu_kv"][:padded_requests + 1],
            kv_seq_lengths=device["attn_kv_lengths"][:padded_requests],
            block_table=self._attn_block_table[:padded_requests],
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
        )
        self.active_attn_metadata.state_data = vars(self.active_attn_metadata).copy()

    def current_input_and_position_ids(self, *, num_warmup_tokens: Optional[int] = None
                                       ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [1, n], position_ids [1, n])`` views, n = padded tokens of the step."""
        self._check_allocated()
        n = num_warmup_tokens or self.padded_active_token_count
        if not 0 <= n <= self.max_tokens:
            raise ValueError(f"num_warmup_tokens={num_warmup_tokens} must lie in [0, max_tokens="
                             f"{self.max_tokens}]")
        return self.token_to_input_ids[:n].unsqueeze(0), self.token_to_pos_ids[:n].unsqueeze(0)

    # ------------------------------------------------------------------ KV cache
    def _layer_index(self, layer_number: int, kind: str = "*") -> int:
        """Index within its type of a 1-based layer number of this stage, checked to be of
        ``kind`` (``*`` attention, ``M`` Mamba)."""
        layers = len(self.layer_types)
        if isinstance(layer_number, bool) or not isinstance(layer_number, (int, np.integer)) \
                or not 1 <= layer_number <= layers:
            raise ValueError(f"layer_number={layer_number!r} must be an int in [1, {layers}] "
                             "(1-based, local to this stage)")
        actual = self.layer_types[int(layer_number) - 1]
        if actual != kind:
            raise ValueError(f"layer_number={layer_number} is a {_LAYER_SYMBOLS[actual]} layer, "
                             f"not a {_LAYER_SYMBOLS[kind]} layer")
        return self.layer_map[int(layer_number) - 1]

    def _check_step_tensor(self, name: str, tensor: torch.Tensor, n: int) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != self.device:
            raise ValueError(f"{name} is on {tensor.device}, the context on {self.device}")
        if tensor.dtype != self.params_dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype}, the cache {self.params_dtype}")
        if tensor.shape[0] < n:
            raise ValueError(f"{name} has {tensor.shape[0]} tokens, the step has {n} "
                             "(padded_active_token_count)")

    def append_key_value_cache(self, layer_number: int, key: torch.Tensor,
                               value: Optional[torch.Tensor]) -> None:
        """Write the step's K and V (``[>= n, 1, H, D]`` or ``[>= n, H, D]``) into the cache;
        with ``cache_mla_latent``, ``key`` is the concatenated latent ``[>= n, 1, rank + rope]``
        and ``value`` is ignored."""
        self._check_allocated()
        self._require_attention_state("append_key_value_cache")
        layer = self._layer_index(layer_number)
        n = self.padded_active_token_count
        blocks = self.token_to_block_idx[:n]
        slots = self.token_to_local_position_within_kv_block[:n]
        self._check_step_tensor("key", key, n)
        if self.cache_mla_latent:
            width = self.kv_reduced_dim
            if not (key.dim() == 2 or (key.dim() == 3 and key.shape[1] == 1)) or \
                    key.shape[-1] != width:
                raise ValueError(f"key must be the MLA latent [n, 1, {width}] or [n, {width}] "
                                 f"(kv_lora_rank + qk_pos_emb_head_dim), got {tuple(key.shape)}")
            latent = key[:, 0] if key.dim() == 3 else key
            rank = self.kv_lora_rank
            mla_latent_append(self.memory_buffer[layer], latent[:, :rank], latent[:, rank:],
                              blocks, slots, backend=self.kernel_backend)
            return
        self._check_step_tensor("value", value, n)
        kv_append(self.memory_buffer[0, layer], self.memory_buffer[1, layer], key, value, blocks,
                  slots, backend=self.kernel_backend)

    def key_value_cache(self, layer_number: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(K, V)`` views ``[num_blocks, block_size, H, D]`` of one layer; with MLA
        ``(latent [num_blocks, block_size, rank + rope], None)``. The block table of the step
        is ``active_attn_metadata.block_table``."""
        self._check_allocated()
        layer = self._layer_index(layer_number)
        if self.cache_mla_latent:
            return self.memory_buffer[layer], None
        return self.memory_buffer[0, layer], self.memory_buffer[1, layer]

    # ------------------------------------------------------------------ stats
    def get_kvcache_utilization_stats(self) -> dict:
        """Block usage of the buffer and of the active requests; host only."""
        self._check_allocated()
        alloc = self.block_allocator
        total = max(alloc.total_count - 1, 1)
        allocated = alloc.total_count - 1 - alloc.total_avail
        P, T = self.paused_request_count, self.total_request_count
        rows = self._h_bt[P:T]
        active_unique = int(np.unique(rows[rows >= 0]).size)
        return {
            "total_blocks": total,
            "allocated_blocks": allocated,
            "active_unique_blocks": active_unique,
            "allocated_utilization": allocated / total,
            "active_utilization": active_unique / total,
            "active_request_count": T - P,
            "paused_request_count": P,
            "paused_blocks": self._paused_used_blocks(),
            "block_count_avail": alloc.total_avail,
            "active_token_count": self.active_token_count,
            "total_request_count": T,
            "max_requests": self.max_requests,
        }

    def _log_metrics(self) -> None:
        if self.metrics_writer is not None:
            self.metrics_writer.log({f"inference/{k}": v
                                     for k, v in self.get_kvcache_utilization_stats().items()})

    def maybe_initialize_symmetric_memory(self) -> None:
        raise NotImplementedError("maybe_initialize_symmetric_memory: symmetric memory for "
                                  "tensor-parallel all-reduce is not supported yet")

    def add_dummy_requests_parallel(self, requests: Sequence[DynamicInferenceRequest], *,
                                    count_as_prefill: bool = True) -> None:
        raise NotImplementedError("add_dummy_requests_parallel: CUDA graph capture is not "
                                  "supported yet")

    def __repr__(self) -> str:
        return (f"DynamicInferenceContext(requests {self.total_request_count}/"
                f"{self.max_requests}, paused {self.paused_request_count}, tokens "
                f"{self.active_token_count}/{self.max_tokens}, {self.block_allocator})")
