"""Deferred rewinds (``defer_kv_rewind`` / ``settle_kv_rewind``, docs/SEMANTICS.md §19) and
per-row draft counts (``update_requests(draft_counts=)``): a context whose rewinds the device
applies at each row's next step and the host one step later lays every step out as the
synchronous rewind does (positions, KV lengths, block ids of the tokens), leaks no block, and
refuses bad input before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, assert_same, check_invariants, make_ctx, request, snapshot
from triton_marks import needs_triton

from dynctx.context.errors import StepShapeError

K = 3


def _per_request(ctx) -> dict:
    """The step as the device built it: request id -> (positions of its tokens, its KV
    length), from the per-token arrays and the attention metadata."""
    n, P = ctx.active_token_count, ctx.paused_request_count
    ids = ctx.host_request_ids()[P:ctx.total_request_count].tolist()
    rows = ctx.token_to_request_idx[:n].tolist()
    positions = ctx.token_to_pos_ids[:n].tolist()
    lengths = ctx.active_attn_metadata.kv_seq_lengths[:len(ids)].tolist()
    cu_kv = ctx.active_attn_metadata.cu_kv_seq_lengths[:len(ids) + 1].tolist()
    assert cu_kv == [0] + np.cumsum(lengths).tolist()
    out = {rid: ([], lengths[i]) for i, rid in enumerate(ids)}
    for row, position in zip(rows, positions):
        out[ids[row - P]][0].append(position)
    return out


def _drive(deferred: bool, steps: int = 16, seed: int = 3, **options):
    """A workload of four requests (one chunked), random draft counts and acceptances drawn
    per request and step alike for both modes; returns each step's ``_per_request``."""
    ctx = make_ctx(num_speculative_tokens=K, max_tokens=40, max_requests=6,
                   buffer_size_gb=60 * BLOCK / GIB, **options)
    reqs = [request(0, 5, gen=99), request(1, 3, gen=99), request(2, 13, gen=99),
            request(3, 2, gen=99)]
    add(ctx, reqs[0])
    add(ctx, reqs[1])
    add(ctx, reqs[2], chunk_length=7)
    ctx.chunked_prefill_request_id = 2
    seen, unsettled = [], {}
    for step in range(steps):
        ctx.initialize_attention_state()
        seen.append(_per_request(ctx))
        P, T = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids()[P:T].tolist()
        queries = ctx.host_query_lengths()[P:T]
        decode = ctx.num_decode_requests
        accepted = np.zeros(len(ids), dtype=np.int64)
        for i in range(decode):
            rng = np.random.default_rng([seed, step, ids[i]])
            accepted[i] = rng.integers(0, queries[i])
        if deferred:
            ready = [rid for rid in ids[:decode] if rid in unsettled]
            if ready:
                ctx.settle_kv_rewind(ready, [unsettled.pop(rid) for rid in ready])
            ctx.defer_kv_rewind(torch.from_numpy(accepted))
            for i in range(decode):
                if queries[i] > 1:
                    unsettled[ids[i]] = int(queries[i] - 1 - accepted[i])
        elif decode:
            ctx.rewind_kv_cache(torch.from_numpy(accepted))
        counts = np.array([np.random.default_rng([seed, step, rid, 1]).integers(0, K + 1)
                           for rid in ids])
        drafts = torch.randint(0, 50, (K, len(ids)))
        mask = torch.ones(len(ids), dtype=torch.bool)
        if step == steps - 1:
            mask[:] = False
            ctx.chunked_prefill_request_id = -1
        ctx.update_requests(mask, torch.arange(len(ids)) + 7, drafts, draft_counts=counts)
        if step == 0:
            add(ctx, reqs[2], chunk_length=6)   # its last chunk
            ctx.chunked_prefill_request_id = -1
        if step == 4:
            add(ctx, reqs[3])
        check_invariants(ctx) if not deferred else None
    return seen, ctx


@pytest.mark.parametrize("backend", [
    "torch", pytest.param("triton", marks=[pytest.mark.interpreter, needs_triton])])
def test_deferred_rewinds_lay_every_step_out_as_the_synchronous_rewind(backend):
    """Under the interpreter the Triton kernels run: step_metadata reads the offsets
    speculative_rewind lowered."""
    steps = 16 if backend == "torch" else 12
    synchronous, sync_ctx = _drive(deferred=False, steps=steps, kernel_backend=backend)
    deferred, ctx = _drive(deferred=True, steps=steps, kernel_backend=backend)
    assert any(len(p) > 1 for step in synchronous for p, _ in step.values())  # drafts ran
    for n, (want, got) in enumerate(zip(synchronous, deferred)):
        assert got == want, f"step {n}: {got} != {want}"
    for c in (sync_ctx, ctx):   # every request finished: every block is free again
        assert c.total_request_count == 0
        assert c.block_allocator.total_avail == c.block_allocator.total_count - 1


