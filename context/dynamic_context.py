"""``DynamicInferenceContext``: paged KV cache and in-flight batching state (the facade).

The facade keeps Megatron-Core's names and composes parts that each own one thing:

* ``request_table.RequestTable``: the host rows of every request (ids, lengths, offsets, the
  block table, metadata) and the block and Mamba-slot allocators; the host is authoritative;
* ``admission.plan_add`` and ``update_plan.plan_update``: ``add_request`` and
  ``update_requests`` as plans decided from the unchanged table, with every check;
* ``device_state.DeviceState``: the arena, staging, double-buffered block tables, the step's
  token arrays, the KV buffer and the Mamba states, and the two launches of a step;
* ``step.Step``: the frozen description of one step, built by ``initialize_attention_state``,
  padded to the CUDA graph that fits it (``cuda_graphs``: Megatron-Core's ladder, built here);
* ``_graph_capture``: the dummy requests (``add_dummy_requests_parallel``) and the CUDA graph
  capture dummies, checked as a whole; ``_rows``: ``max_requests`` and the row moves;
  ``_class_api``: the rounding helpers and ``from_config``;
* ``sizing`` and ``compat``: the constructor's sizes and Megatron-Core's unsupported options;
  ``parallel``: the tensor-parallel and pipeline groups and the one construction-time MIN
  all-reduce that makes every rank's allocator identical.

Every mutating call checks its arguments, plans, commits the host, then applies the change on
the device: an error leaves the context exactly as it was.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple

import torch

from dynctx.kernels import _backend

from . import compat
from ._class_api import ClassAPIMixin
from ._fields import (  # noqa: F401 (re-exported: FIELD_* are imported from here)
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
from ._graph_capture import DummyRequestsMixin
from ._kv import KVCacheMixin
from ._logits import LogitsMixin
from ._mamba import MambaMetadata, MambaMixin
from ._prefix_caching import PrefixCachingMixin
from ._rotary import RotaryMixin
from ._rows import RowsMixin
from ._step_api import _EMPTY_IDS, StepMixin
from ._views import StateViewsMixin
from .batch_dimensions import MambaInferenceStateConfig
from .block_allocator import BlockAllocator
from .cuda_graphs import context_cuda_graph_ladder
from .device_state import DeviceState
from .errors import TensorStateDeallocatedError, get_mem_size_str
from .parallel import CountAgreement, joins_agreement_on_failure, parallel_groups
from .prefix_cache import check_prefix_caching_args, prefix_snapshot_count
from .request_table import RequestTable
from .requests import DynamicInferenceRequest
from .sizing import check_scalars, layer_layout, memory_layout, positive_int
from .staging import numpy_dtype
from .step import REQUEST_ROUNDER, TOKEN_ROUNDER, StepBuilder

logger = logging.getLogger("dynctx.context")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        return _default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r}: no CUDA device is available "
                           "(torch.cuda.is_available() is False); pass device='cpu'")
    return device


class DynamicInferenceContext(StateViewsMixin, KVCacheMixin, RotaryMixin, LogitsMixin, MambaMixin,
                              RowsMixin, DummyRequestsMixin, ClassAPIMixin, PrefixCachingMixin,
                              StepMixin):
    """Paged KV cache plus in-flight batching bookkeeping (Megatron-Core's API).

    Args (keyword only, Megatron-Core's names):
        params_dtype: dtype of the KV cache.
        num_layers: layers on this pipeline stage (hybrids: ignored, the layer type list
            decides); layer numbers passed to the cache methods are this stage's, 1-based.
        tensor_model_parallel_size, pipeline_model_parallel_size, pg_collection: the
            tensor-parallel and pipeline groups: ``pg_collection.tp`` / ``.pp``, else
            Megatron-Core's ``parallel_state`` when the caller initialised it, else (tensor
            parallelism only) the default ``torch.distributed`` group of exactly
            ``tensor_model_parallel_size`` ranks (``context/parallel.py``). Every rank sizes its
            buffer to the smallest block count of its tensor and pipeline groups (one MIN
            all-reduce per group at construction, none per step), so all ranks allocate, pause
            and evict alike. ``tensor_model_parallel_size > 1`` without ``torch.distributed``
            sizes one rank's shard in one process.
        kv_channels: head dimension.
        num_attention_heads: heads the cache STORES, i.e. the KV heads (GQA query groups),
            as Megatron-Core's callers pass it; each tensor-parallel rank stores
            ``max(1, num_attention_heads // tensor_model_parallel_size)`` of them (a head is
            replicated when the ranks outnumber the KV heads; one count must divide the other).
            The MLA latent is not divided (every rank caches all of it); Mamba state shapes
            are per rank (``mamba_inference_state_config`` gives this rank's head shard).
        max_sequence_length: prompt + generated tokens of one request, at most. As in
            Megatron-Core, ``add_request`` accepts a request whose prompt +
            ``num_tokens_to_generate`` exceeds it (the engine refuses those at admission) and
            refuses only a prompt longer than it; ``update_requests`` finishes a request that
            reaches it (``max_length_finished_request_ids``). A warning says when the active
            budget cannot hold one such request.
        buffer_size_gb: GiB of KV blocks (per rank).
        paused_buffer_size_gb: GiB of the paused budget (Megatron-Core 0.16). When None:
            half of the buffer at ``unified_memory_level=0``; at level 1 a paused region as
            large as the buffer on top of it (ordinary device memory on CUDA; CPU tensors
            behave as level 0).
        max_requests: request rows; default: about one block per request.
        max_tokens: tokens of one forward pass (default ``DEFAULT_MAX_TOKENS``).
        block_size_tokens: tokens per KV block.
        cache_mla_latent, kv_lora_rank, qk_pos_emb_head_dim: MLA latent cache.
        materialize_only_last_token_logits: stored for the model (as in Megatron-Core).
        use_flashinfer_fused_rope: True: FlashInfer (error where it cannot run); None:
            FlashInfer where it can run, else ours; False: ours.
        unified_memory_level: 0 or 1 (see ``paused_buffer_size_gb``).
        mamba_inference_state_config: makes the model a hybrid: its ``layer_type_list``
            decides which layers are attention (``*``) and Mamba (``M``); every request gets a
            Mamba state slot.
        metrics_writer: any object with a wandb-style ``log(dict)``; receives the utilization
            stats after every ``update_requests``.
        request_metadata_types: ``[(label, dtype, on_device)]``; default
            ``DynamicInferenceRequest.get_metadata_types()``.
        device: where the state lives (default: the current CUDA device, else the CPU).
        kernel_backend: ``"auto"`` (Triton on CUDA, torch references on a CPU), ``"triton"``
            or ``"torch"``; None reads ``$DYNCTX_KERNEL_BACKEND``.
        fused_rope_kv_append: model adapters rotate K and append K/V in one launch.
        vocab_size: when given, token ids are checked against it: prompt tokens always (they
            are on the host), sampled tokens when ``validate`` is on.
        validate: turn on the checks that need a device read-back (sampled token ids in range,
            NaN/inf logits); off by default so that a decode step keeps its one sync.
        enable_prefix_caching, prefix_caching_eviction_policy ("ref_zero" or "lru"),
            prefix_caching_mamba_gb: prefix caching, off by default (docs/SEMANTICS.md §17).
        The options of ``compat.OPTIONS`` are Megatron-Core's and raise or warn as listed there.
    """

    DEFAULT_MAX_TOKENS = 16384
    TOKEN_ROUNDER = TOKEN_ROUNDER
    REQUEST_ROUNDER = REQUEST_ROUNDER

    @joins_agreement_on_failure
    def __init__(
        self, *, params_dtype: torch.dtype, num_layers: int, kv_channels: int,
        num_attention_heads: int, max_sequence_length: int, buffer_size_gb: float,
        paused_buffer_size_gb: Optional[float] = None, max_requests: Optional[int] = None,
        max_tokens: int = DEFAULT_MAX_TOKENS, block_size_tokens: int = 256,
        tensor_model_parallel_size: Optional[int] = None,
        pipeline_model_parallel_size: Optional[int] = None, pg_collection: Any = None,
        cache_mla_latent: bool = False, kv_lora_rank: Optional[int] = None,
        qk_pos_emb_head_dim: Optional[int] = None, num_cuda_graphs: Optional[int] = None,
        materialize_only_last_token_logits: Optional[bool] = True,
        mamba_inference_state_config: Optional[MambaInferenceStateConfig] = None,
        use_cuda_graphs_for_non_decode_steps: bool = True,
        use_flashinfer_fused_rope: Optional[bool] = False,
        unified_memory_level: Optional[int] = 1, cuda_graph_max_tokens: Optional[int] = None,
        cuda_graph_mixed_prefill_count: Optional[int] = 16, metrics_writer: Any = None,
        request_metadata_types: Optional[List[Tuple[str, torch.dtype, bool]]] = None,
        persist_cuda_graphs: Optional[bool] = False, offload_kv_cache: Optional[bool] = False,
        context_parallel_size: Optional[int] = None,
        expert_model_parallel_size: Optional[int] = None,
        device: Optional[torch.device | str] = None, kernel_backend: Optional[str] = None,
        fused_rope_kv_append: bool = False, vocab_size: Optional[int] = None,
        validate: bool = False, enable_prefix_caching: bool = False,
        prefix_caching_eviction_policy: str = "ref_zero",
        prefix_caching_mamba_gb: Optional[float] = None,
    ):
        # Everything is validated before anything is allocated.
        compat.check_options(dict(
            context_parallel_size=context_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            persist_cuda_graphs=persist_cuda_graphs, offload_kv_cache=offload_kv_cache))
        groups = parallel_groups(
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            tensor_model_parallel_size=tensor_model_parallel_size, pg_collection=pg_collection)
        # Should this rank's own arguments fail below, it still joins the ranks' agreement, as
        # failed, so that they all raise (``joins_agreement_on_failure``).
        self._agreement = CountAgreement(groups.groups)
        args = check_scalars(
            params_dtype=params_dtype, num_layers=num_layers, kv_channels=kv_channels,
            num_attention_heads=num_attention_heads, max_sequence_length=max_sequence_length,
            block_size_tokens=block_size_tokens, buffer_size_gb=buffer_size_gb,
            paused_buffer_size_gb=paused_buffer_size_gb,
            tensor_model_parallel_size=groups.tp,
            unified_memory_level=unified_memory_level, cache_mla_latent=cache_mla_latent,
            kv_lora_rank=kv_lora_rank, qk_pos_emb_head_dim=qk_pos_emb_head_dim)
        num_layers, kv_channels = args["num_layers"], args["kv_channels"]
        num_attention_heads, tp = args["num_attention_heads"], args["tp"]
        max_sequence_length = args["max_sequence_length"]
        block_size_tokens = args["block_size_tokens"]
        kv_lora_rank, qk_pos_emb_head_dim = args["kv_lora_rank"], args["qk_pos_emb_head_dim"]
        compat.check_options(dict(cuda_graph_max_tokens=cuda_graph_max_tokens))
        prefix_caching = check_prefix_caching_args(
            enable_prefix_caching, prefix_caching_eviction_policy, prefix_caching_mamba_gb)
        self.device = _resolve_device(device)
        # On a CPU device the bookkeeping tensors handed out are views of the host arrays
        # (write-through), and the arena's device side is its host buffer; on CUDA they are
        # the device mirrors.
        self._host_views_flag = self.device.type == "cpu"
        _backend.check_backend_name(kernel_backend)
        self.kernel_backend = kernel_backend
        self._backend = _backend.resolve_backend(kernel_backend, self.device)
        if use_flashinfer_fused_rope is True:
            from dynctx.kernels.rope_flashinfer import flashinfer_rope_available

            if not flashinfer_rope_available(self.device):
                raise RuntimeError(
                    "use_flashinfer_fused_rope=True needs flashinfer and a CUDA device; "
                    "pass None (FlashInfer where it can run, else ours) or False")
        types = request_metadata_types or DynamicInferenceRequest.get_metadata_types()
        for _, dtype, _ in types:
            numpy_dtype(dtype)
        self.request_metadata_types = list(types)

        self.params_dtype, self.num_layers = params_dtype, num_layers
        self._layers = layers = layer_layout(num_layers, mamba_inference_state_config,
                                             params_dtype)
        for name in ("layer_map", "num_attention_layers", "num_mamba_layers", "is_hybrid_model",
                     "mamba_conv_states_shape", "mamba_ssm_states_shape",
                     "mamba_bytes_per_request"):
            setattr(self, name, getattr(layers, name))
        self.layer_types = list(layers.layer_types)
        if layers.is_hybrid_model:
            self.mamba_conv_states_dtype = layers.mamba_conv_states_dtype
            self.mamba_ssm_states_dtype = layers.mamba_ssm_states_dtype
        self.pipeline_model_parallel_size = groups.pp
        self.pipeline_parallel_group, self.tensor_parallel_group = groups.pp_group, groups.tp_group
        self.kv_channels = self.hidden_size_per_attention_head = kv_channels
        self.num_attention_heads, self.tensor_model_parallel_size = num_attention_heads, tp
        # KV heads per rank; a rank holds one (replicated) head when tp exceeds them.
        self.num_attention_heads_per_partition = max(1, num_attention_heads // tp)
        self.max_sequence_length = max_sequence_length
        self.block_size_tokens = block_size_tokens
        self.cache_mla_latent = bool(cache_mla_latent)
        self.kv_lora_rank, self.qk_pos_emb_head_dim = kv_lora_rank, qk_pos_emb_head_dim
        self.materialize_only_last_token_logits = materialize_only_last_token_logits
        self.use_flashinfer_fused_rope = use_flashinfer_fused_rope
        self.use_cuda_graphs_for_non_decode_steps = use_cuda_graphs_for_non_decode_steps
        self.cuda_graph_mixed_prefill_count = cuda_graph_mixed_prefill_count
        self.metrics_writer = metrics_writer
        self.fused_rope_kv_append = bool(fused_rope_kv_append)
        self.vocab_size = None if vocab_size is None else positive_int("vocab_size", vocab_size)
        self.validate = bool(validate)

        # The settings that steer the bookkeeping agree over the ranks, and the hybrid prefix
        # cache's snapshot count is reduced with the block counts (one all-reduce).
        agreement = self._agreement
        agreement.extra = [prefix_snapshot_count(prefix_caching, layers)]
        agreement.same = dict(
            zip(("enable_prefix_caching", "prefix_caching_eviction_policy"), prefix_caching),
            num_cuda_graphs=num_cuda_graphs, validate=bool(validate), vocab_size=vocab_size,
            use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
            cuda_graph_mixed_prefill_count=cuda_graph_mixed_prefill_count)
        memory = memory_layout(
            layers=layers, params_dtype=params_dtype, block_size_tokens=block_size_tokens,
            heads_per_partition=self.num_attention_heads_per_partition, kv_channels=kv_channels,
            cache_mla_latent=self.cache_mla_latent, kv_lora_rank=kv_lora_rank,
            qk_pos_emb_head_dim=qk_pos_emb_head_dim, unified_memory_level=unified_memory_level,
            device=self.device, buffer_size_gb=buffer_size_gb,
            paused_buffer_size_gb=paused_buffer_size_gb, max_requests=max_requests,
            max_tokens=max_tokens, default_max_tokens=self.DEFAULT_MAX_TOKENS,
            max_sequence_length=max_sequence_length, tp=tp,
            request_rounder=self.REQUEST_ROUNDER,
            reduce_counts=agreement if groups.groups else None)
        self.block_size_bytes, self.kv_reduced_dim = memory.block_size_bytes, memory.kv_reduced_dim
        self.unified_memory_level = memory.unified_memory_level
        self.buffer_size_gb, self.paused_buffer_size_gb = buffer_size_gb, paused_buffer_size_gb
        self._request_rows, self.max_tokens = memory.max_requests, memory.max_tokens
        self.max_kv_block_count = memory.max_kv_block_count
        # CUDA graph batch dimensions: Megatron's ladder (context/cuda_graphs.py).
        ladder = context_cuda_graph_ladder(
            num_cuda_graphs=num_cuda_graphs, max_requests=self._request_rows,
            max_tokens=self.max_tokens, max_sequence_length=max_sequence_length, tp_size=tp,
            use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
            cuda_graph_mixed_prefill_count=cuda_graph_mixed_prefill_count)
        self.num_cuda_graphs = num_cuda_graphs
        self._cuda_graph_ladder = ladder
        self.cuda_graph_batch_dimensions_list = list(ladder.cuda_graph_batch_dimensions_list)
        self.cuda_graph_token_counts = (None if ladder.cuda_graph_token_counts is None
                                        else list(ladder.cuda_graph_token_counts))
        self.block_allocator = alloc = BlockAllocator(memory.total_blocks, memory.paused_blocks)
        alloc.get_active_used = lambda: self._table.active_used_blocks() if self._table.bound else 0
        alloc.get_paused_used = lambda: self._table.paused_used_blocks() if self._table.bound else 0
        alloc.get_active_avail = lambda: alloc.active_count - alloc.get_active_used()
        alloc.get_paused_avail = lambda: alloc.paused_count - alloc.get_paused_used()
        self._table = RequestTable(
            allocator=alloc, max_requests=self._request_rows,
            max_kv_block_count=self.max_kv_block_count, block_size=block_size_tokens,
            metadata_labels=[label for label, _, _ in self.request_metadata_types],
            hybrid=self.is_hybrid_model, max_tokens=self.max_tokens)
        self._setup_prefix_caching(*prefix_caching, snapshots=agreement.extra[0])
        self._device: Optional[DeviceState] = None
        self._steps = StepBuilder(self._request_rows, ladder)
        # (signature, Step, block count sum or None) built by update_requests for the next
        # step (_prepare_next_step), and the signature and block count sum of the current step
        # when they are known.
        self._next_step: Optional[tuple] = None
        self._step_sig: Optional[tuple] = None
        self._step_blocks: Optional[int] = None
        # The steady decode update's shortcut (update_plan.plan_decode); False makes every
        # update take plan_update (tests compare the two).
        self._decode_shortcut = True
        self.chunked_prefill_request_id = -1
        self.is_symmetric_memory_initialized = False
        self.is_tensor_state_allocated = False
        # Megatron-Core builds it with the context; its step fields are filled per step.
        self.mamba_metadata = MambaMetadata(self) if self.is_hybrid_model else None
        self.allocate_all_tensors(is_init=True)
        logger.info("allocated context with active buffer size %s (%d blocks)",
                    get_mem_size_str(alloc.active_count * self.block_size_bytes),
                    alloc.active_count)

    @property
    def _host_views(self) -> bool:
        """Whether the bookkeeping tensors handed out are host views (a CPU device). Set to
        False on a CPU device, the context hands out device mirrors, as on CUDA, and its arena
        stops sharing the host buffer (tests run the CUDA path on a CPU this way)."""
        return self._host_views_flag

    @_host_views.setter
    def _host_views(self, value: bool) -> None:
        self._host_views_flag = bool(value)
        if self._device is not None and self.device.type == "cpu":
            self._device.share_arena(self._host_views_flag)
            self._next_step = None

    # ------------------------------------------------------------------ allocation
    def allocate_all_tensors(self, *, is_init: bool) -> None:
        """Allocate the device state (at init, and on resume after a suspend). After a resume
        the context is empty: re-add the requests that were in flight, as in Megatron-Core."""
        if self.is_tensor_state_allocated:
            return
        total = self.block_allocator.total_count
        if self.cache_mla_latent:
            kv_shape = (self.num_attention_layers, total, self.block_size_tokens,
                        self.kv_reduced_dim)
        else:
            kv_shape = (2, self.num_attention_layers, total, self.block_size_tokens,
                        self.num_attention_heads_per_partition, self.kv_channels)
        self._device = DeviceState(
            device=self.device, backend=self._backend, max_requests=self._request_rows,
            max_tokens=self.max_tokens, max_kv_block_count=self.max_kv_block_count,
            metadata_types=self.request_metadata_types, kv_shape=kv_shape,
            params_dtype=self.params_dtype, layers=self._layers)
        if not self._host_views:
            self._device.share_arena(False)
        self._table.bind(*self._device.table_views())
        self.is_tensor_state_allocated = True
        self.reset()

    def deallocate_all_tensors(self) -> None:
        """Free every device tensor (engine suspend). The in-flight requests are dropped: re-add
        them after ``allocate_all_tensors(is_init=False)``. Any use in between raises
        ``TensorStateDeallocatedError``."""
        if not self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = False
        self._device = None
        self._table.unbind()
        self.reset_attention_state()
        self._step = self._next_step = None
        self.chunked_prefill_request_id = -1

    def _check_allocated(self, request_id: Optional[int] = None) -> None:
        if not self.is_tensor_state_allocated:
            raise TensorStateDeallocatedError(
                request_id, "the context's tensors are deallocated (suspended); call "
                "allocate_all_tensors(is_init=False) first")

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Empty the context: counters, bookkeeping and blocks (the KV buffer keeps its bytes)."""
        self._check_allocated()
        self.chunked_prefill_request_id = -1
        self.has_explicit_chunked_prefill_req = False
        self._step = self._next_step = None
        self._set_step_counts(None)
        self.newly_paused_request_ids = self.evicted_request_ids = _EMPTY_IDS
        self.max_length_finished_request_ids = _EMPTY_IDS
        self._hand_written = False
        self._table.reset()
        self._device.reset()
        self.reset_attention_state()

    # ------------------------------------------------------------------ admission
    def add_request(self, req: DynamicInferenceRequest, chunk_length: Optional[int] = None) -> None:
        """Add a request (or the next chunk of the chunked prefill request).

        All checks run first and raise without changing anything; the device writes are staged
        and reach the device at ``initialize_attention_state``. The caller advances
        ``req.remaining_prompt_tokens`` and ``req.finished_chunk_token_count``.
        """
        self._check_allocated(getattr(req, "request_id", None))
        plan = self._table.plan_add(req, chunk_length,
                                    max_sequence_length=self.max_sequence_length,
                                    metadata_types=self.request_metadata_types,
                                    device=self.device, vocab_size=self.vocab_size)
        self._table.commit_add(plan)
        self._device.arena.dirty = True
        self._step = None

    def maybe_initialize_symmetric_memory(self) -> None:
        """Megatron-Core sets up a global symmetric-memory buffer here for the model's
        tensor-parallel all-reduce. dynctx keeps no global state and leaves tensor-parallel
        communication to the model: there is nothing to set up; the call is recorded in
        ``is_symmetric_memory_initialized``, as Megatron-Core records it."""
        self._check_allocated()
        self.is_symmetric_memory_initialized = True

    def __repr__(self) -> str:
        return (f"DynamicInferenceContext(requests {self.total_request_count}/"
                f"{self.max_requests}, paused {self.paused_request_count}, tokens "
                f"{self.active_token_count}/{self.max_tokens}, {self.block_allocator})")
