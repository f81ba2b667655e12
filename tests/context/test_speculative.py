"""Speculative steps in the context (``num_speculative_tokens = k``, docs/SEMANTICS.md §19):
construction, the step's ``1 + k`` tokens a decode request, blocks taken early, the drafts
through pause / resume / eviction, the logit rows, and ``rewind_kv_cache``; then a seeded random
workload (chunked prefills, memory pressure, random acceptance) checked against a model of
every request's kept tokens, K/V included, after every call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, assert_same, check_invariants, make_ctx, request, snapshot
from triton_marks import needs_triton

from dynctx.context.batch_dimensions import InferenceBatchDimensions as Dims
from dynctx.context.errors import SpeculativeConfigError, StepShapeError
from dynctx.context.graph_ladder import (
    build_cuda_graph_ladder,
    dummy_request_plan,
    eager_padded_dimensions,
    graph_attention_maxima,
)
from dynctx.kernels import backend


def _decode_step(ctx, k: int):
    """The step's rows as ``[(row, ids, positions, blocks)]`` per active request."""
    ctx.initialize_attention_state()
    n = ctx.active_token_count
    ids = ctx.token_to_input_ids[:n].tolist()
    pos = ctx.token_to_pos_ids[:n].tolist()
    blocks = ctx.token_to_block_idx[:n].tolist()
    rows = ctx.token_to_request_idx[:n].tolist()
    return ids, pos, blocks, rows


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("k", [4, 5])
def test_num_speculative_tokens_must_be_below_the_block_size(k):
    with pytest.raises(SpeculativeConfigError,
                       match=rf"num_speculative_tokens \({k}\) must be < block_size_tokens \(4\)"):
        make_ctx(num_speculative_tokens=k)
    assert issubclass(SpeculativeConfigError, AssertionError)  # 0.19 asserts it
    assert issubclass(SpeculativeConfigError, ValueError)


@pytest.mark.parametrize("bad, error", [(-1, SpeculativeConfigError), (1.0, TypeError),
                                        (True, TypeError)])
def test_num_speculative_tokens_refuses_bad_values(bad, error):
    with pytest.raises(error, match="num_speculative_tokens"):
        make_ctx(num_speculative_tokens=bad)


def test_k_zero_is_the_default_context():
    a, b = make_ctx(), make_ctx(num_speculative_tokens=0)
    assert a.max_kv_block_count == b.max_kv_block_count == 16
    assert b.num_speculative_tokens == 0 and b.paused_speculative_tokens is None
    assert a.cuda_graph_batch_dimensions_list == b.cuda_graph_batch_dimensions_list
    for ctx in (a, b):
        add(ctx, request(1, 5))
        ctx.initialize_attention_state()
    assert a.num_last_token_logits == b.num_last_token_logits == 1
    assert b.speculative_required_logit_indices().tolist() == [4]
    with pytest.raises(RuntimeError, match="num_speculative_tokens > 0"):
        b.rewind_kv_cache(torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        b.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([7]),
                          torch.zeros(1, 1, dtype=torch.int64))
    left, right = snapshot(a, device=True), snapshot(b, device=True)
    del left["kv_bytes"], right["kv_bytes"]   # the buffers' bytes were never written
    assert_same(left, right)


def test_speculative_context_has_one_more_block_column():
    ctx = make_ctx(num_speculative_tokens=3)
    assert ctx.max_kv_block_count == 17  # ceil(64 / 4) + 1, as 0.19
    assert ctx.request_to_kv_block_ids.shape[1] == 17


