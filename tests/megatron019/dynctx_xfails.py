"""The ported Megatron-Core 0.19 cases dynctx does not pass yet, each with its reason.

In dynctx mode ``conftest.py`` marks each listed case a strict ``xfail`` and ``mcore019``
(deselected in CI; ``run_port.py`` runs them, and one that starts passing fails the run until
its entry goes); every other ported case runs in CI. A key is ``Class::function`` or
``function`` (every parametrization), or either with ``[params]`` (that case only). Every
entry is a deliberate difference, its reason naming its row of docs/SEMANTICS.md §16.
"""

from __future__ import annotations

from typing import Dict, Optional

# The reasons: each a deliberate difference, with its row of docs/SEMANTICS.md §16.
MAX_REQUESTS_ZERO = (
    '0.19 lets a derived max_requests round down to 0; dynctx keeps at least tp_size rows (docs/SEMANTICS.md §16 row 42)')
UPDATE_WITHOUT_STEP = (
    "0.19 updates requests added without a step; dynctx refuses update_requests before initialize_attention_state: tokens never forwarded have no K/V, and their blocks are cached from the add on (docs/SEMANTICS.md §16 row 58)")
MAMBA_BUDGET_ERROR = (
    "0.19 reserves its extraction scratch from prefix_caching_mamba_gb and raises 'prefix cache budget' when no slot is left; dynctx allocates the scratch at its first use, outside the budget (dynctx's models never fill it; docs/SEMANTICS.md §16 row 57)")
INPUTS_BEFORE_STEP = (
    'reads current_input_and_position_ids() after writing padded_active_token_count by hand; dynctx refuses it before initialize_attention_state (docs/SEMANTICS.md §16 row 54)')
CHUNKED_ID_FIRST = (
    "writes chunked_prefill_request_id before the request's first chunk is added; dynctx keeps only -1 or the last active row's id (docs/SEMANTICS.md §16 row 40)")
CHUNKED_CONTINUATION_MATCH = (
    "writes chunked_prefill_request_id before the first chunk is added (row 40), then matches a continuation chunk against the cache, which dynctx does for first chunks only (docs/SEMANTICS.md §16 rows 40, 43)")
CHUNKED_ID_NOT_LAST = (
    "writes chunked_prefill_request_id for a row that is not the last active one; dynctx keeps only -1 or the last active row's id (docs/SEMANTICS.md §16 row 40)")
OFFSETS_DISAGREE = (
    "a hand-written row whose request_kv_length_offsets and request_last_kv_block_offset disagree: dynctx places each speculative token in its position's block, 0.19 by the last-block offset (docs/SEMANTICS.md §16 row 47)")
UNALLOCATED_RELEASE = (
    "finishes a hand-written row holding block 1, which the allocator never handed out: dynctx's allocator refuses to release it (reference counts, docs/SEMANTICS.md §16 row 22)")
PAUSED_SHARED_BLOCKS = (
    "0.19 counts a paused row's blocks that active rows share against the paused budget and evicts it; dynctx counts a shared block once, against the active budget, so evicting the row would free nothing (docs/SEMANTICS.md §16 row 30)")
HYBRID_RESTORES = (
    "registers Mamba hashes without a stored state and restores two prefill rows in one step; dynctx makes only a stored state matchable (row 57) and resumes a hybrid from a snapshot as the step's last row (docs/SEMANTICS.md §16 row 31)")

XFAILS: Dict[str, Dict[str, str]] = {
    'test_mcore019_dynamic_context.py': {
        'TestDynamicContext::test_async_sched_prepare_capacity_recovers_after_pause_resume': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_all_active_requests_finish_while_hidden': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_hidden_state_prevents_token_bloat': CHUNKED_ID_FIRST,
        'TestDynamicContext::test_chunked_prefill_meets_prefix_caching': CHUNKED_CONTINUATION_MATCH,
        'TestDynamicContext::test_chunked_prefill_prefix_caching_from_hidden_state': CHUNKED_ID_FIRST,
        'TestDynamicContext::test_chunked_prefill_state_preserved_across_decode_completions': UPDATE_WITHOUT_STEP,
        'TestDynamicContext::test_chunked_prefill_swap_with_speculative_tokens': CHUNKED_ID_NOT_LAST,
        'TestDynamicContext::test_current_input_and_position_ids_view_cache': INPUTS_BEFORE_STEP,
        'TestDynamicContext::test_eviction_with_shared_prefix_blocks': PAUSED_SHARED_BLOCKS,
        'TestDynamicContext::test_mamba_memory_ratio_allocation': MAX_REQUESTS_ZERO,
        'TestDynamicContext::test_speculative_boundary_crossing': OFFSETS_DISAGREE,
        'TestDynamicContext::test_update_requests_with_finished_requests_and_speculative_tokens': UNALLOCATED_RELEASE,
    },
    'test_mcore019_dynamic_prefix_caching.py': {
        'TestMambaPrefixCaching::test_mamba_cache_budget_too_small_raises': MAMBA_BUDGET_ERROR,
        'TestMixedCachedAndFreshPrefill::test_mixed_batch[hybrid]': HYBRID_RESTORES,
        'TestPerBlockRouting::test_routing_survives_prefix_match_lru': UPDATE_WITHOUT_STEP,
        'TestPrefixCachingCore::test_registration_and_discovery': UPDATE_WITHOUT_STEP,
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
