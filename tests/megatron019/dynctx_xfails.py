"""The ported Megatron-Core 0.19 cases dynctx does not pass yet, each with its reason.

In dynctx mode ``conftest.py`` marks each listed case a strict ``xfail`` and ``mcore019``
(deselected in CI; ``run_port.py`` runs them, and one that starts passing fails the run until
its entry goes); every other ported case runs in CI. A key is ``Class::function`` or
``function`` (every parametrization), or either with ``[params]`` (that case only). The reasons
name the 0.19 API each case needs (the gap list of ``README.md``, where its 0.19 location is).
"""

from __future__ import annotations

from typing import Dict, Optional

# The reasons (gap numbers: tests/megatron019/README.md).
MAX_REQUESTS_ZERO = (
    '0.19 lets a derived max_requests round down to 0; dynctx keeps at least tp_size rows (docs/SEMANTICS.md §16 row 42)')
UPDATE_WITHOUT_STEP = (
    '0.19 updates requests added without a step; dynctx refuses update_requests before initialize_attention_state (docs/SEMANTICS.md §9)')
MAMBA_BUDGET_ERROR = (
    "0.19's 'prefix cache budget' ValueError for prefix_caching_mamba_gb (gap 4): dynctx sizes its Mamba snapshots its own way (docs/SEMANTICS.md §16 row 31)")
ASYNC_TRIO = (
    "0.19's async-scheduling trio (gap 8), not built")
TRANSFER = (
    "0.19's separate bookkeeping transfer (gap 7), not built")
SPECULATIVE_API = (
    "0.19's speculative step API (gap 9), not built")
GPU_VIEW = (
    'ContextGPUView / ctx.gpu_view (gap 6), not built')
TORCH_SAMPLING = (
    'TorchSampling and processed log probs (gap 12), not built')
MAMBA_SLOT_ALLOCATOR = (
    "mamba_slot_allocator, 0.19's Mamba prefix-cache slots (gap 5), not built")
SPECULATIVE = (
    "num_speculative_tokens > 0: 0.19's speculative steps (gap 9), not built yet")
PREFILL_FLAGS = (
    "writes request_in_prefill_status_tensor, 0.19's per-request prefill flags (gap 7), not built")
REGISTERED_AT_ADD = (
    "0.19 registers a prompt's full blocks in add_request, so a request added before the step shares them; dynctx publishes a block once the forward that computed it ran (update_requests; docs/SEMANTICS.md §16 row 43)")
HYBRID_MEMORY_ONLY = (
    "0.19 shares a hybrid's matched blocks without a Mamba state and recomputes them ('memory-only'); a dynctx hybrid matches only up to a block with a Mamba snapshot (docs/SEMANTICS.md §16 row 31), and publishes blocks after their forward (row 43)")
RELEASE_BY_INDEX = (
    "release_memory_blocks_from_request_indexes, 0.19's release of hand-picked rows (gap 4), not built; past it the case needs blocks registered at add_request (docs/SEMANTICS.md §16 row 43)")

