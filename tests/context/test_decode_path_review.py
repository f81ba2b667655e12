"""Review cases of the steady decode update (``update_plan.plan_decode``,
``RequestTable.commit_decode``, ``DeviceState.apply_decode``): states the random lockstep of
``test_decode_path.py`` rarely or never reaches (counts written by hand outside the table,
block sizes whose ``block_size - 1`` shares its low byte with other offsets, more than
``SMALL_CROSSING`` rows starting a block in one update with ``max_requests`` not a multiple of
4, the row plan after a crossing), each compared against the general path
(``_decode_shortcut = False``) state after state."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import add, assert_same, make_ctx, snapshot
from test_decode_path import WORKLOADS, _request, assert_equal_states, full_state
from triton_marks import needs_triton

from dynctx.context import update_plan
from dynctx.context.batch_dimensions import InferenceBatchDimensions


def _pair(**overrides):
    contexts = [make_ctx(**overrides) for _ in range(2)]
    contexts[1]._decode_shortcut = False
    return contexts


@pytest.mark.parametrize("count", ["width", -1])
def test_block_count_outside_the_table_written_by_hand(count):
    """A row that fills its last block while its block count (written by hand) lies outside the
    block table (its width, or negative) has no column for a new block. Both paths raise the
    same ``IndexError`` naming the request and the limit, before anything changes: a flat index
    of the table once wrote the next row's first entry instead, and the general path raised
    from inside its commit, half done."""
    contexts = _pair(**WORKLOADS["roomy"])
    for c in contexts:
        for rid, length in enumerate((3, 5, 6)):
            add(c, _request(rid, length, 30))
        c.initialize_attention_state()
        c.update_requests(torch.ones(3, dtype=torch.bool), torch.arange(3))
    C = contexts[0].max_kv_block_count
    value = C if count == "width" else -1
    # Row 1 fills its last block at this update (it would move to row 0 and append there).
    for c in contexts:
        c.initialize_attention_state()
        c.request_last_kv_block_offset[1] = c.block_size_tokens - 1
        c.request_kv_block_counts[1] = value
    for c in contexts:
        before = snapshot(c, device=True)
        with pytest.raises(IndexError, match=rf"request 1 \(row 1\) needs a new block at column "
                                             rf"request_kv_block_counts={value}, outside the "
                                             rf"block table's \[0, max_kv_block_count={C}\)"):
            c.update_requests(torch.ones(3, dtype=torch.bool), torch.arange(3))
        assert_same(before, snapshot(c, device=True))


def _crossing_sizes(monkeypatch) -> list:
    """Records the number of rows that start a block in each decode plan made."""
    sizes = []
    real = update_plan.plan_decode

    def recorded(table, **kwargs):
        plan = real(table, **kwargs)
        if plan is not None:
            sizes.append(0 if plan.full is None else len(plan.full))
        return plan

    monkeypatch.setattr("dynctx.context.request_table.plan_decode", recorded)
    return sizes


def _crossing_sizes_plain(ctx) -> list:
    """The number of rows starting a block at each decode update of ``ctx`` (a wrapper of its
    table's ``plan_decode``)."""
    sizes = []
    table = ctx._table
    real = table.plan_decode

    def recorded(**kwargs):
        plan = real(**kwargs)
        if plan is not None:
            sizes.append(0 if plan.full is None else len(plan.full))
        return plan

    table.plan_decode = recorded
    return sizes


# block_size - 1 = 511 (0x1FF) and 271 (0x10F): their first byte is that of offsets 255 and 15,
# which the byte search meets as candidates and must reject (the decoys reach them at update 7).
@pytest.mark.parametrize("block_size, decoys", [(512, (254, 766)), (272, (14, 286))])
def test_many_rows_cross_with_decoy_offsets(block_size, decoys, monkeypatch, backend="torch"):
    """More than ``SMALL_CROSSING`` rows start a block in one update (the numpy branch), among
    rows whose last-block offsets share the first byte of ``block_size - 1`` (candidates of the
    byte search that are not matches), with ``max_requests`` = 37 (not a multiple of 4); and
    fewer rows crossing at other updates (the list branch). Lockstep with the general path."""
    sizes = _crossing_sizes(monkeypatch)
    token_bytes = 4 * 2 * 4  # fp32, K and V, 1 layer, 1 head of 4
    contexts = _pair(num_layers=1, num_attention_heads=1, kv_channels=4,
                     block_size_tokens=block_size, max_requests=37, max_tokens=8192,
                     kernel_backend=backend,
                     max_sequence_length=4 * block_size,
                     buffer_size_gb=150 * block_size * token_bytes / 1024 ** 3,
                     paused_buffer_size_gb=4 * block_size * token_bytes / 1024 ** 3)
    # Targets: the position each request's forwarded token reaches at update 6: a block's last
    # (23 rows cross there), or a decoy (offset 255 or 15 at update 7, where one row crosses).
    # A request added at update s with L prompt tokens forwards, at update t >= s, the token
    # at position L - 1 + (t - s).
    targets = [block_size - 1] * 20 + [2 * block_size - 1] * 3 + list(decoys) * 5 + \
        [block_size - 3, block_size - 2, block_size + 5, 9]
    assert len(targets) == 37
    rid = 0
    for update in range(12):
        if update < 5:
            group = targets[update::5]
            for target in group:
                length = target - (6 - update) + 1
                reqs = [_request(rid, length, 100) for _ in contexts]
                for c, r in zip(contexts, reqs):
                    add(c, r)
                rid += 1
        for c in contexts:
            c.initialize_attention_state()
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]), f"step {update}")
        A = contexts[0].total_request_count - contexts[0].paused_request_count
        tokens = torch.arange(A) + 1000 * update
        results = [c.update_requests(torch.ones(A, dtype=torch.bool), tokens).tolist()
                   for c in contexts]
        assert results[0] == results[1] == []
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]),
                            f"update {update}")
    # Update 6: 23 rows cross (numpy); update 7: one row among 10 decoys (the byte search);
    # update 8: one row; none at the updates in between (every update a decode update).
    assert sizes[-6:] == [23, 1, 1, 0, 0, 0], sizes
    assert contexts[0].total_request_count == 37


