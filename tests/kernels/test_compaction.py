"""compact_requests: Triton kernel and torch reference against a row-by-row Python oracle.

Runs compiled on CUDA, or on a CPU under TRITON_INTERPRET=1 (set before pytest starts).
Outputs live inside poisoned buffers (0xFF bytes, then 0x5A bytes, so that a row the kernel
should set to -1 but skips is caught too); the whole buffer, guard bands included, must equal
the oracle's.
"""

import pytest
import torch
from kernel_test_utils import DEVICE, POISONS, assert_raises_naming, check_tune_case, poisoned

from dynctx.kernels import autotune
from dynctx.kernels.compaction import (
    compact_requests,
    compact_requests_configs,
    compact_requests_default_config,
    compact_requests_ref,
    compact_requests_tune_key,
)

pytestmark = pytest.mark.interpreter

GUARD = 2


def _source_state(max_requests, max_blocks, *, seed=0):
    """A plausible old state: row i owns a few distinct blocks, then -1; a pending token per row."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.full((max_requests, max_blocks), -1, dtype=torch.int32)
    ids = torch.randperm(max_requests * max_blocks, generator=gen).to(torch.int32)
    ids = ids.view(max_requests, max_blocks)
    counts = torch.randint(1, max_blocks + 1, (max_requests,), generator=gen)
    for row in range(max_requests):
        table[row, :counts[row]] = ids[row, :counts[row]]
    next_tokens = torch.randint(1000, 2000, (max_requests,), generator=gen)
    return table.to(DEVICE), next_tokens.to(DEVICE)


def _oracle(dst_table, dst_tokens, src_table, src_tokens, new_tokens, plan_src, append_col,
            append_block, new_token_offset, num_rows, clear_rows):
    """The contract, row by row (plans are host lists here)."""
    for row in range(num_rows):
        src = plan_src[row]
        if src >= 0:
            dst_table[row] = src_table[src]
            if src >= new_token_offset:
                dst_tokens[row] = new_tokens[src - new_token_offset]
            else:
                dst_tokens[row] = src_tokens[src]
        else:
            dst_table[row] = -1
            dst_tokens[row] = 0
        if append_col[row] >= 0:
            dst_table[row, append_col[row]] = append_block[row]
    for row in range(num_rows, clear_rows):
        dst_table[row] = -1
        dst_tokens[row] = 0


def _run_case(*, max_requests, max_blocks, plan_src, appends=None, new_token_offset=0,
              num_new_tokens=None, clear_rows=None, new_dtype=torch.int64, config=None, seed=0):
    num_rows = len(plan_src)
    clear_rows = num_rows if clear_rows is None else clear_rows
    appends = appends or {}
    append_col = [appends.get(row, (-1, -1))[0] for row in range(num_rows)]
    append_block = [appends.get(row, (-1, -1))[1] for row in range(num_rows)]
    src_table, src_tokens = _source_state(max_requests, max_blocks, seed=seed)
    if num_new_tokens is None:
        num_new_tokens = max_requests - new_token_offset
    new_tokens = torch.arange(5000, 5000 + num_new_tokens, dtype=new_dtype, device=DEVICE)
    # Plans carry a poisoned tail: the kernel must read only the first num_rows entries.
    def plan(values):
        return torch.tensor(values + [7, 7], dtype=torch.int32, device=DEVICE)

    for poison in POISONS:
        results = {}
        for who in ("triton", "torch", "oracle"):
            # The oracle writes element by element: on the host.
            device = "cpu" if who == "oracle" else DEVICE
            table_buf, table = poisoned((max_requests, max_blocks), torch.int32, poison, device,
                                        guard=GUARD)
            tokens_buf, tokens = poisoned((max_requests,), torch.int64, poison, device, guard=GUARD)
            if who == "oracle":
                _oracle(table, tokens, src_table.cpu(), src_tokens.cpu(), new_tokens.cpu(),
                        plan_src, append_col, append_block, new_token_offset, num_rows,
                        clear_rows)
            else:
                compact_requests(table, src_table, tokens, src_tokens, new_tokens, plan(plan_src),
                                 plan(append_col), plan(append_block),
                                 new_token_offset=new_token_offset, num_rows=num_rows,
                                 clear_rows=clear_rows, config=config, backend=who)
            results[who] = (table_buf, tokens_buf)
        for who in ("triton", "torch"):
            for index, name in enumerate(("block table", "next tokens")):
                assert torch.equal(results[who][index].cpu(), results["oracle"][index]), (
                    f"{who}: {name} (poison {poison:#x})")


CASES = [
    pytest.param(dict(max_requests=5, max_blocks=4, plan_src=[]), id="zero_rows"),
    pytest.param(dict(max_requests=5, max_blocks=4, plan_src=[], clear_rows=4), id="clear_only"),
    pytest.param(dict(max_requests=1, max_blocks=3, plan_src=[0]), id="one_row"),
    pytest.param(dict(max_requests=9, max_blocks=7, plan_src=list(range(7))), id="identity_odd"),
    pytest.param(dict(max_requests=6, max_blocks=5, plan_src=[1, 0, 3, 2, 4]),
                 id="permutation_swaps"),
    # Rows 1 and 3 finished: the tail survivors 5 and 4 fill the holes; rows 4, 5 are cleared.
    pytest.param(dict(max_requests=8, max_blocks=5, plan_src=[0, 5, 2, 4], clear_rows=6),
                 id="holes"),
    # Resumed rows get a block at their first free column: mid-table, the last column, column 0.
    pytest.param(dict(max_requests=6, max_blocks=6, plan_src=[0, 1, 2, -1],
                      appends={0: (3, 900), 1: (5, 901), 3: (0, 902)}),
                 id="appends_block_boundary"),
    # Rows 0-2 are paused: they keep their pending token; rows from 3 on take the sampled one.
    pytest.param(dict(max_requests=9, max_blocks=4, plan_src=[2, 0, 1, 6, 3, 5, 4],
                      new_token_offset=3, num_new_tokens=4, clear_rows=9), id="paused_keep_token"),
    pytest.param(dict(max_requests=7, max_blocks=4, plan_src=[0, -1, 2], clear_rows=5),
                 id="evicted_hole_clear"),
    pytest.param(dict(max_requests=7, max_blocks=4, plan_src=[4, 3, 2, 1, 0], clear_rows=2),
                 id="clear_below_rows"),
    pytest.param(dict(max_requests=6, max_blocks=3, plan_src=[5, 4, 3], new_dtype=torch.int32,
                      new_token_offset=2, num_new_tokens=4), id="int32_new_tokens"),
    pytest.param(dict(max_requests=10, max_blocks=9, plan_src=[9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
                      appends={9: (8, 77)}), id="full_table_reversed"),
    # A block table of one column (max_kv_block_count 1).
    pytest.param(dict(max_requests=4, max_blocks=1, plan_src=[1, 0, -1], clear_rows=4,
                      appends={2: (0, 40)}), id="one_column"),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_oracle(case):
    _run_case(**case)


# Every config: 21 rows and 70 columns give several row and column tiles for each block shape.
ALL_CONFIGS_KEY = compact_requests_tune_key(max_blocks=70, num_rows=19)


@pytest.mark.parametrize("config", [pytest.param(c, id=str(c))
                                    for c in compact_requests_configs(ALL_CONFIGS_KEY)])
def test_every_config(config):
    gen = torch.Generator().manual_seed(11)
    plan_src = torch.randperm(21, generator=gen)[:19].tolist()
    plan_src[4] = plan_src[11] = -1
    appends = {0: (69, 1000), 3: (64, 1001), 18: (0, 1002), 4: (63, 1003)}
    _run_case(max_requests=21, max_blocks=70, plan_src=plan_src, appends=appends,
              new_token_offset=5, num_new_tokens=16, clear_rows=21, config=config)


def test_default_config_is_in_search_space():
    for max_blocks in (4, 70, 128, 256, 1000):
        for num_rows in (1, 64, 1024):
            key = compact_requests_tune_key(max_blocks=max_blocks, num_rows=num_rows)
            assert compact_requests_default_config(key) in compact_requests_configs(key)


def test_tune_cases_check_at_scaled_down_presets():
    tuning = autotune.get_tuning("compact_requests")
    for key in tuning.presets():
        check_tune_case(tuning, {**key, "num_rows": min(key["num_rows"], 4)})


def test_disjoint_halves_of_one_allocation_are_allowed():
    both = torch.full((8, 3), -1, dtype=torch.int32, device=DEVICE)
    both[4:] = torch.arange(12, dtype=torch.int32, device=DEVICE).view(4, 3)
    tokens = torch.arange(8, device=DEVICE)
    plan = torch.tensor([3, 2, 1, 0], dtype=torch.int32, device=DEVICE)
    none = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    compact_requests(both[:4], both[4:], tokens[:4], tokens[4:], tokens[:0], plan, none, none,
                     new_token_offset=4, num_rows=4, clear_rows=0, backend="triton")
    assert torch.equal(both[:4], both[4:].flip(0))
    assert torch.equal(tokens[:4], torch.tensor([7, 6, 5, 4], device=DEVICE))


@pytest.mark.parametrize("check", [True, False])
def test_numpy_integers_are_host_ints(check):
    """``new_token_offset``, ``num_rows`` and ``clear_rows`` from host numpy arithmetic (a
    plan's row counts) launch as the ints they are, with or without the checks."""
    import numpy as np

    src_table, src_tokens = _source_state(6, 3)
    plan = [torch.tensor(v, dtype=torch.int32, device=DEVICE)
            for v in ([4, 3, 1], [-1, 2, -1], [-1, 77, -1])]
    new = torch.tensor([50, 51], device=DEVICE)
    outputs = []
    for as_int in (int, np.int64):
        table, tokens = torch.full_like(src_table, 3), torch.full_like(src_tokens, 3)
        compact_requests(table, src_table, tokens, src_tokens, new, *plan,
                         new_token_offset=as_int(2), num_rows=as_int(3), clear_rows=as_int(5),
                         backend="triton", check=check)
        outputs.append((table, tokens))
    expected = (torch.full_like(src_table, 3), torch.full_like(src_tokens, 3))
    compact_requests_ref(*expected[:1], src_table, expected[1], src_tokens, new, *plan,
                         new_token_offset=2, num_rows=3, clear_rows=5)
    for table, tokens in outputs:
        assert torch.equal(table, expected[0]) and torch.equal(tokens, expected[1])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_source_row_just_past_the_sampled_rows_takes_token_0(backend):
    """Source row ``new_token_offset + len(new_tokens)``: its blocks, and token 0, as a row
    without a source; the kernel reads no token past ``new_tokens`` (here a view whose next
    element is 99)."""
    src_table, src_tokens = _source_state(6, 3)
    buffer = torch.tensor([50, 51, 99], device=DEVICE)
    plan = [torch.tensor(v, dtype=torch.int32, device=DEVICE)
            for v in ([4, 3, 1], [-1] * 3, [-1] * 3)]
    table = torch.full_like(src_table, 3)
    tokens = torch.full_like(src_tokens, 3)
    compact_requests(table, src_table, tokens, src_tokens, buffer[:2], *plan,
                     new_token_offset=2, num_rows=3, clear_rows=3, backend=backend)
    assert torch.equal(table[:3], src_table[[4, 3, 1]])
    assert tokens[:3].tolist() == [0, 51, int(src_tokens[1])]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_table_without_columns_still_moves_the_tokens(backend):
    """A block table of 0 columns (no block to move) with rows to write: the next tokens are
    compacted and cleared all the same, on the full path and on a plan's replay with other
    counts of the same class. (A launcher that returned early for 0 columns wrote none.)"""
    table = torch.empty(4, 0, dtype=torch.int32, device=DEVICE)
    src_table = torch.empty(4, 0, dtype=torch.int32, device=DEVICE)
    src_tokens = torch.tensor([10, 11, 12, 13], device=DEVICE)
    new = torch.tensor([50, 51], device=DEVICE)
    plan = [torch.tensor(v, dtype=torch.int32, device=DEVICE)
            for v in ([3, 0, -1], [-1] * 3, [-1] * 3)]
    for num_rows, clear_rows, expected in ((3, 4, [51, 10, 0, 0]), (2, 3, [51, 10, 0, 7])):
        tokens = torch.full((4,), 7, device=DEVICE)
        compact_requests(table, src_table, tokens, src_tokens, new, *plan, new_token_offset=2,
                         num_rows=num_rows, clear_rows=clear_rows, backend=backend)
        assert tokens.tolist() == expected, (num_rows, clear_rows)


def test_row_counts_share_one_plan_per_class_with_a_launch_per_count():
    """The plan key holds the bucket of the rows written, not the counts: one plan per bucket
    (its config's), and in it one launch per count tuple, each call equal to the reference.
    Rows 0..3 then 3..20 written are two buckets (4 and 32), also when the count objects are
    the last call's (a cached answer must not leak across buckets); 0 live rows and 3 cleared,
    and 4 rows without clearing, are in the bucket of 4."""
    from dynctx.kernels.launch_plan import clear_plans, plan_caches

    rows, columns = 24, 3
    src_table, src_tokens = _source_state(rows, columns)
    gen = torch.Generator().manual_seed(9)
    plan = [torch.randperm(rows, generator=gen).to(torch.int32).to(DEVICE),
            torch.randint(-1, columns, (rows,), generator=gen, dtype=torch.int32).to(DEVICE),
            torch.randint(100, 200, (rows,), generator=gen, dtype=torch.int32).to(DEVICE)]
    new = torch.arange(5000, 5000 + rows, device=DEVICE)
    table = torch.full((rows, columns), -7, dtype=torch.int32, device=DEVICE)
    tokens = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    counts = [(2, 3, 20), (2, 3, 3), (2, 0, 3), (2, 4, 0)]
    clear_plans()
    for offset, num_rows, clear_rows in counts:
        want = (table.clone(), tokens.clone())
        compact_requests_ref(want[0], src_table, want[1], src_tokens, new, *plan,
                             new_token_offset=offset, num_rows=num_rows, clear_rows=clear_rows)
        compact_requests(table, src_table, tokens, src_tokens, new, *plan,
                         new_token_offset=offset, num_rows=num_rows, clear_rows=clear_rows,
                         backend="triton")
        assert torch.equal(table, want[0]) and torch.equal(tokens, want[1]), num_rows
    plans = list(plan_caches()["compact_requests"]._plans.values())
    assert sorted(sorted(p.variants) for p in plans) == [sorted(counts[1:]), counts[:1]]


def test_custom_op_matches_reference():
    src_table, src_tokens = _source_state(5, 4)
    args = [torch.tensor(v, dtype=torch.int32, device=DEVICE)
            for v in ([2, 0, -1], [1, -1, 0], [55, -1, 66])]
    new_tokens = torch.tensor([10, 11, 12], device=DEVICE)
    got = (torch.full_like(src_table, 3), torch.full_like(src_tokens, 3))
    expected = (torch.full_like(src_table, 3), torch.full_like(src_tokens, 3))
    torch.ops.dynctx.compact_requests(got[0], src_table, got[1], src_tokens, new_tokens, *args,
                                      2, 3, 4)
    compact_requests_ref(expected[0], src_table, expected[1], src_tokens, new_tokens, *args,
                         new_token_offset=2, num_rows=3, clear_rows=4)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    torch.library.opcheck(torch.ops.dynctx.compact_requests.default,
                          (got[0], src_table, got[1], src_tokens, new_tokens, *args, 2, 3, 4))


def _bad_calls():
    table = torch.zeros(6, 4, dtype=torch.int32, device=DEVICE)
    src = torch.zeros(6, 4, dtype=torch.int32, device=DEVICE)
    tokens = torch.zeros(6, dtype=torch.int64, device=DEVICE)
    src_tokens = torch.zeros(6, dtype=torch.int64, device=DEVICE)
    new = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    plan = torch.zeros(4, dtype=torch.int32, device=DEVICE)

    def call(**override):
        args = dict(dst_block_table=table, src_block_table=src, dst_next_tokens=tokens,
                    src_next_tokens=src_tokens, new_tokens=new, plan_src=plan, plan_append_col=plan,
                    plan_append_block=plan)
        sizes = dict(new_token_offset=2, num_rows=4, clear_rows=5)
        for k, v in override.items():
            (sizes if k in sizes else args)[k] = v
        return lambda: compact_requests(*args.values(), **sizes)

    return [
        pytest.param(call(src_block_table=table), "src_block_table", id="tables_alias"),
        pytest.param(call(dst_block_table=src[:4], src_block_table=src[2:]), "src_block_table",
                     id="tables_overlap"),
        pytest.param(call(src_next_tokens=tokens), "src_next_tokens", id="tokens_alias"),
        pytest.param(call(new_tokens=tokens[4:]), "new_tokens", id="new_tokens_alias"),
        pytest.param(call(dst_block_table=table.long()), "dst_block_table", id="table_int64"),
        pytest.param(call(src_block_table=src[:, :3]), "src_block_table", id="columns_differ"),
        pytest.param(call(dst_next_tokens=tokens.int()), "dst_next_tokens", id="tokens_int32"),
        pytest.param(call(new_tokens=new.float()), "new_tokens", id="new_tokens_float"),
        pytest.param(call(plan_src=plan[:3]), "plan_src", id="plan_short"),
        pytest.param(call(plan_append_block=plan.long()), "plan_append_block", id="plan_int64"),
        pytest.param(call(plan_append_col=plan[None]), "plan_append_col", id="plan_2d"),
        pytest.param(call(clear_rows=7), "clear_rows", id="clear_past_table"),
        pytest.param(call(num_rows=-1), "num_rows", id="negative_rows"),
        pytest.param(call(new_token_offset=7), "new_token_offset", id="offset_past_tokens"),
    ]


@pytest.mark.parametrize("call, name", _bad_calls())
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_raise(call, name, backend, monkeypatch):
    assert_raises_naming(call, name, backend, monkeypatch)