# ---------------------------------------------------------------------------- the ladder
def test_ladder_counts_one_plus_k_tokens_per_decode_request():
    kw = dict(num_cuda_graphs=4, max_requests=8, max_tokens=64, max_sequence_length=64,
              cuda_graph_mixed_prefill_count=2)
    plain = build_cuda_graph_ladder(**kw)
    assert plain == build_cuda_graph_ladder(**kw, tokens_per_decode=1)
    ladder = build_cuda_graph_ladder(**kw, cuda_graph_max_tokens=24, tokens_per_decode=3)
    decode = [d for d in ladder if d.prefill_req_count == 0]
    assert decode and all(d.token_count == 3 * d.decode_req_count for d in decode)
    assert max(d.decode_req_count for d in decode) == 8
    for dims in ladder:
        assert dims.token_count >= dims.prefill_req_count + 3 * dims.decode_req_count
    mixed = [d for d in ladder if d.prefill_req_count and d.decode_req_count]
    assert all(d.decode_req_count == min((d.token_count - 2) // 3, 6) for d in mixed)
    assert dummy_request_plan(Dims(12, 0, 4), 3) == (4, [])
    assert dummy_request_plan(Dims(14, 2, 3), 3) == (3, [3, 2])
    with pytest.raises(ValueError, match=r"decode_req_count \* 3"):
        dummy_request_plan(Dims(4, 0, 4), 3)
    assert graph_attention_maxima(Dims(12, 0, 4), 64, 3) == (3, 64)
    assert eager_padded_dimensions(Dims(9, 0, 3), max_requests=8, max_tokens=64,
                                   tokens_per_decode=3) == Dims(12, 0, 4)


def test_context_graphs_count_one_plus_k_tokens():
    ctx = make_ctx(num_speculative_tokens=2, num_cuda_graphs=2, max_tokens=64)
    decode = [d for d in ctx.cuda_graph_batch_dimensions_list if d.prefill_req_count == 0]
    assert decode and all(d.token_count == 3 * d.decode_req_count for d in decode)
    graph = decode[0]
    ctx.initialize_attention_state(construct_graph_dimensions=graph)
    assert ctx.using_cuda_graph_this_step() and ctx.padded_batch_dimensions == graph
    assert ctx.request_query_lengths[:graph.decode_req_count].tolist() == \
        [3] * graph.decode_req_count
    assert ctx.num_last_token_logits == graph.token_count
    assert ctx.speculative_required_logit_indices().tolist() == list(range(graph.token_count))
    ctx.reset()
    # A real decode step of 3 requests runs in the smallest decode graph that holds them.
    for rid in range(3):
        add(ctx, request(rid, 2))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(3, dtype=torch.bool), torch.tensor([1, 2, 3]),
                        torch.zeros(2, 3, dtype=torch.int64))
    ctx.initialize_attention_state()
    assert ctx.active_token_count == 9
    assert ctx.using_cuda_graph_this_step()
    assert ctx.padded_batch_dimensions.prefill_req_count == 0
    assert ctx.padded_active_token_count == 3 * ctx.padded_batch_dimensions.decode_req_count
    assert ctx.num_last_token_logits == ctx.padded_active_token_count


# ---------------------------------------------------------------------------- the step
def test_decode_step_forwards_pending_token_and_drafts_in_blocks_taken_early():
    k = 2
    ctx = make_ctx(num_speculative_tokens=k)
    add(ctx, request(1, 5))   # last token at offset 0 of block 1: room for 3 more
    add(ctx, request(2, 3))   # last token at offset 2: the next 3 cross, a block is taken
    add(ctx, request(3, 2))   # offset 1 >= 4 - 1 - 2: a block is taken too
    ctx.initialize_attention_state()
    assert ctx.num_last_token_logits == 3
    assert ctx.speculative_required_logit_indices().tolist() == [4, 7, 9]
    drafts = torch.tensor([[11, 21, 31], [12, 22, 32]])
    ctx.update_requests(torch.ones(3, dtype=torch.bool), torch.tensor([10, 20, 30]), drafts)
    check_invariants(ctx)
    ids = ctx.host_request_ids().tolist()
    ids_, pos, blocks, rows = _decode_step(ctx, k)
    assert ctx.request_query_lengths[:3].tolist() == [3, 3, 3]
    table = ctx.block_table_host
    prompt = {1: 5, 2: 3, 3: 2}
    for row, rid in enumerate(ids):
        sl = slice(3 * row, 3 * row + 3)
        assert ids_[sl] == [rid * 10, rid * 10 + 1, rid * 10 + 2]
        assert pos[sl] == list(range(prompt[rid], prompt[rid] + 3))
        assert rows[sl] == [row] * 3
        # Every token's block is the row's block of its position: the step fits.
        assert blocks[sl] == [int(table[row, p // 4]) for p in pos[sl]]
        assert ctx.kv_block_counts_host[row] == (prompt[rid] + 2) // 4 + 1
    assert ctx.num_last_token_logits == 9
    assert ctx.speculative_required_logit_indices().tolist() == list(range(9))
    logits = torch.randn(1, ctx.padded_active_token_count, 5)
    assert torch.equal(ctx.last_token_logits(logits), logits[0, :9])


def test_update_requires_the_drafts_and_checks_them_first():
    ctx = make_ctx(num_speculative_tokens=2)
    add(ctx, request(1, 5))
    add(ctx, request(2, 3))
    ctx.initialize_attention_state()
    before = snapshot(ctx, device=True)
    mask, tokens = torch.ones(2, dtype=torch.bool), torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"new_speculative_tokens \[num_speculative_tokens=2"):
        ctx.update_requests(mask, tokens)
    with pytest.raises(StepShapeError, match=r"shape \(2, 3\).*\[num_speculative_tokens=2, "
                                             r"active requests=2\]"):
        ctx.update_requests(mask, tokens, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer"):
        ctx.update_requests(mask, tokens, torch.zeros(2, 2))
    assert_same(before, snapshot(ctx, device=True))


def test_drafts_travel_with_their_rows_through_pause_resume_and_eviction():
    # A tight budget: requests pause when they need their next block early, resume later, and
    # the paused budget evicts some.
    k = 1
    ctx = make_ctx(num_speculative_tokens=k, buffer_size_gb=9 * BLOCK / GIB,
                   paused_buffer_size_gb=4 * BLOCK / GIB)
    for rid in range(3):
        add(ctx, request(rid, 3, gen=30))
    ctx.initialize_attention_state()
    drafts = {rid: 500 + rid for rid in range(3)}
    pending = {rid: 100 + rid for rid in range(3)}
    seen_paused, evicted = False, []
    for step in range(12):
        active = ctx.host_request_ids()[ctx.paused_request_count:].tolist()
        paused = ctx.host_request_ids()[:ctx.paused_request_count].tolist()
        if paused:
            seen_paused = True
            got = ctx.paused_speculative_tokens
            assert got.shape == (k, len(paused))
            assert got[0].tolist() == [drafts[rid] for rid in paused]
            assert ctx.paused_tokens.tolist() == [pending[rid] for rid in paused]
        ctx.initialize_attention_state()
        if step:
            n = ctx.active_token_count
            assert ctx.token_to_input_ids[:n].tolist() == \
                [t for rid in active for t in (pending[rid], drafts[rid])]
        for rid in active:
            pending[rid], drafts[rid] = 1000 * step + rid, 2000 * step + rid
        ctx.update_requests(torch.ones(len(active), dtype=torch.bool),
                            torch.tensor([pending[rid] for rid in active]),
                            torch.tensor([[drafts[rid] for rid in active]]))
        check_invariants(ctx)
        evicted += ctx.evicted_request_ids.tolist()
        assert set(ctx.host_request_ids().tolist()) == set(range(3)) - set(evicted)
    assert seen_paused and evicted


# ---------------------------------------------------------------------------- rewind
def test_rewind_lowers_offsets_and_releases_a_block_that_holds_nothing():
    k = 2
    ctx = make_ctx(num_speculative_tokens=k)
    add(ctx, request(1, 3))   # the next step's tokens at 3, 4, 5 cross into a new block
    add(ctx, request(2, 5))   # 5, 6, 7 stay in block 1
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([10, 20]),
                        torch.tensor([[11, 21], [12, 22]]))
    ids = ctx.host_request_ids().tolist()
    row1, row2 = ids.index(1), ids.index(2)
    new_block = int(ctx.block_table_host[row1, 1])
    avail = ctx.block_allocator.total_avail
    ctx.initialize_attention_state()
    with pytest.raises(ValueError, match=r"accepted_counts\[.\]=3 must lie in \[0, "
                                         r"num_speculative_tokens=2\]"):
        ctx.rewind_kv_cache(torch.tensor([3, 0]))
    with pytest.raises(StepShapeError, match="accepted_counts"):
        ctx.rewind_kv_cache(torch.tensor([0, 0, 0]))
    accepted = torch.zeros(2, dtype=torch.int64)
    accepted[row1], accepted[row2] = 0, 1
    released = ctx.rewind_kv_cache(accepted)
    assert released.tolist() == [new_block]
    assert ctx.block_allocator.total_avail == avail + 1
    assert ctx.request_kv_block_counts[row1].item() == 1
    assert ctx.block_table_host[row1, 1] == -1
    assert ctx.request_last_kv_block_id[row1].item() == ctx.block_table_host[row1, 0]
    assert ctx.request_last_kv_block_offset[row1].item() == 3   # the kept token 10 at 3
    # kv offset + query length = the tokens kept: prompt + 1 + accepted.
    lengths = ctx.get_active_sequence_lengths().tolist()
    assert lengths[row1] == 4 and lengths[row2] == 7
    check_invariants(ctx)
    with pytest.raises(RuntimeError, match="already"):
        ctx.rewind_kv_cache(accepted)
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([13, 23]),
                        torch.tensor([[14, 24], [15, 25]]))
    check_invariants(ctx)
    kv = dict(zip(ctx.host_request_ids().tolist(), ctx.request_kv_length_offsets[:2].tolist()))
    assert kv == {1: 4, 2: 7}
    with pytest.raises(RuntimeError, match="between initialize_attention_state"):
        ctx.rewind_kv_cache(accepted)


def test_rewind_ignores_prefill_rows_and_never_publishes_a_rolled_back_block():
    k = 3
    ctx = make_ctx(num_speculative_tokens=k, block_size_tokens=4, enable_prefix_caching=True)
    add(ctx, request(1, 6, gen=20))   # the step's tokens at 6..9 cross into a new block
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([5]),
                        torch.tensor([[6], [7], [8]]))
    add(ctx, request(2, 6))   # a prefill row in the same step
    ctx.initialize_attention_state()
    assert ctx.num_last_token_logits == 4 + 1
    assert ctx.speculative_required_logit_indices().tolist() == [0, 1, 2, 3, 9]
    published = set(ctx.prefix_cache.entries)
    dropped = int(ctx.block_table_host[0, 2])
    released = ctx.rewind_kv_cache(torch.tensor([0, -7]))   # the prefill's entry is ignored
    assert released.tolist() == [dropped]
    assert not ctx.block_allocator.cached[dropped]
    assert ctx.request_kv_length_offsets[1].item() == 0     # the prefill row is unchanged
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([9, 10]),
                        torch.zeros(3, 2, dtype=torch.int64))
    assert dropped not in {block for block, _, _ in ctx.prefix_cache.entries.values()}
    assert set(ctx.prefix_cache.entries) >= published
    check_invariants(ctx)


