"""Update-plan cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md
"Mutation testing"): free rows hold reset values after ``update_requests`` clears them
(docs/SEMANTICS.md §1), whether the finished row is refilled by a mover or left past the end."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import add, check_invariants, make_ctx, request, step

from dynctx.context import MambaInferenceStateConfig


def free_rows(ctx):
    T = ctx.total_request_count
    return (ctx.host_request_ids()[T:], ctx.request_ids[T:].cpu().numpy(),
            ctx.block_table_host[T:])


@pytest.mark.parametrize("finished", [(2,), (3,), (1, 3), (1, 2, 3)])
def test_finished_rows_are_reset_to_free_values(finished):
    ctx = make_ctx()
    for rid in (1, 2, 3):
        add(ctx, request(rid, 5))
    step(ctx)
    step(ctx, finished_ids=finished)
    assert ctx.total_request_count == 3 - len(finished)
    host_ids, device_ids, table = free_rows(ctx)
    assert np.all(host_ids == -1) and np.all(device_ids == -1) and np.all(table == -1)
    check_invariants(ctx)


def test_a_hybrid_finished_row_gives_back_its_mamba_slot():
    layers, conv, ssm = ("M", "*"), (6, 4), (2, 3, 5)
    ctx = make_ctx(mamba_inference_state_config=MambaInferenceStateConfig(layers, conv, ssm))
    for rid in (1, 2, 3):
        add(ctx, request(rid, 5))
    step(ctx)
    step(ctx, finished_ids=(3,))
    host_ids, device_ids, table = free_rows(ctx)
    assert np.all(host_ids == -1) and np.all(device_ids == -1) and np.all(table == -1)
    slots = ctx.mamba_metadata.request_to_mamba_state_idx
    assert np.all(slots[ctx.total_request_count:].cpu().numpy() == -1)
