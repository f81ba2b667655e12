"""Review cases of the steady decode update (``update_plan.plan_decode``,
``RequestTable.commit_decode``, ``DeviceState.apply_decode``): states the random lockstep of
``test_decode_path.py`` rarely or never reaches (counts written by hand at the table's width,
block sizes whose ``block_size - 1`` shares its low byte with other offsets, more than
``SMALL_CROSSING`` rows starting a block in one update with ``max_requests`` not a multiple of
4, the row plan after a crossing), each compared against the general path
(``_decode_shortcut = False``) state after state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import add, make_ctx
from test_decode_path import WORKLOADS, _request, assert_equal_states, full_state


def _pair(**overrides):
    contexts = [make_ctx(**overrides) for _ in range(2)]
    contexts[1]._decode_shortcut = False
    return contexts


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as error:  # both contexts must fail alike
        return "error", f"{type(error).__name__}: {error}"


def test_block_count_at_table_width_written_by_hand():
    """A row that fills its last block while its block count (written by hand) is already the
    block table's width has no column for a new block. The decode update must not write it
    into the next row's first column (a flat index of the table): it leaves the row to the
    general path, which fails as Megatron-Core does (an index out of the table's bounds), and
    both contexts end in the same state."""
    contexts = _pair(**WORKLOADS["roomy"])
    for c in contexts:
        for rid, length in enumerate((3, 5, 6)):
            add(c, _request(rid, length, 30))
        c.initialize_attention_state()
        c.update_requests(torch.ones(3, dtype=torch.bool), torch.arange(3))
    C = contexts[0].max_kv_block_count
    # Row 0 fills its last block at this update, and claims every column of its row.
    for c in contexts:
        c.initialize_attention_state()
        c.request_last_kv_block_offset[0] = c.block_size_tokens - 1
        c.request_kv_block_counts[0] = C
    before = contexts[0].request_to_kv_block_ids[1].clone()
    outcomes = [_outcome(lambda c=c: c.update_requests(torch.ones(3, dtype=torch.bool),
                                                       torch.arange(3)).tolist())
                for c in contexts]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "error" and "out of bounds" in outcomes[0][1], outcomes[0]
    # Row 1's block-table row was not written through row 0's missing column.
    assert torch.equal(contexts[0].request_to_kv_block_ids[1], before)
    assert_equal_states(full_state(contexts[0]), full_state(contexts[1]), "after the update")
