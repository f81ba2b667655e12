"""The request table before ``bind`` and after ``unbind`` (a suspend): it holds no rows and
reports no used blocks (context/request_table.py), with and without prefix caching. A
bookkeeping read in that window (the allocator asks the table for its usage) must see an
empty table, not fail on rows that were never set."""

from __future__ import annotations

import numpy as np
import pytest

from dynctx.context._fields import NUM_FIELDS
from dynctx.context.request_table import RequestTable


def table(prefix_caching):
    return RequestTable(total_blocks=8, paused_blocks=2, max_requests=4, max_kv_block_count=4,
                        block_size=16, metadata_labels=[], hybrid=False, max_tokens=32,
                        prefix_caching=prefix_caching)


@pytest.mark.parametrize("prefix_caching", [None, "ref_zero", "lru"])
def test_an_unbound_table_holds_nothing_and_uses_no_blocks(prefix_caching):
    fresh = table(prefix_caching)
    assert not fresh.bound and fresh.rows is None and fresh.block_table is None
    assert fresh.active_used_blocks() == 0 and fresh.paused_used_blocks() == 0
    assert (fresh.paused, fresh.total, fresh.active) == (0, 0, 0)


def test_unbind_drops_the_rows_it_was_given():
    bound = table(None)
    rows = np.zeros((NUM_FIELDS, 4), dtype=np.int32)
    bound.bind(rows, {}, None)
    assert bound.bound and bound.block_table.shape == (4, 4)
    bound.unbind()
    assert not bound.bound and bound.rows is None and bound.block_table is None
    assert bound.active_used_blocks() == 0 and bound.paused_used_blocks() == 0