def test_plain_updates_take_the_decode_shortcut_and_agree_with_the_general_plan():
    """An update after a plain step that gives no drafts takes the steady decode update's
    shortcut (``plan_decode``), with the same state after every call as the general plan's;
    updates with drafts take the general plan on both."""
    contexts = [make_ctx(num_speculative_tokens=K, max_tokens=40, max_requests=6,
                         buffer_size_gb=30 * BLOCK / GIB) for _ in range(2)]
    contexts[1]._decode_shortcut = False
    table, shortcuts = contexts[0]._table, []
    plan_decode = table.plan_decode
    table.plan_decode = lambda **kw: shortcuts.append(plan_decode(**kw)) or shortcuts[-1]
    for ctx in contexts:
        for rid, length in enumerate((5, 3, 14, 2)):
            add(ctx, request(rid, length, gen=99))
    for step in range(24):
        snapshots = []
        for ctx in contexts:
            ctx.initialize_attention_state()
            active = ctx.total_request_count - ctx.paused_request_count
            counts = [0] * active if step % 6 else [(rid + step) % (K + 1)
                                                   for rid in range(active)]
            if step % 6 == 1:
                ctx.rewind_kv_cache(torch.zeros(active, dtype=torch.int64))
            ctx.update_requests(torch.ones(active, dtype=torch.bool),
                                torch.arange(active) + step, torch.full((K, active), 5),
                                draft_counts=counts)
            check_invariants(ctx)
            snapshots.append(snapshot(ctx, device=True))
            del snapshots[-1]["kv_bytes"]   # never written
        assert_same(*snapshots)
    taken = [plan for plan in shortcuts if plan is not None]
    assert len(taken) >= 8 and any(plan.full for plan in taken)   # blocks appended too


def test_a_step_without_drafts_is_a_plain_decode_step():
    """Draft counts of zero: one token a row, fed from the pending tokens, one logit row each;
    the speculative graphs still fit it (its counts are within theirs)."""
    ctx = make_ctx(num_speculative_tokens=K)
    add(ctx, request(0, 5))
    add(ctx, request(1, 2))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([7, 8]),
                        torch.full((K, 2), 9), draft_counts=[0, 0])
    ctx.initialize_attention_state()
    assert ctx.active_token_count == 2 and ctx.num_last_token_logits == 2
    assert ctx.token_to_input_ids[:2].tolist() == [7, 8]
    assert ctx.token_to_pos_ids[:2].tolist() == [5, 2]
    assert ctx.speculative_required_logit_indices().tolist() == [0, 1]
    ctx.rewind_kv_cache(torch.zeros(2, dtype=torch.int64))   # nothing to rewind
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([3, 4]),
                        torch.tensor([[11, 21], [12, 22], [13, 23]]), draft_counts=[2, 0])
    ctx.initialize_attention_state()   # a ragged step: 3 tokens, then 1
    assert ctx.token_to_input_ids[:4].tolist() == [3, 11, 12, 4]
    assert ctx.token_to_pos_ids[:4].tolist() == [6, 7, 8, 3]
    assert ctx.speculative_required_logit_indices().tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"accepted_counts\[1\]=1 must lie in \[0, 0, the "):
        ctx.rewind_kv_cache(torch.tensor([2, 1]))
    check_invariants(ctx)


def _stepped(**overrides):
    ctx = make_ctx(num_speculative_tokens=K, **overrides)
    add(ctx, request(0, 5))
    add(ctx, request(1, 2))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([7, 8]),
                        torch.full((K, 2), 9))
    ctx.initialize_attention_state()
    return ctx


@pytest.mark.parametrize("call, error, match", [
    (lambda c: c.defer_kv_rewind([1, 1]), TypeError, "must be a torch.Tensor"),
    (lambda c: c.defer_kv_rewind(torch.ones(2)), TypeError, "integer tensor"),
    (lambda c: c.defer_kv_rewind(torch.ones(3, dtype=torch.int64)), StepShapeError,
     r"shape \(3,\)"),
    (lambda c: c.defer_kv_rewind(torch.ones(2, dtype=torch.int64, device="meta")), ValueError,
     "is on meta"),
    (lambda c: c.settle_kv_rewind([0], [1]), RuntimeError, "before any defer_kv_rewind"),
    (lambda c: c.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([1, 2]),
                                 torch.zeros(K, 2, dtype=torch.int64), draft_counts=[0, 4]),
     ValueError, r"draft_counts\[1\]=4 must lie in \[0, num_speculative_tokens=3\]"),
    (lambda c: c.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([1, 2]),
                                 torch.zeros(K, 2, dtype=torch.int64), draft_counts=[1]),
     StepShapeError, "draft_counts has shape"),
    (lambda c: c.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([1, 2]),
                                 torch.zeros(K, 2, dtype=torch.int64),
                                 draft_counts=torch.ones(2, dtype=torch.int64, device="meta")),
     ValueError, "must be on the host"),
    (lambda c: c.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([1, 2]),
                                 torch.zeros(K, 2, dtype=torch.int64), draft_counts=[0.5, 1]),
     TypeError, "must hold integers"),
])
def test_bad_input_is_refused_before_anything_changes(call, error, match):
    ctx = _stepped()
    before = snapshot(ctx, device=True)
    with pytest.raises(error, match=match):
        call(ctx)
    assert_same(before, snapshot(ctx, device=True))


def test_settle_refuses_what_it_cannot_apply():
    ctx = _stepped()
    ctx.defer_kv_rewind(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="after a rewind in this step"):
        ctx.defer_kv_rewind(torch.tensor([1, 2]))
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([5, 6]),
                        torch.full((K, 2), 9))
    ctx.initialize_attention_state()
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="request 5 is not a decode row"):
        ctx.settle_kv_rewind([0, 5], [2, 1])
    with pytest.raises(ValueError, match=r"rejected_counts\[0\]=4 must lie in"):
        ctx.settle_kv_rewind([0], [4])
    with pytest.raises(StepShapeError, match="rejected_counts has 1 entries"):
        ctx.settle_kv_rewind([0, 1], [1])
    assert_same(before, snapshot(ctx))
    offsets = ctx.host_query_lengths()  # the host's rows before the settle
    kv_before = ctx.request_kv_length_offsets[:2].tolist()
    assert offsets[:2].tolist() == [1 + K, 1 + K]
    ctx.settle_kv_rewind([1, 0], [1, 2])
    assert ctx.request_kv_length_offsets[:2].tolist() == [kv_before[0] - 2, kv_before[1] - 1]
    check_invariants(ctx)