@pytest.mark.interpreter
@needs_triton
def test_many_rows_cross_with_decoy_offsets_triton(monkeypatch):
    """The same on the Triton kernels (the interpreter): 23 swaps and appended blocks in one
    compaction launch."""
    test_many_rows_cross_with_decoy_offsets(272, (14, 286), monkeypatch, backend="triton")


def test_decode_updates_after_capture_dummies(monkeypatch):
    """``add_dummy_requests_for_cudagraph_capture`` fills the context with rows whose blocks are
    the dummy block (never allocated); updates after it (not Megatron-Core's protocol, which
    resets, but allowed) cross blocks with those rows, which then allocate real blocks, and
    finish them (the dummy block is not released). CUDA-graph padding on; ``max_requests`` 13;
    lockstep with the general path, and the block invariants after every update."""
    crossings = _crossing_sizes(monkeypatch)
    contexts = _pair(**{**WORKLOADS["roomy"], "max_requests": 13}, num_cuda_graphs=4)
    graph = InferenceBatchDimensions(token_count=9, prefill_req_count=1, decode_req_count=6)
    for c in contexts:
        c.add_dummy_requests_for_cudagraph_capture(graph)
    assert contexts[0].total_request_count == 7
    sizes, graphs = [], []
    for update in range(14):
        for c in contexts:
            c.initialize_attention_state()
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]), f"step {update}")
        graphs.append(contexts[0].using_cuda_graph_this_step())
        A = contexts[0].total_request_count
        mask = torch.ones(A, dtype=torch.bool)
        if update >= 10:
            mask[update % A] = False  # finishes: the general path, the dummy block kept
        for c in contexts:
            c.update_requests(mask, torch.arange(A) + 100 * update)
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]), f"update {update}")
        check_invariants_with_dummies(contexts[0])
        sizes.append(contexts[0].block_allocator.total_avail)
    # Rows crossed blocks (real blocks allocated) in decode updates, then finished ones
    # released theirs.
    assert sum(size > 0 for size in crossings) >= 2, crossings
    assert min(sizes) < sizes[0] and sizes[-1] > min(sizes), sizes
    assert any(graphs), graphs


