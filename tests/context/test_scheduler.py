"""The engine's scheduler (``engine/scheduler.py``) on a small context: arrival order, FIFO
admission, chunking and its continuation, the re-queue of evicted and suspended requests, and
a refused add leaving the queue while the others go on."""

from __future__ import annotations

import pytest
import torch
from helpers import make_ctx, request

from dynctx.engine.scheduler import Admission, ChunkStalled, Scheduler


def requests(*lengths) -> dict:
    return {rid: request(rid, n) for rid, n in enumerate(lengths)}


def test_arrivals_release_in_step_order_ties_in_submission_order():
    scheduler = Scheduler(make_ctx())
    for rid, step in [(0, 5), (1, 2), (2, 5), (3, 0), (4, 2)]:
        scheduler.submit(rid, step)
    assert scheduler.next_arrival_step == 0 and scheduler.pending_count == 5
    assert scheduler.release(1) == [3]
    assert scheduler.release(4) == [1, 4]
    assert scheduler.queued_ids() == [3, 1, 4, 0, 2]
    assert scheduler.release(5) == [0, 2] and scheduler.next_arrival_step is None
    assert list(scheduler.waiting) == [3, 1, 4, 0, 2]


def test_fifo_admission_chunks_the_first_that_does_not_fit_then_continues_it():
    ctx = make_ctx(max_tokens=16)
    reqs = requests(5, 7, 20, 3)
    scheduler = Scheduler(ctx, reserve_for_chunks=False)
    scheduler.waiting.extend(reqs)
    done = scheduler.schedule(reqs.__getitem__)
    # 5 + 7 fit; request 2 (20 tokens) gets the 4 left and ends the admission.
    assert done.admitted == [Admission(0, 5, True, False), Admission(1, 7, True, False),
                             Admission(2, 4, False, False)]
    assert ctx.chunked_prefill_request_id == 2 and list(scheduler.waiting) == [2, 3]
    assert reqs[2].finished_chunk_token_count == 4 and reqs[2].remaining_prompt_length == 16
    assert scheduler.schedule(reqs.__getitem__).admitted == [], "the step's admission is closed"

    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([False, False, True]), torch.tensor([1, 2, 3]))
    scheduler.after_update()
    assert scheduler.continuation_room(reqs[2]) == 16
    done = scheduler.schedule(reqs.__getitem__, continuation_chunk=lambda req, most: 10)
    assert done.admitted == [Admission(2, 10, False, True)]
    assert ctx.chunked_prefill_request_id == 2 and list(scheduler.waiting) == [2, 3]


def test_evicted_requests_go_to_the_front_behind_the_chunk_in_flight():
    ctx = make_ctx()
    scheduler = Scheduler(ctx)
    scheduler.waiting.extend([7, 8])
    scheduler.after_update([3, 4])
    assert list(scheduler.waiting) == [3, 4, 7, 8]
    # Request 7's first chunk in the context: the chunked prefill in flight.
    ctx.add_request(request(7, 20), chunk_length=8)
    ctx.chunked_prefill_request_id = 7
    scheduler.waiting.clear()
    scheduler.waiting.extend([7, 8])
    scheduler.after_update([3, 4])
    assert list(scheduler.waiting) == [7, 3, 4, 8]


def test_suspended_requests_go_back_in_row_order_the_chunk_restarting():
    scheduler = Scheduler(make_ctx())
    scheduler.waiting.extend([5, 9])  # 5: the chunked prefill in flight (also in the rows)
    scheduler.requeue_suspended([2, 1, 5])
    assert list(scheduler.waiting) == [2, 1, 5, 9]


def test_a_refused_add_leaves_the_queue_and_the_others_go_on():
    ctx = make_ctx()
    reqs = requests(3, 4, 5)

    def add(req, chunk_length=None):
        if req.request_id == 1:
            raise ValueError("request 1: refused")
        ctx.add_request(req, chunk_length)

    scheduler = Scheduler(ctx)
    scheduler.waiting.extend(reqs)
    done = scheduler.schedule(reqs.__getitem__, add=add)
    assert [a.request_id for a in done.admitted] == [0, 2]
    assert [(rid, str(error)) for rid, error in done.refused] == [(1, "request 1: refused")]
    assert not scheduler.waiting and ctx.total_request_count == 2


def test_a_stalled_continuation_raises_without_the_reserve():
    ctx = make_ctx(max_tokens=16)
    long = request(0, 40)
    scheduler = Scheduler(ctx, reserve_for_chunks=False)
    scheduler.waiting.append(0)
    assert scheduler.schedule(lambda rid: long).admitted == [Admission(0, 16, False, False)]
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True]), torch.tensor([1]))
    scheduler.after_update()
    # Someone else takes every free block: the next chunk has no KV slot.
    ctx.block_allocator.allocate_memory_blocks(ctx.block_allocator.total_avail)
    assert scheduler.continuation_room(long) == 0
    with pytest.raises(ChunkStalled, match="chunked request 0 finds no room"):
        scheduler.schedule(lambda rid: long)


def test_chunking_waits_for_room_with_the_reserve():
    """With the engine's reserve, a prompt is chunked only when the free blocks cover its whole
    prompt plus what the running requests may take meanwhile; without it, at once."""
    ctx = make_ctx(max_tokens=8)
    reqs = {0: request(0, 4), 1: request(1, 57, gen=4)}
    scheduler = Scheduler(ctx)
    scheduler.waiting.append(0)
    assert [a.request_id for a in scheduler.schedule(reqs.__getitem__).admitted] == [0]
    # Request 1 needs 15 blocks for its prompt; request 0 may take 3 more before its last
    # chunk (8 steps of 7 tokens: 2 blocks, plus 1). Leave 17 free: one short.
    alloc = ctx.block_allocator
    alloc.allocate_memory_blocks(alloc.total_avail - 17)
    scheduler.waiting.append(1)
    assert scheduler.schedule(reqs.__getitem__).admitted == []
    assert list(scheduler.waiting) == [1] and ctx.chunked_prefill_request_id == -1
    eager = Scheduler(ctx, reserve_for_chunks=False)
    eager.waiting.append(1)
    assert eager.schedule(reqs.__getitem__).admitted == [Admission(1, 4, False, False)]
