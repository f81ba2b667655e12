"""``DynamicInferenceContext``: paged KV cache and in-flight batching state (the facade).

The facade keeps Megatron-Core's names over parts that each own one thing (``construction``
builds them; docs/DESIGN.md §2 draws them). A Megatron method here is a few lines calling the
part that owns what it touches, or, where the part's method has Megatron's name and signature,
that method itself (``_Part``). Every mutating call checks, plans, commits the host, then
applies on the device: an error leaves the context as it was. No part refers back to the
facade, so a context (and its KV buffer) is freed by reference counting alone.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import torch

from . import (
    admission,
    compat,
    facade,
    kv_groups,
    mamba_slot_allocator,
    megatron019,
    prefix_match,
    row_ops,
)
from ._fields import (  # noqa: F401 (re-exported: FIELD_* are imported from here)
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_OUTPUT,
    FIELD_QUERY,
)
from .batch_dimensions import InferenceBatchDimensions, MambaInferenceStateConfig
from .construction import ContextParts, build_parts, from_config, settle
from .errors import get_mem_size_str
from .facade import _Part, _prefix_stat, _row_field, _step_tensor, _table_count
from .forward_pass import EMPTY_IDS, ForwardPass
from .inputs import check_new_tokens, read_mask, reset_flags
from .parallel import CountAgreement, joins_agreement_on_failure, parallel_groups
from .request_table import RequestTable
from .requests import DynamicInferenceRequest
from .step_api import StepAPI
from .step_builder import REQUEST_ROUNDER, TOKEN_ROUNDER, rounded

logger = logging.getLogger("dynctx.context")


class DynamicInferenceContext(StepAPI, row_ops.RowOps, prefix_match.PrefixMatchHelpers):
    """Paged KV cache plus in-flight batching bookkeeping (Megatron-Core's API).

    Megatron-Core 0.19's form ``DynamicInferenceContext(model_config, inference_config)``
    (``megatron019.constructor_arguments``), or 0.16's keywords: Megatron-Core's plus
    ``device``, ``kernel_backend``, ``fused_rope_kv_append``, ``vocab_size``, ``validate``, the
    prefix caching and KV group options; ``construction.settle`` documents each one,
    docs/SEMANTICS.md §2 the construction (§16: 0.19's form, §22: KV groups).
    """

    DEFAULT_MAX_TOKENS = 16384
    TOKEN_ROUNDER = TOKEN_ROUNDER
    REQUEST_ROUNDER = REQUEST_ROUNDER

    @joins_agreement_on_failure
    def __init__(
        self, model_config: Any = None, inference_config: Any = None, *,
        params_dtype: Optional[torch.dtype] = None, num_layers: Optional[int] = None,
        kv_channels: Optional[int] = None, num_attention_heads: Optional[int] = None,
        max_sequence_length: Optional[int] = None, buffer_size_gb: Optional[float] = None,
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
        prefix_caching_mamba_gb: Optional[float] = None, num_speculative_tokens: int = 0,
        kv_cache_dtype: Optional[torch.dtype | str] = None, kv_scales: Any = "dynamic",
        kv_offload_gb: float = 0, kv_cache_management_mode: Any = None,
        kv_layer_windows: Optional[Sequence[Optional[int]]] = None, kv_groups: bool = True,
        prefix_caching_host_tier: Optional[bool] = None,
    ):
        arguments = dict(locals())  # every argument, as given or defaulted
        del arguments["self"]
        # Megatron-Core 0.19's form (model_config, inference_config) as the 0.16 keywords.
        form = megatron019.constructor_arguments(
            arguments, DynamicInferenceContext.__init__, request_rounder=self.REQUEST_ROUNDER,
            default_max_tokens=self.DEFAULT_MAX_TOKENS)
        arguments = form.keywords
        # Everything is validated before anything is allocated.
        compat.check_options({name: arguments.pop(name) for name in compat.REFUSED},
                             stacklevel=4)
        groups = parallel_groups(**{name: arguments.pop(name) for name in (
            "pipeline_model_parallel_size", "tensor_model_parallel_size", "pg_collection")})
        # Should this rank's own arguments fail below, it still joins the ranks' agreement, as
        # failed, so that they all raise (``joins_agreement_on_failure``).
        self._agreement = CountAgreement(groups.groups)
        settings = settle(agreement=self._agreement, groups=groups,
                          default_max_tokens=self.DEFAULT_MAX_TOKENS,
                          request_rounder=self.REQUEST_ROUNDER,
                          block_counts=form.block_counts, **arguments)
        # Megatron-Core's plain attributes (the device, the sizes, the layer layout, the flags).
        self.__dict__.update(settings.attributes)
        self._layers, self._request_rows = settings.layers, settings.memory.max_requests
        self._parts = parts = build_parts(settings)
        self._table, self._device, self._kv, self._steps, self._forward, self._mamba = parts[:6]
        self.mamba_metadata = parts.mamba_metadata
        self.block_allocator, self.prefix_cache = self._table.allocator, self._table.prefix_cache
        self.kv_block_allocator = self.block_allocator.attach(self)  # 0.19: KVBlockAllocator
        self.is_symmetric_memory_initialized, self._step = False, None
        form.finish(self)
        self.mamba_slot_allocator = mamba_slot_allocator.attach(  # 0.19's view of snapshots
            self._mamba, self._table, self.mamba_metadata, self._forward,
            mamba_gb=settings.prefix_caching[2], block_size=self.block_size_tokens,
            mamba_chunk_size=getattr(self, "mamba_chunk_size", 128),
            max_intermediate_count=getattr(self, "max_mamba_intermediate_states_per_step", 0))
        self.allocate_all_tensors(is_init=True)
        active = self.block_allocator.active_count
        logger.info("allocated context with active buffer size %s (%d blocks)",
                    get_mem_size_str(active * self.block_size_bytes), active)

    # ------------------------------------------------------------------ lifetime
    is_tensor_state_allocated = property(lambda self: self._device.allocated)

    # Host views of the bookkeeping (a CPU device); False hands out device mirrors, as on CUDA
    # (tests run the CUDA path on a CPU this way).
    _host_views = property(lambda self: self._device.host_views,
                           lambda self, value: self._parts.set_host_views(value))

    def allocate_all_tensors(self, *, is_init: bool) -> None:
        """Allocate the device state (at init, and on resume after a suspend). After a resume
        the context is empty: re-add the requests that were in flight, as in Megatron-Core."""
        if not self.is_tensor_state_allocated:
            self._parts.allocate()
            self.reset()

    def deallocate_all_tensors(self) -> None:
        """Free every device tensor (engine suspend). The in-flight requests are dropped: re-add
        them after ``allocate_all_tensors(is_init=False)``; any use in between raises
        ``TensorStateDeallocatedError``."""
        if self.is_tensor_state_allocated:
            self._parts.release()
            self._step = None

    def _check_allocated(self, request_id: Optional[int] = None) -> None:
        self._device.check_allocated(request_id)

    def reset(self, preserve_prefix_cache: bool = False, *,
              preserve_counters: bool = False) -> None:
        """Empty the context: counters, bookkeeping and blocks (the KV buffer keeps its bytes).
        Megatron-Core 0.19's options: ``preserve_prefix_cache`` keeps the cached blocks (with
        prefix caching on; the requests' blocks are released, a reference each),
        ``preserve_counters`` keeps ``step_count``, ``prefix_cache_lru_clock``,
        ``lifetime_prefill_token_count`` and the async counters."""
        self._check_allocated()
        keep = reset_flags(preserve_prefix_cache, preserve_counters) and self.enable_prefix_caching
        self.has_explicit_chunked_prefill_req = self._hand_written = False
        self._step = None
        self._set_step_counts(None)
        self.newly_paused_request_ids = self.evicted_request_ids = EMPTY_IDS
        self.max_length_finished_request_ids = EMPTY_IDS
        self._parts.reset(keep)
        if not preserve_counters:  # Megatron-Core 0.19's counters (the engine's to advance)
            self.step_count = self.prefix_cache_lru_clock = self.lifetime_prefill_token_count = 0
            self.async_sched_step_count = self.async_sched_compaction_step_count = 0

    # Megatron-Core 0.19's prefix-cache counters: views of the prefix cache's statistics.
    prefix_cache_hits = _prefix_stat("prefix_cache_hits")
    prefix_cache_blocks_matched = _prefix_stat("prefix_cache_blocks_matched")
    prefix_cache_prefill_computed_tokens = _prefix_stat("prefix_cache_prefill_computed_tokens")
    prefix_cache_prefill_skipped_tokens = _prefix_stat("prefix_cache_prefill_skipped_tokens")

    def maybe_initialize_symmetric_memory(self) -> None:
        """Megatron-Core sets up a global symmetric-memory buffer for the model's all-reduce
        here; dynctx keeps no global state: the call is only recorded, as upstream records it."""
        self._check_allocated()
        self.is_symmetric_memory_initialized = True

    # ------------------------------------------------------------------ class API
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

    from_config = classmethod(from_config)

    # ------------------------------------------------------------------ admission
    def add_request(self, req: DynamicInferenceRequest,
                    prefill_chunk_length: Optional[int] = None, *,
                    chunk_length: Optional[int] = None) -> None:
        """Add a request (or the next chunk of the chunked prefill request): every check first
        (``admission.plan_add``), then the host rows; the device sees them at the next
        ``initialize_attention_state``. The caller advances ``req.remaining_prompt_tokens``
        and ``req.finished_chunk_token_count``. The chunk's length is ``prefill_chunk_length``
        (0.19's name) or ``chunk_length`` (0.16's), not both."""
        self._check_allocated(getattr(req, "request_id", None))
        if prefill_chunk_length is not None and chunk_length is not None:
            raise TypeError(f"add_request() takes prefill_chunk_length={prefill_chunk_length} "
                            f"or chunk_length={chunk_length} (the same argument), not both")
        chunk_length = prefill_chunk_length if chunk_length is None else chunk_length
        plan = self._table.plan_add(req, chunk_length,
                                    max_sequence_length=self.max_sequence_length,
                                    metadata_types=self.request_metadata_types,
                                    device=self.device, vocab_size=self.vocab_size)
        self._parts.commit_add(plan)  # (with KV offload, the restore of a saved request)
        if self.mamba_slot_allocator is not None:  # 0.19's Mamba extraction plan
            self.mamba_slot_allocator.note_add(req, plan)
        self.lifetime_prefill_token_count += plan.chunk
        self._device.arena.dirty = True
        self._step = None

    def add_dummy_requests_parallel(self, requests: Sequence[DynamicInferenceRequest], *,
                                    count_as_prefill: bool = True) -> None:
        """Add whole-prompt requests whose every block is the dummy block (no block allocated;
        their K/V writes land there), as Megatron-Core does for CUDA-graph warm-up and capture
        (``admission.plan_dummies``; ``count_as_prefill=False``: decode rows). On a hybrid each
        gets a Mamba slot, zeroed now. Every check runs first: an error changes nothing."""
        self._check_allocated()
        plan = self._table.plan_dummies(
            requests, count_as_prefill, max_sequence_length=self.max_sequence_length,
            metadata_types=self.request_metadata_types, device=self.device,
            vocab_size=self.vocab_size, max_tokens=self.max_tokens)
        if plan.ids.size:
            slots = self._table.commit_dummies(plan)
            if slots.size:
                self._mamba.zero(slots)
            self._device.arena.dirty = True
            self._step = None

    def add_dummy_requests_for_cudagraph_capture(
            self, graph_dimensions: InferenceBatchDimensions) -> None:
        """Fill the empty context with the dummies of ``graph_dimensions``, as megatron-core
        0.16.1 does before a capture (``admission.capture_requests``: the whole graph is
        checked first); ``reset()`` after the captured step empties it again."""
        self._check_allocated()
        decode, prefill = admission.capture_requests(self._table, graph_dimensions,
                                           max_tokens=self.max_tokens,
                                           max_sequence_length=self.max_sequence_length)
        self.add_dummy_requests_parallel(decode, count_as_prefill=False)
        self.add_dummy_requests_parallel(prefill)

    def add_dummy_requests_for_expert_parallel_step(
            self, graph_dimensions: InferenceBatchDimensions) -> None:
        """Megatron-Core 0.19's fast path for an expert-parallel rank without requests: the
        state ``add_dummy_requests_for_cudagraph_capture`` leaves (one batched admission)."""
        self.add_dummy_requests_for_cudagraph_capture(graph_dimensions)

    # Queries of the request table (admission's, the table's own).
    check_availability = _Part("_table", admission.check_availability)
    prefix_cache_lookup = _Part("_table", admission.prefix_cache_lookup)
    prefix_cache_first_chunk_boundary = _Part("_table", admission.prefix_cache_first_chunk_boundary)
    get_prefix_cache_stats = _Part("_table", admission.get_prefix_cache_stats)
    get_kvcache_utilization_stats = _Part("_table", row_ops.get_kvcache_utilization_stats)
    get_kv_offload_stats = _Part("_parts", ContextParts.kv_offload_stats)  # (§21)
    host_request_ids = _Part("_table", RequestTable.host_request_ids)

    def host_query_lengths(self):
        """Host view of each row's query length in ``[0, total_request_count)`` (a speculative
        decode row's ``1 +`` its drafts: docs/SEMANTICS.md §19)."""
        return self._table.host("rows")[FIELD_QUERY, :self._table.total]

    kv_group_usage = _Part("_kv", kv_groups.kv_group_usage)  # KV groups: docs/SEMANTICS.md §22

    # ------------------------------------------------------------------ the step
    def _limits(self) -> tuple:  # what a step build reads besides the table (step_builder)
        return (self._table.request_limit, self.max_tokens, self.tensor_model_parallel_size,
                self.TOKEN_ROUNDER, self.REQUEST_ROUNDER)

    def _set_step_counts(self, step) -> None:
        real = step.batch_dimensions if step else InferenceBatchDimensions()
        padded = step.padded if step else InferenceBatchDimensions()
        self.batch_dimensions, self.padded_batch_dimensions = real, padded
        self.padded_active_token_count = padded.token_count
        self.padded_active_request_count = padded.req_count
        self._using_cuda_graph_this_step = step.using_cuda_graph if step else False
        self.padding_slice = slice(step.active_tokens if step else 0, padded.token_count)

    def _materialize_step(self) -> None:
        """Build this step's arrays now if there is a step to build: requests are active and
        the counts were not written by hand (a hand-written state has no consistent step)."""
        if self._table.active and not self._hand_written:
            self.initialize_attention_state()

    # initialize_attention_state, transfer_bookkeeping_to_gpu: step_api.StepAPI's.
    active_attn_metadata = property(lambda self: self._forward.attention,
                                    doc="The step's attention metadata (block table, lengths)")
    reset_attention_state = _Part("_forward", ForwardPass.reset_attention_state)

    def update_requests(self, active_requests_mask: torch.Tensor, new_tokens: torch.Tensor,
                        new_speculative_tokens: Optional[torch.Tensor] = None,
                        draft_counts: Any = None) -> torch.Tensor:
        """Advance the state after a forward pass (docs/SEMANTICS.md §9, the fixed version).

        ``active_requests_mask[i]`` (bool/0-1, one per active request) keeps request i; 0
        finishes it. ``new_tokens`` (int32/int64, one per active request) is not modified.
        Finished requests release their blocks; full ones pause; paused ones resume (LIFO) or
        are evicted beyond the paused budget (``update_plan``, ``ForwardPass.update``). Returns
        the ids (1-D int64 CPU tensor) this call paused that are still paused;
        ``evicted_request_ids`` those it evicted (re-queue them for recompute),
        ``max_length_finished_request_ids`` those it finished at ``max_sequence_length``. Needs
        ``initialize_attention_state`` first, unless the counts were written by hand. Every
        check runs before anything changes; the one device-to-host read is the mask."""
        self._check_allocated()
        active = self._table.active
        if active and self._step is None and not self._hand_written:
            raise RuntimeError("update_requests() needs initialize_attention_state() first: the "
                               "requests added since the last step (or this step's tokens) "
                               "were never forwarded")
        new_tokens = check_new_tokens(new_tokens, active, self.device, validate=self.validate,
                                      vocab_size=self.vocab_size)
        mask = read_mask(active_requests_mask, active, self.device)  # None: every request kept
        (self.newly_paused_request_ids, self.evicted_request_ids,
         self.max_length_finished_request_ids) = self._forward.update(
            mask, new_tokens, self._step, self._limits(), new_speculative_tokens, draft_counts)
        self.has_explicit_chunked_prefill_req = self._hand_written = False
        self._step = None
        if self.metrics_writer is not None:
            stats = self.get_kvcache_utilization_stats()
            stats.update(self.get_prefix_cache_stats())
            self.metrics_writer.log({f"inference/{k}": v for k, v in stats.items()})
        return self.newly_paused_request_ids

    # current_input_and_position_ids, gpu_view: step_api.StepAPI's.

    # The model's calls of the step (the forward pass's, with Megatron-Core's signatures).
    cu_query_lengths = _Part("_forward", ForwardPass.cu_query_lengths)
    cu_kv_lengths = _Part("_forward", ForwardPass.cu_kv_lengths)
    append_key_value_cache = _Part("_forward", ForwardPass.append_key_value_cache)
    key_value_cache = _Part("_forward", ForwardPass.key_value_cache)
    key_value_cache_scales = _Part("_forward", ForwardPass.key_value_cache_scales)
    apply_rotary_emb_query = _Part("_forward", ForwardPass.apply_rotary_emb_query)
    apply_rotary_emb_key = _Part("_forward", ForwardPass.apply_rotary_emb_key)
    apply_fused_qk_rotary_emb = _Part("_forward", ForwardPass.apply_fused_qk_rotary_emb)
    apply_rotary_emb_and_append_key_value_cache = _Part(
        "_forward", ForwardPass.apply_rotary_emb_and_append_key_value_cache)
    last_token_logits = _Part("_forward", ForwardPass.last_token_logits)
    mamba_states_cache = _Part("_forward", ForwardPass.mamba_states_cache)
    gather_mamba_states = _Part("_forward", ForwardPass.gather_mamba_states)
    scatter_mamba_states = _Part("_forward", ForwardPass.scatter_mamba_states)
    reset_mamba_state = _Part("_forward", ForwardPass.reset_mamba_state)
    rewind_kv_cache = _Part("_forward", ForwardPass.rewind_kv_cache)
    rewind_tokens = _Part("_forward", ForwardPass.rewind_tokens)   # docs/SEMANTICS.md §19
    defer_kv_rewind = _Part("_forward", ForwardPass.defer_kv_rewind)
    enable_deferred_rewind = _Part("_forward", ForwardPass.enable_deferred_rewind)
    settle_kv_rewind = _Part("_forward", ForwardPass.settle_kv_rewind)
    speculative_required_logit_indices = _Part("_forward", ForwardPass.logit_indices)
    num_last_token_logits = property(lambda self: self._forward.num_last_token_logits())
    paused_speculative_tokens = property(lambda self: self._forward.paused_drafts())

    def calculate_log_probs(self, logits: torch.Tensor, new_tokens: torch.Tensor,
                            only_last_token_logits: Optional[bool] = False, sampling: Any = None
                            ) -> Tuple[List[List[float]], torch.Tensor]:
        """Log probs of the tokens chosen (``ForwardPass.calculate_log_probs``); before this
        step's ``initialize_attention_state``, it builds the step first (Megatron's order). With
        0.19's ``config.logprobs_mode == "processed_logprobs"``, of the distribution after each
        request's sampling filter: ``sampling.log_probs_kernel`` (e.g. ``TorchSampling``)."""
        self._check_allocated()
        processed = None
        if getattr(self.config, "logprobs_mode", None) == "processed_logprobs":
            if sampling is None or not callable(getattr(sampling, "log_probs_kernel", None)):
                raise ValueError(f"logprobs_mode='processed_logprobs' needs a sampling backend "
                                 f"with log_probs_kernel (e.g. TorchSampling), got {sampling!r}")
            processed = lambda rows, owners: sampling.log_probs_kernel(  # noqa: E731
                rows, self, token_to_request_index=owners)
        if self._step is None:
            self._materialize_step()
        return self._forward.calculate_log_probs(logits, new_tokens, only_last_token_logits,
                                                 processed)

    active_request_metadata = property(
        lambda self: self._device.active_metadata_views(self._table),
        doc="label -> host tensor of the request metadata, active rows first (0.19's)")

    # ------------------------------------------------------------------ state, as Megatron's
    token_to_input_ids = _step_tensor("token_to_input_ids")
    token_to_pos_ids = _step_tensor("token_to_pos_ids")
    token_to_request_idx = _step_tensor("token_to_request_idx")
    token_to_block_idx = _step_tensor("token_to_block_idx")
    token_to_position_in_request = _step_tensor("token_to_position_in_request")
    token_to_local_position_within_kv_block = _step_tensor(
        "token_to_local_position_within_kv_block")
    memory_buffer = property(lambda self: self._kv.buffer)
    mamba_conv_states = property(lambda self: getattr(self._mamba, "conv_states", None))
    mamba_ssm_states = property(lambda self: getattr(self._mamba, "ssm_states", None))
    total_request_count = _table_count(
        "total", "_request_rows", "total_request_count: rows in use (paused + active)")
    # Bounded by the rows, not by each other: Megatron's tests set them in any order.
    paused_request_count = _table_count(
        "paused", "_request_rows", "paused_request_count: rows [0, paused) are paused")
    active_token_count = _table_count(
        "active_tokens", "max_tokens", "active_token_count: tokens of the next forward pass")
    num_prefill_requests = _table_count(
        "num_prefill", "_request_rows", "num_prefill_requests: prefill rows of the step")
    num_decode_requests = property(lambda self: self._table.num_decode)
    request_ids = _row_field(FIELD_IDS, "int32 [max_requests]: request id per row (-1 free)")
    request_query_lengths = _row_field(FIELD_QUERY, "int32 [max_requests]")
    request_output_lengths = _row_field(FIELD_OUTPUT, "int32 [max_requests]")
    request_kv_length_offsets = _row_field(FIELD_KV_OFFSET, "int32 [max_requests]")
    request_kv_block_counts = _row_field(FIELD_BLOCKS, "int32 [max_requests]")
    request_last_kv_block_id = _row_field(FIELD_LAST_BLOCK, "int32 [max_requests]")
    request_last_kv_block_offset = _row_field(FIELD_LAST_OFFSET, "int32 [max_requests]")
    request_to_kv_block_ids = property(
        lambda self: self._device.block_table_view(self._table),
        doc="int32 [max_requests, max_kv_block_count] block table (-1 unused), as the fields")
    request_metadata = property(lambda self: self._device.metadata_views(self._table),
                                doc="label -> [max_requests] request metadata, as the fields")
    kv_block_counts_host = property(lambda self: self._table.host("rows")[FIELD_BLOCKS],
                                    doc="Host copy of the per-row block counts (no sync)")
    block_table_host = property(lambda self: self._table.host("block_table"),
                                doc="Host copy of the block table (no sync)")
    chunked_prefill_request_id = property(
        lambda self: self._table.chunked_id, lambda self, value: self._table.set_chunked_id(value),
        doc="The request whose prompt is being added in chunks (the last active row), or -1")
    max_requests = property(
        lambda self: self._table.request_limit,
        lambda self, value: self._table.set_request_limit(value),
        doc="Request rows add_request may fill; lowered or restored by hand as Megatron-Core's "
            "tests do (the rows allocated are the ceiling)")
    # The parts' state, as tests read it.
    _live_ids = property(lambda self: self._table.live_ids)
    _mamba_slots = property(lambda self: self._table.slots)
    _h_req = property(lambda self: self._table.rows)
    _arena = property(lambda self: self._device.arena)
    _decode_shortcut = property(  # the steady decode update's shortcut (tests compare paths)
        lambda self: self._forward.decode_shortcut,
        lambda self, value: setattr(self._forward, "decode_shortcut", bool(value)))

    def pull_bookkeeping_from_device(self) -> None:
        """Copy the bookkeeping tensors written by hand on a CUDA device back to the host (one
        copy each: ``DeviceState.pull_bookkeeping``); nothing on a CPU device."""
        self._device.pull_bookkeeping(self._table)

    paused_tokens = property(
        lambda self: self._device.paused_tokens(self._table.paused),
        lambda self, tokens: self._device.write_paused_tokens(tokens, self._table.paused),
        doc="Pending next input token of each paused request (a view), or None; settable for "
            "the first len(tokens) paused rows, as Megatron-Core's tests build paused states")

    def is_static_batching(self) -> bool:
        return False

    def is_decode_only(self) -> bool:
        """Whether this step runs decode requests only: of the padded step under a CUDA graph
        (Megatron-Core 0.19), else of the real one."""
        if self._using_cuda_graph_this_step:
            return self.padded_batch_dimensions.prefill_req_count == 0
        return self.num_prefill_requests == 0

    def using_cuda_graph_this_step(self) -> bool:
        """Whether this step's padded dimensions are one of the context's CUDA graphs."""
        return self._using_cuda_graph_this_step

    def has_unfinished_requests(self) -> bool:
        return self.total_request_count > 0

    def get_active_request_count(self) -> int:
        return self.total_request_count - self.paused_request_count

    get_active_sequence_lengths = facade.get_active_sequence_lengths
    get_max_sequence_lengths = facade.get_max_sequence_lengths

    def get_index_of_chunked_prefill_request(self) -> int:
        """Row of the chunked prefill request (always the last active row), or -1."""
        return -1 if self.chunked_prefill_request_id == -1 else self.total_request_count - 1

    def __repr__(self) -> str:
        return (f"DynamicInferenceContext(requests {self.total_request_count}/{self.max_requests}"
                f", paused {self.paused_request_count}, tokens {self.active_token_count}/"
                f"{self.max_tokens}, {self.block_allocator})")
