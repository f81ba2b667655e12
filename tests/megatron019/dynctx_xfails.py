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
INPUTS_BEFORE_STEP = (
    'reads current_input_and_position_ids() after writing padded_active_token_count by hand; dynctx refuses it before initialize_attention_state (docs/SEMANTICS.md §16 row 54)')
MAMBA_SLOT_ALLOCATOR = (
    "mamba_slot_allocator, 0.19's Mamba prefix-cache slots and the intermediate states its prefill extracts (MambaMetadata.intermediate_count; gap 5), not built")
SPECULATIVE = (
    "num_speculative_tokens > 0: 0.19's speculative steps (gap 9), not built yet")
CHUNKED_ID_FIRST = (
    "writes chunked_prefill_request_id before the request's first chunk is added; dynctx keeps only -1 or the last active row's id (docs/SEMANTICS.md §16 row 40)")
REGISTERED_AT_ADD = (
    "0.19 registers a prompt's full blocks in add_request, so a request added before the step shares them; dynctx publishes a block once the forward that computed it ran (update_requests; docs/SEMANTICS.md §16 row 43)")
HYBRID_MEMORY_ONLY = (
    "0.19 shares a hybrid's matched blocks without a Mamba state and recomputes them ('memory-only'); a dynctx hybrid matches only up to a block with a Mamba snapshot (docs/SEMANTICS.md §16 row 31), and publishes blocks after their forward (row 43)")
RELEASE_BY_INDEX = (
    "release_memory_blocks_from_request_indexes, 0.19's release of hand-picked rows (gap 4), not built; past it the case needs blocks registered at add_request (docs/SEMANTICS.md §16 row 43)")

XFAILS: Dict[str, Dict[str, str]] = {
    'test_mcore019_dynamic_context.py': {
        'TestDynamicContext::test_async_sched_prepare_capacity_recovers_after_pause_resume': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_all_active_requests_finish_while_hidden': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_hidden_state_prevents_token_bloat': CHUNKED_ID_FIRST,
        'TestDynamicContext::test_chunked_prefill_meets_prefix_caching': MAX_REQUESTS_ZERO,
        'TestDynamicContext::test_chunked_prefill_prefix_caching_from_hidden_state': CHUNKED_ID_FIRST,
        'TestDynamicContext::test_chunked_prefill_state_preserved_across_decode_completions': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_swap_with_speculative_tokens': SPECULATIVE,
        'TestDynamicContext::test_current_input_and_position_ids_view_cache': INPUTS_BEFORE_STEP,
        'TestDynamicContext::test_eviction_with_shared_prefix_blocks': REGISTERED_AT_ADD,
        'TestDynamicContext::test_mamba_memory_ratio_allocation': MAX_REQUESTS_ZERO,
        'TestDynamicContext::test_speculative_boundary_crossing': SPECULATIVE,
        'TestDynamicContext::test_update_requests_with_finished_requests_and_speculative_tokens': SPECULATIVE,
    },
    'test_mcore019_dynamic_prefix_caching.py': {
        'TestMambaPrefixCaching::test_hybrid_prefix_caching_without_mamba_budget_warns': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_intermediate_count_bounded_by_token_budget': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_intermediate_count_fills_scratch_buffer': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_intermediate_offsets_use_configured_mamba_chunk_size': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_mamba_cache_budget_too_small_raises': MAMBA_BUDGET_ERROR,
        'TestMambaPrefixCaching::test_mamba_cache_lifecycle': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_mamba_intermediate_offsets': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_mamba_prefill_skip_and_zero_prefill': MAMBA_SLOT_ALLOCATOR,
        'TestMambaPrefixCaching::test_max_intermediate_states_per_step_formula': MAMBA_SLOT_ALLOCATOR,
        'TestMambaSlotAllocator::test_allocate_slots_batch': MAMBA_SLOT_ALLOCATOR,
        'TestMambaSlotAllocator::test_commit_intermediate_states_batched': MAMBA_SLOT_ALLOCATOR,
        'TestMixedCachedAndFreshPrefill::test_mixed_batch[hybrid]': MAMBA_SLOT_ALLOCATOR,
        'TestPerBlockRouting::test_routing_survives_prefix_match_lru': UPDATE_WITHOUT_STEP,
        'TestPrefixCacheReuse::test_mamba_extraction_covers_last_block_of_continuation_chunk': MAMBA_SLOT_ALLOCATOR,
        'TestPrefixCachingCore::test_registration_and_discovery': REGISTERED_AT_ADD,
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