def check_invariants_with_dummies(ctx) -> None:
    """Every real block is free or held once; the dummy block is never free."""
    T = ctx.total_request_count
    table = ctx.request_to_kv_block_ids[:T].numpy()
    counts = ctx.request_kv_block_counts[:T].numpy()
    assert np.array_equal((table >= 0).sum(axis=1), counts)
    dummy = ctx.block_allocator.dummy_block_idx
    owned = table[(table >= 0) & (table != dummy)]
    alloc = ctx.block_allocator
    free = alloc.block_bag[:alloc.total_avail]
    assert owned.size == np.unique(owned).size and dummy not in free
    assert np.intersect1d(free, owned).size == 0
    assert owned.size + alloc.total_avail == alloc.total_count - 1


#: Writes by hand through the public views (``_write_by_hand``), the same in both contexts.
_WRITES = ("blocks", "blocks_up", "blocks_up", "blocks_moved", "kv_offset", "output",
           "query", "last_offset", "last_offset_full", "table", "count", "avail", "swap")


def _write_by_hand(contexts, rng, point: str) -> None:
    """One random write by hand, the same in every context, at ``point`` ("after add",
    "before step" or "before update"): a block count up or down (or moved between two rows,
    the sum kept), a KV offset, an output length, a query length with the token count, a
    last-block offset (to the block's last), a block-table entry, a count set to its value
    (the state becomes hand-written), the free-block count, or two active rows swapped."""
    c0 = contexts[0]
    P, T = c0.paused_request_count, c0.total_request_count
    kind = rng.choice(_WRITES)
    row, other = rng.randrange(T), rng.randrange(T)
    delta, up, less = rng.choice([-1, 1]), rng.randint(1, 6), rng.choice([0, 1])
    C, bs = c0.max_kv_block_count, c0.block_size_tokens
    for c in contexts:
        counts = c.request_kv_block_counts
        if kind == "blocks":
            counts[row] = max(0, min(C - 1, int(counts[row]) + delta))
        elif kind == "blocks_up":
            counts[row] = min(C - 1, int(counts[row]) + up)
        elif kind == "blocks_moved" and row != other and counts[row] >= 1 and \
                counts[other] < C - 1:
            counts[row] -= 1
            counts[other] += 1
        elif kind == "kv_offset":
            c.request_kv_length_offsets[row] += 1
        elif kind == "output":
            c.request_output_lengths[row] += 1
        elif kind == "query" and point == "before step" and row >= P:
            c.request_query_lengths[row] += 1
            c.active_token_count = c.active_token_count + 1
        elif kind == "last_offset":
            c.request_last_kv_block_offset[row] = (int(c.request_last_kv_block_offset[row]) + 1) \
                % bs
        elif kind == "last_offset_full":
            c.request_last_kv_block_offset[row] = bs - 1
        elif kind == "table" and counts[row] > 0:
            table = c.request_to_kv_block_ids
            table[row, int(counts[row]) - 1] = int(table[row, int(counts[row]) - 1])
        elif kind == "count":
            c.total_request_count = T
        elif kind == "avail":
            c.block_allocator.total_avail = max(0, c.block_allocator.total_avail - less)
        elif kind == "swap" and point != "before update" and row >= P and other >= P and \
                row != other:
            c._swap_book_keeping_tensors([row], [other], None)