XFAILS: Dict[str, Dict[str, str]] = {
    'test_mcore019_dynamic_context.py': {
        'TestDynamicContext::test_add_dummy_requests_parallel_hybrid_allocates_mamba': TRANSFER,
        'TestDynamicContext::test_async_sched_can_prepare_requests_exact_block_demand[0-last_block_offsets0-0-True]': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_can_prepare_requests_exact_block_demand[0-last_block_offsets1-0-False]': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_can_prepare_requests_exact_block_demand[0-last_block_offsets2-1-True]': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_can_prepare_requests_exact_block_demand[2-last_block_offsets3-1-False]': SPECULATIVE,
        'TestDynamicContext::test_async_sched_can_prepare_requests_exact_block_demand[2-last_block_offsets4-2-True]': SPECULATIVE,
        'TestDynamicContext::test_async_sched_cannot_prepare_requests_with_lifecycle_state': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_commit_sampled_tokens': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_mtp_prepare_commit_and_resolve': SPECULATIVE,
        'TestDynamicContext::test_async_sched_prefill_resolves_before_decode_prepare': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_prepare_capacity_recovers_after_pause_resume': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_prepare_requests_errors': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_prepare_requests_success[0-kv_offsets0-last_offsets0-expected_kv_offsets0-expected_last_offsets0]': ASYNC_TRIO,
        'TestDynamicContext::test_async_sched_prepare_requests_success[2-kv_offsets1-last_offsets1-expected_kv_offsets1-expected_last_offsets1]': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_prepare_requests_success[2-kv_offsets2-last_offsets2-expected_kv_offsets2-expected_last_offsets2]': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_resolve_requests_errors': PREFILL_FLAGS,
        'TestDynamicContext::test_async_sched_resolve_requests_success': PREFILL_FLAGS,
        'TestDynamicContext::test_calculate_and_store_log_probs': TORCH_SAMPLING,
        'TestDynamicContext::test_chunked_prefill_all_active_requests_finish_while_hidden': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_hidden_state_prevents_token_bloat': SPECULATIVE,
        'TestDynamicContext::test_chunked_prefill_meets_prefix_caching': MAX_REQUESTS_ZERO,
        'TestDynamicContext::test_chunked_prefill_prefix_caching_from_hidden_state': SPECULATIVE,
        'TestDynamicContext::test_chunked_prefill_state_preserved_across_decode_completions': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_swap_with_speculative_tokens': SPECULATIVE,
        'TestDynamicContext::test_copy_async_sched_sample_to_forward_populates_active_and_clears_padding[0]': GPU_VIEW,
        'TestDynamicContext::test_copy_async_sched_sample_to_forward_populates_active_and_clears_padding[2]': SPECULATIVE,
        'TestDynamicContext::test_current_input_and_position_ids_view_cache': GPU_VIEW,
        'TestDynamicContext::test_eviction_with_shared_prefix_blocks': REGISTERED_AT_ADD,
        'TestDynamicContext::test_finished_requests_with_multiple_blocks': PREFILL_FLAGS,
        'TestDynamicContext::test_initialize_attention_state_bookkeeping_transfer_event': TRANSFER,
        'TestDynamicContext::test_last_token_logits_selects_correct_values_speculative': SPECULATIVE,
        'TestDynamicContext::test_mamba_memory_ratio_allocation': MAX_REQUESTS_ZERO,
        'TestDynamicContext::test_pad_active_slices_no_speculative_tokens': SPECULATIVE_API,
        'TestDynamicContext::test_pad_active_slices_speculative_all_prefill': SPECULATIVE,
        'TestDynamicContext::test_pad_active_slices_speculative_decode_only': SPECULATIVE,
        'TestDynamicContext::test_pad_active_slices_speculative_mixed_batch': SPECULATIVE,
        'TestDynamicContext::test_prefix_caching_check_availability_with_speculative': SPECULATIVE,
        'TestDynamicContext::test_prefix_match_exact_block_boundary': MAX_REQUESTS_ZERO,
        'TestDynamicContext::test_release_memory_blocks_for_finished_requests': PREFILL_FLAGS,
        'TestDynamicContext::test_speculative_boundary_crossing': SPECULATIVE,
        'TestDynamicContext::test_speculative_boundary_crossing_with_prefix_caching': SPECULATIVE,
        'TestDynamicContext::test_speculative_required_logit_indices_matches_active_logit_idxs': SPECULATIVE,
        'TestDynamicContext::test_speculative_update_then_release_with_prefix_caching': SPECULATIVE,
        'TestDynamicContext::test_speculative_with_prefix_caching_kv_offset': SPECULATIVE,
        'TestDynamicContext::test_speculative_with_prefix_caching_shared_blocks': SPECULATIVE,
        'TestDynamicContext::test_swap_book_keeping_tensors_with_speculative_tokens': SPECULATIVE,
        'TestDynamicContext::test_transfer_bookkeeping_to_gpu_can_skip_input_token_ids': GPU_VIEW,
        'TestDynamicContext::test_update_requests_with_finished_requests_and_speculative_tokens': SPECULATIVE,
    },
    'test_mcore019_dynamic_prefix_caching.py': {
        'TestMambaPrefixCaching::test_hybrid_memory_only': HYBRID_MEMORY_ONLY,
        'TestMambaPrefixCaching::test_hybrid_prefix_caching_without_mamba_budget_warns': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_intermediate_count_bounded_by_token_budget': TRANSFER,
        'TestMambaPrefixCaching::test_intermediate_count_fills_scratch_buffer': TRANSFER,
        'TestMambaPrefixCaching::test_intermediate_offsets_use_configured_mamba_chunk_size': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_mamba_cache_budget_too_small_raises': MAMBA_BUDGET_ERROR,
        'TestMambaPrefixCaching::test_mamba_cache_lifecycle': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_mamba_intermediate_offsets': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_mamba_prefill_skip_and_zero_prefill': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_max_intermediate_states_per_step_formula': MAMBA_SLOT_ALLOCATOR,
        'TestMambaSlotAllocator::test_allocate_slots_batch': MAMBA_SLOT_ALLOCATOR,
        'TestMambaSlotAllocator::test_commit_intermediate_states_batched': MAMBA_SLOT_ALLOCATOR,
        'TestMixedCachedAndFreshPrefill::test_mixed_batch[gpt]': REGISTERED_AT_ADD,
        'TestMixedCachedAndFreshPrefill::test_mixed_batch[hybrid]': MAMBA_SLOT_ALLOCATOR,
        'TestPerBlockRouting::test_routing_survives_prefix_match_lru': UPDATE_WITHOUT_STEP,
        'TestPrefixCacheReuse::test_mamba_extraction_covers_last_block_of_continuation_chunk': MAMBA_SLOT_ALLOCATOR,
        'TestPrefixCacheReuse::test_prefill_computed_and_skipped_counters': REGISTERED_AT_ADD,
        'TestPrefixCacheReuse::test_reset_preserves_prefix_cache_when_requested': REGISTERED_AT_ADD,
        'TestPrefixCachingCore::test_add_request_full_cache_partial_hit_pins_matched_blocks': RELEASE_BY_INDEX,
        'TestPrefixCachingCore::test_block_allocation_with_prefix': REGISTERED_AT_ADD,
        'TestPrefixCachingCore::test_block_sharing_patterns': REGISTERED_AT_ADD,
        'TestPrefixCachingCore::test_check_availability_excludes_already_pinned_matches': RELEASE_BY_INDEX,
        'TestPrefixCachingCore::test_prefill_token_savings': REGISTERED_AT_ADD,
        'TestPrefixCachingCore::test_ref_count_lru': REGISTERED_AT_ADD,
        'TestPrefixCachingCore::test_ref_count_refzero': RELEASE_BY_INDEX,
        'TestPrefixCachingCore::test_registration_and_discovery': REGISTERED_AT_ADD,
    },
    'test_mcore019_gpu_view.py': {
        'TestContextGPUView::test_layout_with_and_without_mamba': GPU_VIEW,
    },
}


def reason_for(file_name: str, item_name: str, cls: Optional[type]) -> Optional[str]:
    """The reason ``file_name``'s case ``item_name`` (of class ``cls``) is listed, or None."""
    table = XFAILS.get(file_name, {})
    function = item_name.split("[", 1)[0]
    prefix = f"{cls.__name__}::" if cls is not None else ""
    for key in (prefix + item_name, prefix + function, item_name, function):
        if key in table:
            return table[key]
    return None
