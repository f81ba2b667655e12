"""``reset()`` empties the context (docs/SEMANTICS.md §1, §9): after any workload every row,
free rows included, holds what a fresh context holds (ids -1, block rows -1, counters and
metadata 0: Megatron-Core's reset values), and so do the allocator and the counts. The capture
dummies of a CUDA graph get Megatron's output lengths (prompt + tokens to generate)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, make_ctx, request, step

from dynctx.context import DynamicInferenceRequest, SamplingParams

ROW_VIEWS = ("request_ids", "request_query_lengths", "request_output_lengths",
             "request_kv_length_offsets", "request_kv_block_counts", "request_last_kv_block_id",
             "request_last_kv_block_offset", "request_to_kv_block_ids")


def full_state(ctx) -> dict:
    """Every row of the per-request views (not only the live ones), the metadata, the
    allocator and the counts."""
    state = {name: getattr(ctx, name).detach().cpu().numpy().copy() for name in ROW_VIEWS}
    state.update({f"metadata.{label}": values.detach().cpu().numpy().copy()
                  for label, values in ctx.request_metadata.items()})
    alloc = ctx.block_allocator
    state["allocator"] = (alloc.block_bag.tolist(), alloc.ref_counts.tolist(), alloc.total_avail)
    state["counts"] = (ctx.total_request_count, ctx.paused_request_count,
                       ctx.active_token_count, ctx.num_prefill_requests,
                       ctx.chunked_prefill_request_id)
    return state


# Megatron-Core's reset values of every row (its ``DynamicInferenceContext.reset``).
RESET_VALUES = dict(request_ids=-1, request_query_lengths=0, request_output_lengths=0,
                    request_kv_length_offsets=0, request_kv_block_counts=0,
                    request_last_kv_block_id=-1, request_last_kv_block_offset=0,
                    request_to_kv_block_ids=-1)


def assert_reset_values(state: dict) -> None:
    for name, value in state.items():
        if name.startswith("metadata."):
            assert (value == 0).all(), name
        elif name in RESET_VALUES:
            assert (value == RESET_VALUES[name]).all(), name


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        if isinstance(want[name], np.ndarray):
            assert np.array_equal(got[name], want[name]), name
        else:
            assert got[name] == want[name], name


@pytest.mark.parametrize("paused", [False, True], ids=["roomy", "with-pauses"])
def test_reset_after_a_workload_equals_a_fresh_context(paused):
    # 16 blocks, 4 of them the paused budget: four requests of up to 6 blocks pause.
    sizes = dict(buffer_size_gb=16 * BLOCK / GIB, paused_buffer_size_gb=4 * BLOCK / GIB,
                 max_sequence_length=32) if paused else {}
    fresh = full_state(make_ctx(**sizes))
    ctx = make_ctx(**sizes)
    for rid, length in enumerate([5, 3, 9, 4]):
        add(ctx, request(rid, length, gen=12))
    for i in range(9):
        step(ctx, finished_ids={1} if i == 2 else ())
    assert ctx.total_request_count
    assert not paused or ctx.paused_request_count, "the workload should pause requests"
    ctx.reset()
    assert_same_state(full_state(ctx), fresh)
    assert_reset_values(fresh)
    # And it runs as a fresh one does.
    add(ctx, request(7, 6))
    step(ctx)
    assert ctx.request_ids[0] == 7 and ctx.request_kv_length_offsets[0] == 6


def test_capture_dummies_get_the_prompt_plus_the_tokens_to_generate():
    ctx = make_ctx()
    params = SamplingParams(num_tokens_to_generate=5, termination_id=-1)
    requests = [DynamicInferenceRequest(request_id=i, sampling_params=params,
                                        prompt_tokens=torch.zeros(n, dtype=torch.int64))
                for i, n in enumerate([1, 1, 3])]
    ctx.add_dummy_requests_parallel(requests[:2], count_as_prefill=False)
    ctx.add_dummy_requests_parallel(requests[2:])
    assert ctx.request_output_lengths[:3].tolist() == [6, 6, 8]
    assert ctx.request_query_lengths[:3].tolist() == [1, 1, 3]
    ctx.reset()
    assert_same_state(full_state(ctx), full_state(make_ctx()))