@pytest.mark.parametrize("name, seed", [("tight", 13), ("tight", 40), ("roomy", 39)])
def test_decode_update_with_writes_by_hand(name, seed, monkeypatch):
    """Random workloads with writes by hand through every public view at every point between
    calls (after an ``add_request``, before ``initialize_attention_state``, between it and
    ``update_requests``), the same in both contexts: the decode update (which takes the block
    count sum and largest KV offset from the step it follows when the rows are unchanged)
    equals the general path, state after state. These seeds fail when the step signature
    leaves the block counts out (a stale sum lets rows resume past the active budget)."""
    carried = []
    real = update_plan.plan_decode

    def recorded(table, **kwargs):
        carried.append(kwargs.get("active_blocks") is not None)
        return real(table, **kwargs)

    monkeypatch.setattr("dynctx.context.request_table.plan_decode", recorded)
    contexts = _pair(**WORKLOADS[name])
    rng = random.Random(seed)
    rid, remaining = 0, {}

    def same(where):
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]), where)

    for step_index in range(80):
        where = f"{name} seed {seed} step {step_index}"
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                length, gen = rng.randint(1, 14), rng.randint(1, 60)
                if not all(contexts[0].check_availability(_request(rid, length, gen))):
                    break
                for c in contexts:
                    add(c, _request(rid, length, gen))
                remaining[rid] = gen
                rid += 1
                if rng.random() < 0.4:
                    _write_by_hand(contexts, rng, "after add")
                same(where + " add")
        if rng.random() < 0.4 and contexts[0].total_request_count:
            _write_by_hand(contexts, rng, "before step")
            same(where + " written before the step")
        P, T = contexts[0].paused_request_count, contexts[0].total_request_count
        if T == P:
            continue
        for c in contexts:
            c.initialize_attention_state()
        same(where + " initialize_attention_state")
        if rng.random() < 0.4:
            _write_by_hand(contexts, rng, "before update")
            same(where + " written before the update")
        ids = contexts[0].host_request_ids()[P:T].tolist()
        keep = [remaining[i] > 1 and rng.random() > 0.04 for i in ids]
        mask = torch.tensor(keep)
        tokens = torch.tensor([i * 10 + step_index for i in ids])
        outcomes = []
        for c in contexts:
            try:
                outcomes.append(("ok", c.update_requests(mask.clone(), tokens.clone()).tolist(),
                                 c.evicted_request_ids.tolist()))
            except (IndexError, RuntimeError) as error:
                # A hand-written count at the table's width, or no request able to run: both
                # contexts fail alike (their partial states are not compared).
                outcomes.append(("error", f"{type(error).__name__}: {error}"))
        assert outcomes[0] == outcomes[1], where
        if outcomes[0][0] == "error":
            break
        same(where + " update_requests")
        for i, kept in zip(ids, keep):
            remaining[i] -= kept
    assert sum(carried) >= 2, carried


def test_row_plan_identity_after_a_crossing():
    """``DeviceState.apply_decode`` puts the arena's row plan back to the identity after the
    launch: appended blocks of a crossing of two rows must not be applied again at a later
    decode update where one row crosses and moves (row 1, its last-block offset written by
    hand), which would write the old block into the row that moved there. The device block
    tables equal the general path's and the host's after every update."""
    contexts = _pair(**WORKLOADS["roomy"])
    bs = contexts[0].block_size_tokens
    for c in contexts:
        # Rows 0 and 1 fill their last block at update 1; row 2 at none of updates 0-2.
        for rid, length in enumerate((bs - 1, 2 * bs - 1, bs + 1)):
            add(c, _request(rid, length, 30))
    crossings = _crossing_sizes_plain(contexts[0])
    for update in range(3):
        for c in contexts:
            c.initialize_attention_state()
        if update == 2:
            for c in contexts:
                c.request_last_kv_block_offset[1] = bs - 1
        for c in contexts:
            c.update_requests(torch.ones(3, dtype=torch.bool), torch.arange(3) + 10 * update)
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]), f"update {update}")
        mirrors = contexts[0]._device.mirrors(contexts[0]._table)
        assert np.array_equal(mirrors["block_table"].numpy(),
                              contexts[0].request_to_kv_block_ids.numpy()), f"update {update}"
    assert crossings == [0, 2, 1], crossings