# ---------------------------------------------------------------------------- random runs
class _Model:
    """What the context must hold for one request: the tokens whose K/V are kept, the pending
    token and the drafts of its next step, its prompt left to add."""

    def __init__(self, rid, prompt, gen):
        self.rid, self.prompt, self.gen = rid, list(prompt), gen
        self.kept, self.pending, self.drafts = [], None, None
        self.generated = 0


def _kv_value(rid: int, position: int, token: int) -> float:
    return float(rid * 4096 + position * 8 + token % 8)


@pytest.mark.parametrize("k, block_size, blocks, paused, seed, host_views", [
    pytest.param(1, 4, 14, 3, 0, True, id="k1-bs4-tight"),
    pytest.param(2, 4, 18, 4, 1, False, id="k2-bs4-device-mirrors"),
    pytest.param(3, 4, 12, 2, 2, True, id="k3-bs4-tight"),
    pytest.param(3, 8, 16, 4, 3, False, id="k3-bs8-device-mirrors"),
])
def test_random_speculative_workload_keeps_every_invariant(k, block_size, blocks, paused, seed,
                                                           host_views):
    """Random admissions (some chunked), finishes and acceptance under memory pressure; after
    every call: invariants, the blocks each row holds (exactly what its next step needs, or
    what a paused row's kept tokens need), the step's ids and positions, the pending tokens and
    drafts of paused rows, and the K/V of every kept token. ``host_views=False`` runs the
    CUDA path's separate device mirrors on the CPU."""
    stats = _random_workload(k, block_size, blocks, paused, seed, host_views=host_views)[0]
    assert stats["steps"] > 20 and stats["rewound_blocks"] > 0, stats
    if blocks < 15:   # the tight budgets pause (or evict at once) requests
        assert stats["pauses"] + stats["evictions"] > 0, stats


