"""Update-plan cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md
"Mutation testing"): free rows hold reset values after ``update_requests`` clears them
(docs/SEMANTICS.md §1), whether the finished row is refilled by a mover or left past the end;
speculative rows past ``max_tokens // (1 + k)`` pause and stay paused; a table without budget
advice still says why no request can run, and a speculative one which request is stuck."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, check_invariants, make_ctx, request, step

from dynctx.context import MambaInferenceStateConfig
from dynctx.context._fields import FIELD_BLOCKS, FIELD_IDS


def free_rows(ctx):
    T = ctx.total_request_count
    return ctx.request_ids[T:].cpu().numpy(), ctx.block_table_host[T:]


@pytest.mark.parametrize("finished", [(2,), (3,), (1, 3), (1, 2, 3)])
def test_finished_rows_are_reset_to_free_values(finished):
    ctx = make_ctx()
    for rid in (1, 2, 3):
        add(ctx, request(rid, 5))
    step(ctx)
    step(ctx, finished_ids=finished)
    assert ctx.total_request_count == 3 - len(finished)
    ids, table = free_rows(ctx)
    assert ids.size == 8 - ctx.total_request_count
    assert np.all(ids == -1) and np.all(table == -1)
    check_invariants(ctx)


def test_a_hybrid_finished_row_gives_back_its_mamba_slot():
    layers, conv, ssm = ("M", "*"), (6, 4), (2, 3, 5)
    ctx = make_ctx(mamba_inference_state_config=MambaInferenceStateConfig(layers, conv, ssm))
    for rid in (1, 2, 3):
        add(ctx, request(rid, 5))
    step(ctx)
    step(ctx, finished_ids=(3,))
    ids, table = free_rows(ctx)
    assert np.all(ids == -1) and np.all(table == -1)
    slots = ctx.mamba_metadata.request_to_mamba_state_idx
    assert np.all(slots[ctx.total_request_count:].cpu().numpy() == -1)


def fewest_evictions(counts, budget):
    """docs/SEMANTICS.md §9.4 by brute force: ``o`` paused rows overflow the budget (those past
    the longest prefix that fits); from the right, the fewest rows ``E`` whose blocks cover the
    overflowing rows still remaining (``o - E``)."""
    fits = int(np.count_nonzero(np.cumsum(counts) <= budget))
    overflow = len(counts) - fits
    if sum(counts) <= budget or overflow == 0:
        return 0, False
    for evict in range(1, len(counts) + 1):
        if sum(counts[len(counts) - evict:]) >= overflow - evict:
            return evict, sum(counts[len(counts) - evict:]) == overflow - evict


def test_eviction_takes_the_fewest_rows_that_cover_the_overflow():
    """The plan's eviction (its working copy, as update_requests runs it) against the rule,
    over every split of six requests into paused and active rows and every budget; some
    cases free exactly the blocks they must, where one eviction more is the bug."""
    from dynctx.context.block_allocator import StackSimulation
    from dynctx.context.plan_scratch import PlanScratch

    ctx = make_ctx(max_requests=8)
    for rid, length in enumerate((9, 5, 3, 2, 6, 1), 1):
        add(ctx, request(rid, length))
    step(ctx)
    table = ctx._table
    counts = table.rows[FIELD_BLOCKS, :table.total].astype(np.int64).tolist()
    exact = 0
    for paused in range(1, 6):
        for budget in range(0, sum(counts[:paused]) + 1):
            scratch = PlanScratch(table, StackSimulation(table.allocator))
            ids = scratch.fields[FIELD_IDS, :paused].astype(np.int64).tolist()
            left, evicted = scratch.evict(paused, 6 - paused, budget)
            want, tight = fewest_evictions(counts[:paused], budget)
            exact += tight
            assert (left, evicted.tolist()) == (paused - want, ids[paused - want:paused]), \
                (counts, paused, budget)
            assert np.all(scratch.fields[FIELD_IDS, 6 - want:] == -1)
    assert exact, "no case where the evicted rows free exactly the overflow"


def test_speculative_rows_past_max_tokens_over_one_plus_k_pause_and_stay_paused():
    """0.19: a speculative step forwards ``1 + k`` tokens a row, so the rows past
    ``max_tokens // (1 + k)`` pause at the update (even those that need no new block), and the
    resume after it takes none of them back."""
    ctx = make_ctx(num_speculative_tokens=1, max_tokens=8)
    for rid in range(1, 6):
        add(ctx, request(rid, 1))    # offset 0: the next 2 tokens fit the block
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(5, dtype=torch.bool), torch.tensor([7] * 5),
                        torch.zeros(1, 5, dtype=torch.int64))
    assert (ctx.paused_request_count, ctx.total_request_count) == (1, 5)
    assert ctx.request_query_lengths[1:5].tolist() == [2, 2, 2, 2]
    check_invariants(ctx)


def test_a_stuck_speculative_request_is_named_with_the_blocks_it_needs():
    """An active budget of 3 blocks and a speculative request whose next step crosses into its
    4th: the error names the request and what it needs, as without speculation."""
    ctx = make_ctx(num_speculative_tokens=1, buffer_size_gb=6 * BLOCK / GIB,
                   paused_buffer_size_gb=2 * BLOCK / GIB, max_requests=4, max_tokens=64)
    add(ctx, request(1, 11, gen=40))
    with pytest.raises(RuntimeError, match=r"no request can run: .*: request 1 needs 4 blocks "
                                           r"of the active budget to run on"):
        for _ in range(8):
            ctx.initialize_attention_state()
            ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([7]),
                                torch.zeros(1, 1, dtype=torch.int64))


def test_no_request_can_run_without_budget_advice():
    """A request table built without ``budget_advice`` (the context always gives one) says why
    no request can run, without the advice."""
    ctx = make_ctx(buffer_size_gb=6 * BLOCK / GIB, paused_buffer_size_gb=2 * BLOCK / GIB,
                   max_requests=4, max_tokens=64)
    ctx._table.budget_advice = None
    add(ctx, request(1, 11, gen=40))
    with pytest.raises(RuntimeError, match=r"no request can run: .*to reach its \d+ tokens; "
                                           r"nothing was changed"):
        for _ in range(8):
            step(ctx)
