"""KV groups whose every layer is windowed (context/kv_group_sizing.py, docs/SEMANTICS.md §22):
group 0 holds no layers, its blocks are the requests' block tables; a long request holds at
most ``ceil(W / block_size) + 1`` blocks of each windowed group; the sizing's two regimes (the
windows' worst cases fit the buffer, or group 0 keeps the buffer's counts) and the derived
``max_requests``. The state machine's ``kvw-*`` configurations check every step."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import BLOCK, GIB, add, make_ctx, request

from dynctx.context.kv_group_sizing import (
    LOGICAL_BLOCK_CAP,
    all_windowed_memory,
    window_groups,
    windowed_fit,
    windowed_requests_rule,
    worst_case_blocks,
)
from dynctx.context.sizing import MemoryLayout

# The helpers' context: 2 layers, blocks of 4 tokens, 40 blocks (8 paused), 64 tokens a step.
ALL = [6, 6]


def test_every_layer_windowed_makes_groups_with_an_empty_group_zero():
    spec = window_groups((6, 9, 6), 64)
    assert spec.all_windowed and spec.windows == (None, 6, 9)
    assert spec.layers == ((), (0, 2), (1,)) and spec.group_of_layer == (1, 2, 1)
    assert window_groups((64, None), 64) is None    # no window shorter than the sequence


def test_fit_gives_group_zero_blocks_without_bytes():
    """Two rows: the window's worst case fits the buffer; group 0's blocks cost nothing and let
    every row reach max_sequence_length, its paused budget the buffer's share."""
    ctx = make_ctx(kv_layer_windows=ALL, max_requests=2)
    usage = ctx.kv_group_usage()
    worst = worst_case_blocks(6, block_size=4, max_requests=2, max_tokens=64)
    assert usage["layers"] == [0, 2] and usage["block_bytes"][0] == 0
    assert usage["blocks"][1] == worst == math.ceil((64 + 12) / 4) + 4 + 1
    assert ctx.memory_buffer.numel() == 0 and ctx.block_size_bytes == 0
    columns = 64 // 4
    alloc = ctx.block_allocator
    assert ctx.max_kv_block_count == columns
    # Active: every row at full length; paused: 8 of the buffer's 31 active blocks' share.
    assert alloc.active_count == 2 * columns
    assert alloc.paused_count == 8 * 2 * columns // 31
    assert ctx._kv.nbytes() == worst * 2 * BLOCK // 2 < make_ctx()._kv.nbytes()


def test_no_fit_keeps_the_buffers_counts():
    """Eight rows: the worst case exceeds the buffer, so group 0 keeps its 40 blocks and
    budgets (every rule bounds the windowed group too), the window its cap of 40."""
    ctx, plain = make_ctx(kv_layer_windows=ALL), make_ctx()
    alloc, usage = ctx.block_allocator, ctx.kv_group_usage()
    assert alloc.total_count == plain.block_allocator.total_count == 40
    assert alloc.paused_count == plain.block_allocator.paused_count
    assert usage["blocks"] == [40, 40]
    assert ctx._kv.nbytes() == plain._kv.nbytes()


def test_derived_max_requests_is_the_most_that_fit():
    """max_requests not given: the most rows whose worst cases fit the buffer (then rounded
    down to the request rounder), at most max_tokens; none fits: the rule without groups."""
    spec = window_groups((6, 6), 64)
    rule = windowed_requests_rule(spec, block_size=4, max_tokens=64)
    fits = [r for r in range(1, 40) if windowed_fit(spec, 40, block_size=4, max_requests=r,
                                                    max_tokens=64) is not None]
    assert rule(40) == max(fits) == 6
    assert windowed_requests_rule(spec, block_size=4, max_tokens=3)(40) == 3
    assert rule(10) == 9      # the step's 64 tokens alone need 16 blocks: none fits
    assert windowed_requests_rule(window_groups((None, 6), 64), block_size=4,
                                  max_tokens=64) is None
    ctx = make_ctx(kv_layer_windows=ALL, max_requests=None)
    assert ctx._request_rows == 4 and ctx.kv_group_usage()["blocks"][1] == worst_case_blocks(
        6, block_size=4, max_requests=4, max_tokens=64)


def test_logical_blocks_are_capped():
    spec = window_groups((6,), 1 << 20)
    memory = MemoryLayout(block_size_bytes=64, kv_reduced_dim=None, unified_memory_level=0,
                          total_blocks=10_000, paused_blocks=5_000, max_requests=16,
                          max_tokens=64, max_kv_block_count=9_999, bytes_per_block=64)
    grouped, windowed = all_windowed_memory(spec, memory, max_sequence_length=1 << 20,
                                            block_size=4)
    assert grouped.total_blocks == LOGICAL_BLOCK_CAP
    assert grouped.paused_blocks == LOGICAL_BLOCK_CAP // 2
    assert grouped.max_kv_block_count == 1 << 18 and grouped.bytes_per_block == 64
    assert windowed == [worst_case_blocks(6, block_size=4, max_requests=16, max_tokens=64)]


@pytest.mark.parametrize("rows", [2, 8], ids=["fit", "no-fit"])
def test_a_long_request_holds_its_windows_blocks_only(rows):
    """A 30-token prompt then decode to 60 tokens: the windowed group holds at most
    ceil(W / block) + 1 blocks once decoding (ceil((30 + W - 1) / block) + 1 at the prompt),
    group 0 every logical block; the step's windowed table reads -1 before the window; finishing
    returns every block."""
    ctx = make_ctx(kv_layer_windows=ALL, max_requests=rows)
    add(ctx, request(1, 30, gen=30))
    most = 0
    for _ in range(31):
        ctx.initialize_attention_state()
        offset = int(ctx.request_kv_length_offsets[0])
        count = int(ctx.request_kv_block_counts[0])
        held = ctx.kv_group_usage()["held"]
        assert held[0] == count
        bound = math.ceil((30 + 5) / 4) + 1 if offset == 0 else math.ceil(6 / 4) + 1
        assert held[1] <= bound
        windowed = ctx.active_attn_metadata.kv_group_block_tables[1][0]
        first = max(offset - 5, 0) // 4
        assert torch.all(windowed[:first] == -1) and torch.all(windowed[first:count] >= 0)
        most = max(most, held[1]) if offset else most
        ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))
    assert int(ctx.request_kv_length_offsets[0]) == 60 and most == math.ceil(6 / 4) + 1
    ctx.initialize_attention_state()
    ctx.update_requests(torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int64))
    assert ctx.kv_group_usage()["held"] == [0, 0]


def test_fit_runs_rows_past_the_buffer_without_a_pause():
    """Two rows of 60 tokens each need 30 blocks of every layer without groups, more than the
    11-block buffer's active half: with every layer windowed they run without a pause."""
    sizes = dict(kv_layer_windows=ALL, max_requests=2, buffer_size_gb=22 * BLOCK / GIB,
                 paused_buffer_size_gb=None, max_tokens=16)
    assert make_ctx(kv_groups=False, **sizes).block_allocator.active_count < 2 * 60 // 4
    ctx = make_ctx(**sizes)
    assert ctx.kv_group_usage()["blocks"][1] <= 22
    for rid in (1, 2):
        add(ctx, request(rid, 8, gen=54))
    for _ in range(53):
        ctx.initialize_attention_state()
        ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.int64))
        assert ctx.paused_request_count == 0
    assert ctx.request_kv_length_offsets[:2].tolist() == [60, 60]
    assert ctx.kv_group_usage()["held"][1] <= 2 * (math.ceil(6 / 4) + 1)