@pytest.mark.interpreter
@needs_triton
def test_triton_path_gives_the_torch_path_steps():
    """The same random workload on ``kernel_backend="triton"`` (the interpreter on a CPU),
    its drafts and accepted counts handed in as strided views, step for step equal to the torch
    references' (token arrays, block tables, logit rows; each run checks its kept K/V): the
    kernels see the speculative rows."""
    device = torch.device("cuda" if torch.cuda.is_available()
                          and not backend.triton_interpreting() else "cpu")
    kw = dict(k=2, block_size=4, blocks=14, paused=3, seed=5, host_views=True, steps=8)
    _, torch_trace = _random_workload(**kw, kernel_backend="torch", device=device)
    _, triton_trace = _random_workload(**kw, kernel_backend="triton", device=device,
                                       strided=True)
    assert len(torch_trace) == len(triton_trace) > 5
    for a, b in zip(torch_trace, triton_trace):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def _strided(values: torch.Tensor) -> torch.Tensor:
    """``values`` as a non-contiguous view (every other element of a larger buffer)."""
    buffer = torch.full([2 * s for s in values.shape], -9, dtype=values.dtype,
                        device=values.device)
    view = buffer[tuple(slice(0, 2 * s, 2) for s in values.shape)]
    view.copy_(values)
    return view


def _random_workload(k, block_size, blocks, paused, seed, *, host_views, steps=60,
                     kernel_backend=None, device="cpu", strided=False):
    """The seeded workload of the random test; returns ``(stats, trace)``, the trace holding
    each step's token arrays, attention block table and logit rows."""
    rng = np.random.default_rng(seed)
    block_bytes = BLOCK * block_size // 4
    ctx = make_ctx(num_speculative_tokens=k, block_size_tokens=block_size,
                   buffer_size_gb=blocks * block_bytes / GIB,
                   paused_buffer_size_gb=paused * block_bytes / GIB, max_tokens=32,
                   kernel_backend=kernel_backend, device=device)
    # False: the device mirrors are separate buffers, as on CUDA (check_invariants compares).
    ctx._host_views = host_views
    on = ctx.device
    live, next_rid, chunked = {}, 0, None
    stats = dict(pauses=0, evictions=0, rewound_blocks=0, chunks=0, steps=0)
    trace = []
    for step in range(steps):
        # Admission: the chunked request continues first, then new requests while nothing is
        # paused (a whole prompt, or its first chunk).
        if chunked is not None:
            m = live[chunked.request_id]
            chunk = min(4, chunked.remaining_prompt_length)
            last = chunk == chunked.remaining_prompt_length
            if last:
                ctx.chunked_prefill_request_id = -1
            add(ctx, chunked, chunk_length=chunk)
            m.query = m.prompt[len(m.kept):len(m.kept) + chunk]
            stats["chunks"] += 1
            chunked = None if last else chunked
        while chunked is None and ctx.paused_request_count == 0 and (
                rng.random() < 0.5 or ctx.total_request_count == 0):
            length = int(rng.integers(1, 14))
            req = request(next_rid, length, gen=int(rng.integers(1, 20)))
            split = length > 6 and rng.random() < 0.5
            chunk = 4 if split else length
            if (ctx.total_request_count >= ctx.max_requests
                    or ctx.active_token_count + chunk > ctx.max_tokens
                    or not all(ctx.check_availability(req))):
                break
            m = live[next_rid] = _Model(next_rid, req.prompt_tokens.tolist(),
                                        req.sampling_params.num_tokens_to_generate)
            add(ctx, req, chunk_length=chunk)
            if split:
                ctx.chunked_prefill_request_id = next_rid
                chunked = req
            m.query = m.prompt[:chunk]
            next_rid += 1
        if ctx.get_active_request_count() == 0:
            break
        ctx.initialize_attention_state()
        stats["steps"] += 1
        P, T = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids().tolist()
        active = [live[rid] for rid in ids[P:T]]
        n = ctx.active_token_count
        tokens = ctx.token_to_input_ids[:n].tolist()
        positions = ctx.token_to_pos_ids[:n].tolist()
        blocks_of = ctx.token_to_block_idx[:n].tolist()
        table = ctx.block_table_host
        t = 0
        drafted = 0
        for row, m in zip(range(P, T), active):
            if m.pending is not None:      # a decode row: pending token, then its drafts
                query = [m.pending] + m.drafts
                drafted += 1
            else:
                query = m.query
            assert tokens[t:t + len(query)] == query, (step, m.rid)
            assert positions[t:t + len(query)] == list(range(len(m.kept),
                                                             len(m.kept) + len(query)))
            for j, pos in enumerate(positions[t:t + len(query)]):
                assert pos // block_size < ctx.kv_block_counts_host[row], (step, m.rid)
                assert blocks_of[t + j] == table[row, pos // block_size]
            m.step_query = query
            t += len(query)
        assert t == n
        assert ctx.num_last_token_logits == (drafted * (1 + k) + len(active) - drafted
                                             if not ctx.using_cuda_graph_this_step() else
                                             ctx.num_last_token_logits)
        # The forward pass: K/V of every token of the step.
        padded = ctx.padded_active_token_count
        key = torch.zeros(padded, 2, 8)
        for i, (pos, tok) in enumerate(zip(positions, tokens)):
            rid = ids[ctx.token_to_request_idx[i].item()]
            key[i] = _kv_value(rid, pos, tok)
        key = key.to(on)
        for layer in (1, 2):
            ctx.append_key_value_cache(layer, key, key + 0.5)
        trace.append({name: getattr(ctx, name)[:padded].cpu().clone() for name in (
            "token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
            "token_to_block_idx", "token_to_local_position_within_kv_block")})
        trace[-1]["block_table"] = ctx.active_attn_metadata.block_table.cpu().clone()
        trace[-1]["logit_rows"] = ctx.speculative_required_logit_indices().cpu().clone()
        # Verification: a random number of drafts accepted per decode row.
        accepted = np.full(len(active), -1)
        for i, m in enumerate(active):
            if m.pending is not None:
                accepted[i] = int(rng.integers(0, k + 1))
        avail = ctx.block_allocator.total_avail
        accepted_tensor = torch.from_numpy(accepted).to(on)
        released = ctx.rewind_kv_cache(_strided(accepted_tensor) if strided else accepted_tensor)
        assert ctx.block_allocator.total_avail == avail + released.numel()
        stats["rewound_blocks"] += released.numel()
        check_invariants(ctx)
        for i, m in enumerate(active):
            keep = m.step_query if m.pending is None else m.step_query[:1 + accepted[i]]
            m.kept += keep
        assert ctx.get_active_sequence_lengths().tolist() == [len(m.kept) for m in active]
        # Sampling and the mask.
        mask, new_tokens = [], []
        for m in active:
            prefilling = len(m.kept) < len(m.prompt)
            if not prefilling:
                m.generated += 1
            keep = prefilling or (m.generated < m.gen and len(m.kept) + 2 + k < 64
                                  and rng.random() > 0.05)
            mask.append(keep)
            new_tokens.append(int(rng.integers(0, 1000)))
        drafts = torch.from_numpy(rng.integers(0, 1000, size=(k, len(active))))
        old_paused = set(ids[:P])
        handed = drafts.to(on)
        ctx.update_requests(torch.tensor(mask, device=on), torch.tensor(new_tokens, device=on),
                            _strided(handed) if strided else handed)
        for i, m in enumerate(active):
            if not mask[i]:
                del live[m.rid]
            elif len(m.kept) < len(m.prompt):
                m.pending = None   # a chunked prefill: its sampled token is junk
            else:
                m.pending, m.drafts = new_tokens[i], drafts[:, i].tolist()
        for rid in ctx.evicted_request_ids.tolist():
            del live[rid]
            stats["evictions"] += 1
        check_invariants(ctx)
        P, T = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids().tolist()
        assert set(ids) == set(live)
        stats["pauses"] += len(set(ids[:P]) - old_paused)
        counts = ctx.kv_block_counts_host
        for row, rid in enumerate(ids):
            m = live[rid]
            if row >= P and m.pending is not None:
                # An active decode row holds the blocks of its next 1 + k tokens, no more.
                assert counts[row] == (len(m.kept) + k) // block_size + 1, (step, rid)
                assert ctx.request_query_lengths[row].item() == 1 + k
            else:
                assert counts[row] == -(-len(m.kept) // block_size), (step, rid)
        if P:
            assert ctx.paused_tokens.tolist() == [live[rid].pending for rid in ids[:P]]
            assert ctx.paused_speculative_tokens.T.tolist() == [live[rid].drafts
                                                                for rid in ids[:P]]
        # The K/V of every kept token is what its step wrote.
        cache = ctx.key_value_cache(1)[0].cpu()
        for row, rid in enumerate(ids):
            m = live[rid]
            for pos, tok in enumerate(m.kept):
                block = ctx.block_table_host[row, pos // block_size]
                assert cache[block, pos % block_size, 0, 0].item() == _kv_value(rid, pos, tok)
    return stats, trace


# ---------------------------------------------------------------------------- hybrids
def _hybrid(k: int, kernel_backend: str = "torch"):
    from test_hybrid import make_hybrid

    return make_hybrid(num_speculative_tokens=k, kernel_backend=kernel_backend)


def test_mamba_intermediate_states_have_one_plus_k_entries_per_slot():
    ctx = _hybrid(2)
    layer = ctx.layer_types.index("M") + 1
    conv, ssm = ctx.mamba_states_cache(layer)
    inter_conv, inter_ssm = ctx.mamba_states_cache(layer, intermediate=True)
    assert inter_conv.shape == (conv.shape[0], 3, *conv.shape[1:])
    assert inter_ssm.shape == (ssm.shape[0], 3, *ssm.shape[1:])
    with pytest.raises(ValueError, match="num_speculative_tokens > 0"):
        _hybrid(0).mamba_states_cache(layer, intermediate=True)


def _rewind_restores(kernel_backend: str) -> None:
    k = 2
    ctx = _hybrid(k, kernel_backend)
    layer = ctx.layer_types.index("M") + 1
    add(ctx, request(1, 5))
    add(ctx, request(2, 3))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([10, 20]),
                        torch.zeros(k, 2, dtype=torch.int64))
    add(ctx, request(3, 4))   # a prefill row: its state is not rewound
    ctx.initialize_attention_state()
    conv, ssm = ctx.mamba_states_cache(layer)
    inter_conv, inter_ssm = ctx.mamba_states_cache(layer, intermediate=True)
    # The forward pass: every slot's state and intermediate states take distinct values.
    conv.copy_(torch.arange(conv.numel(), dtype=conv.dtype).view(conv.shape))
    ssm.copy_(-torch.arange(ssm.numel(), dtype=ssm.dtype).view(ssm.shape))
    inter_conv.copy_(1000 + torch.arange(inter_conv.numel(), dtype=conv.dtype)
                     .view(inter_conv.shape))
    inter_ssm.copy_(-1000 - torch.arange(inter_ssm.numel(), dtype=ssm.dtype)
                    .view(inter_ssm.shape))
    before_conv, before_ssm = conv.clone(), ssm.clone()
    slots = ctx.mamba_metadata.request_to_mamba_state_idx[:3].tolist()
    accepted = [2, 0, -1]
    ctx.rewind_kv_cache(torch.tensor(accepted))
    for row, slot in enumerate(slots):
        if row < 2:
            assert torch.equal(conv[slot], inter_conv[slot, accepted[row]])
            assert torch.equal(ssm[slot], inter_ssm[slot, accepted[row]])
        else:
            assert torch.equal(conv[slot], before_conv[slot])
            assert torch.equal(ssm[slot], before_ssm[slot])
    others = [s for s in range(conv.shape[0]) if s not in slots]
    assert torch.equal(conv[others], before_conv[others])
    assert torch.equal(ssm[others], before_ssm[others])
    check_invariants(ctx)


def test_hybrid_rewind_restores_the_state_at_the_accepted_token():
    _rewind_restores("torch")


@pytest.mark.interpreter
@needs_triton
def test_hybrid_rewind_restores_the_state_on_the_triton_path():
    _rewind_restores("triton")
