"""``rewind_tokens`` (docs/SEMANTICS.md §19, "Token rewind"): a row's last ``n`` tokens dropped
across the steps and blocks that cached them, in ``k = 0`` and speculative contexts.

The cases: a rewind across several blocks and steps (offsets, blocks released in row order,
the next steps write where the rewind left), the refusals (each leaves the context as it was:
the full snapshot of ``helpers.snapshot``), and seeded random workloads (admissions, chunked
prefills, memory pressure with pauses and evictions, prefix caching, separate device mirrors)
in which every step rewinds random rows by random counts and then samples new tokens for
them. After every call the context is checked against a model of each request's kept tokens:
its lengths and blocks, the blocks each rewind released, the step's ids and positions, and the
K/V of every kept token, which must be what a from-scratch prefill of the request's kept
tokens writes (the K/V pattern is a function of the tokens up to the position); at the end a
fresh context prefills every live request's kept tokens in one step and its K/V are compared
with the rewound context's, token by token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, assert_same, check_invariants, make_ctx, request, snapshot

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.context.errors import StepShapeError


def _value(tokens, position: int) -> float:
    """The K/V a token writes: a function of the tokens up to ``position`` (so that requests
    sharing a prefix share its values, and a rewritten position shows), exact in fp32."""
    h = 7
    for token in tokens[:position + 1]:
        h = (h * 31 + int(token) + 1) % 1000003
    return float(h)


def _write_kv(ctx, tokens_of_row):
    """The forward pass's K/V: every token of the step gets ``_value`` of its row's tokens
    (``tokens_of_row(row)``: the row's tokens up to and including the step's)."""
    n, padded = ctx.active_token_count, ctx.padded_active_token_count
    rows = ctx.token_to_request_idx[:n].tolist()
    positions = ctx.token_to_pos_ids[:n].tolist()
    key = torch.zeros(padded, 2, 8)
    for i, (row, pos) in enumerate(zip(rows, positions)):
        key[i] = _value(tokens_of_row(row), pos)
    key = key.to(ctx.device)
    for layer in (1, 2):
        ctx.append_key_value_cache(layer, key, key + 0.5)


def _kv_of(ctx, row: int, length: int) -> list:
    cache = ctx.key_value_cache(1)[0].cpu()
    bs = ctx.block_size_tokens
    return [cache[int(ctx.block_table_host[row, p // bs]), p % bs, 0, 0].item()
            for p in range(length)]


def _decode(ctx, steps: int, token: int = 9):
    """``steps`` steps (K/V of ones), every active request kept with ``token``."""
    for _ in range(steps):
        ctx.initialize_attention_state()
        ones = torch.ones(ctx.padded_active_token_count, 2, 8)
        for layer in (1, 2):
            ctx.append_key_value_cache(layer, ones, ones)
        n = ctx.total_request_count - ctx.paused_request_count
        ctx.update_requests(torch.ones(n, dtype=torch.bool), torch.full((n,), token))


# ---------------------------------------------------------------------------- by hand
def test_a_rewind_spans_steps_and_blocks_and_the_next_steps_write_where_it_left():
    ctx = make_ctx()   # block size 4, k = 0
    prompts = {1: [101, 102, 103], 2: [201, 202, 203, 204, 205, 206]}
    seqs = {rid: list(p) for rid, p in prompts.items()}
    for rid, prompt in prompts.items():
        add(ctx, DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(prompt),
                                         sampling_params=SamplingParams(
                                             num_tokens_to_generate=30)))

    def one_step(new, rewind=None):
        ctx.initialize_attention_state()
        ids = ctx.host_request_ids()[:ctx.total_request_count].tolist()
        _write_kv(ctx, lambda row: seqs[ids[row]])
        released = None
        if rewind is not None:
            released = ctx.rewind_tokens(torch.tensor([rewind[rid] for rid in ids]))
            for rid in ids:
                del seqs[rid][len(seqs[rid]) - rewind[rid]:]
        ctx.update_requests(torch.ones(len(ids), dtype=torch.bool),
                            torch.tensor([new[rid] for rid in ids]))
        for rid in ids:
            seqs[rid].append(new[rid])
        return ids, released

    for t in range(8):   # request 1 reaches 11 tokens (3 blocks), request 2 14 (4 blocks)
        one_step({1: 10 + t, 2: 20 + t})
    ids = ctx.host_request_ids()[:2].tolist()
    row1, row2 = ids.index(1), ids.index(2)
    held = {rid: ctx.block_table_host[ids.index(rid), :ctx.kv_block_counts_host[ids.index(rid)]]
            .tolist() for rid in (1, 2)}
    assert [len(held[1]), len(held[2])] == [3, 4]
    avail = ctx.block_allocator.total_avail
    # The step forwards each pending token (request 1's 11th token, request 2's 14th): request
    # 1 drops 6 (this step's and 5 before: 5 tokens kept, its third block goes), request 2
    # drops 10 (4 kept: its last three blocks go, and its next token starts a new block).
    ids, released = one_step({1: 50, 2: 60}, rewind={1: 6, 2: 10})
    by_row = {row1: held[1][2:], row2: held[2][1:]}
    assert released.tolist() == by_row[min(by_row)] + by_row[max(by_row)]
    assert ctx.block_allocator.total_avail == avail + 4 - 1   # request 2 took a new block
    check_invariants(ctx)
    counts = ctx.kv_block_counts_host
    assert (counts[row1], counts[row2]) == (2, 2)
    assert ctx.block_table_host[row1, 2] == -1 and ctx.block_table_host[row2, 2] == -1
    assert ctx.request_kv_length_offsets[row1].item() == 5
    assert ctx.request_kv_length_offsets[row2].item() == 4
    assert ctx.request_last_kv_block_offset[row1].item() == 5 % 4
    assert ctx.request_last_kv_block_offset[row2].item() == 0
    # Three more steps: the K/V are those of a prefill of each request's tokens.
    for t in range(3):
        one_step({1: 70 + t, 2: 80 + t})
    check_invariants(ctx)
    ids = ctx.host_request_ids()[:2].tolist()
    for rid in (1, 2):
        row = ids.index(rid)
        kept = seqs[rid][:-1]
        assert ctx.request_kv_length_offsets[row].item() == len(kept)
        assert _kv_of(ctx, row, len(kept)) == [_value(kept, p) for p in range(len(kept))]


def test_rewinding_nothing_changes_nothing_and_a_speculative_context_rewinds_too():
    ctx = make_ctx()
    add(ctx, request(1, 5))
    _decode(ctx, 0)
    ctx.initialize_attention_state()
    before = snapshot(ctx, device=True)
    assert ctx.rewind_tokens([0]).tolist() == []
    assert_same(before, snapshot(ctx, device=True))
    # k = 2: the step's drafts first (rewind_kv_cache), then tokens of earlier steps.
    ctx = make_ctx(num_speculative_tokens=2)
    add(ctx, request(1, 6))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([7]),
                        torch.tensor([[8], [9]]))
    ctx.initialize_attention_state()    # tokens 6, 7, 8 at positions 6..8
    ctx.rewind_kv_cache(torch.tensor([1]))   # keeps 6 and 7: 8 tokens
    released = ctx.rewind_tokens(torch.tensor([5]))   # 3 tokens kept: block 1 goes
    assert released.numel() == 1
    assert ctx.get_active_sequence_lengths().tolist() == [3]
    check_invariants(ctx)
    ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([5]),
                        torch.tensor([[1], [2]]))
    check_invariants(ctx)
    assert ctx.request_kv_length_offsets[0].item() == 3
    assert ctx.kv_block_counts_host[0] == 2     # its next 1 + k tokens (3..5) cross a block


def _published_state():
    """Prefix caching: request 1's two full prompt blocks published, request 2 shares them and
    has decoded a few tokens; the step is initialized."""
    ctx = make_ctx(enable_prefix_caching=True)
    prompt = list(range(300, 309))
    for rid in (1, 2):
        add(ctx, DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(prompt),
                                         sampling_params=SamplingParams(
                                             num_tokens_to_generate=20)))
    _decode(ctx, 3)
    ctx.initialize_attention_state()
    return ctx


@pytest.mark.parametrize("call, error, match", [
    pytest.param(lambda c: c.rewind_tokens(torch.tensor([1])), StepShapeError,
                 r"rewind_counts has shape \(1,\), expected \[active requests=2\]", id="shape"),
    pytest.param(lambda c: c.rewind_tokens(torch.tensor([1.0, 0.0])), TypeError,
                 "rewind_counts must be an integer tensor", id="float"),
    pytest.param(lambda c: c.rewind_tokens(np.array([0.5, 0.0])), TypeError,
                 "rewind_counts must hold integers", id="float-numpy"),
    pytest.param(lambda c: c.rewind_tokens([-1, 0]), ValueError,
                 r"rewind_counts\[0\]=-1 must lie in \[0, 11\]", id="negative"),
    pytest.param(lambda c: c.rewind_tokens([0, 12]), ValueError,
                 r"rewind_counts\[1\]=12 must lie in \[0, 11\] \(request 2 holds 12 tokens, "
                 r"at least one stays\)", id="every-token"),
    pytest.param(lambda c: c.rewind_tokens([2, 5]), ValueError,
                 r"request 2 would rewind into block \d+, which the prefix cache published",
                 id="published-block"),
])
def test_refusals_leave_the_context_as_it_was(call, error, match):
    ctx = _published_state()
    before = snapshot(ctx, device=True)
    with pytest.raises(error, match=match):
        call(ctx)
    assert_same(before, snapshot(ctx, device=True))
    # The legal part still works: tokens past the shared blocks go.
    assert ctx.rewind_tokens([2, 3]).numel() == 0
    check_invariants(ctx)


def test_refused_outside_a_step_for_the_chunked_prefill_and_on_hybrids():
    ctx = make_ctx()
    add(ctx, request(1, 5))
    with pytest.raises(RuntimeError, match="between initialize_attention_state"):
        ctx.rewind_tokens([0])
    req = request(2, 10)
    add(ctx, req, chunk_length=4)
    ctx.chunked_prefill_request_id = 2
    ctx.initialize_attention_state()
    before = snapshot(ctx, device=True)
    with pytest.raises(ValueError, match="request 2 is the chunked prefill in flight"):
        ctx.rewind_tokens([0, 1])
    assert_same(before, snapshot(ctx, device=True))
    assert ctx.rewind_tokens([1, 0]).numel() == 1   # 4 of 5 tokens kept: block 1 goes
    from test_hybrid import make_hybrid

    hybrid = make_hybrid()
    add(hybrid, request(1, 5))
    hybrid.initialize_attention_state()
    with pytest.raises(ValueError, match="on a hybrid"):
        hybrid.rewind_tokens([1])


# ---------------------------------------------------------------------------- random runs
class _Row:
    """A request as the context must hold it: ``kept`` the tokens whose K/V are cached,
    ``pending`` its next token (None while its prompt is being added), ``prompt`` the prompt
    left to add, ``published`` the prefix of ``kept`` a rewind must not reach."""

    def __init__(self, rid, prompt, gen):
        self.rid, self.prompt, self.gen = rid, list(prompt), gen
        self.added = 0
        self.kept, self.pending, self.query = [], None, []
        self.generated, self.published = 0, 0


def _random_workload(seed, *, k=0, blocks=16, paused=4, block_size=4, steps=70,
                     host_views=True, caching=False):
    rng = np.random.default_rng(seed)
    bs = block_size
    block_bytes = BLOCK * bs // 4
    ctx = make_ctx(block_size_tokens=bs, buffer_size_gb=blocks * block_bytes / GIB,
                   paused_buffer_size_gb=paused * block_bytes / GIB, max_tokens=24,
                   max_sequence_length=64, enable_prefix_caching=caching,
                   num_speculative_tokens=k)
    ctx._host_views = host_views   # False: separate device mirrors, as on CUDA
    live, queue, chunked, next_rid = {}, [], None, 0
    stats = dict(rewinds=0, rewound_tokens=0, released=0, multi_block=0, pauses=0, evictions=0,
                 chunks=0, refused=0)
    families = [rng.integers(0, 50, size=20).tolist() for _ in range(2)]

    def prompt_of():
        base = families[int(rng.integers(0, 2))] if caching else []
        tail = rng.integers(0, 50, size=int(rng.integers(1, 9))).tolist()
        return base[:int(rng.integers(0, 13))] + tail

    for _ in range(steps):
        # Admission: the chunked prefill continues first; then re-queued and new requests,
        # whole or (when longer than 6) a first chunk of 4.
        if chunked is not None:
            m, req = chunked
            chunk = min(4, req.remaining_prompt_length)
            if chunk == req.remaining_prompt_length:
                ctx.chunked_prefill_request_id = -1
                chunked = None
            add(ctx, req, chunk_length=chunk)
            m.query = m.prompt[m.added:m.added + chunk]
            m.added += chunk
            stats["chunks"] += 1
        while chunked is None and ctx.paused_request_count == 0 and len(live) < 6 and (
                queue or rng.random() < 0.5 or not live):
            if queue:
                m = queue[0]
            else:
                m = _Row(next_rid, prompt_of(), int(rng.integers(4, 30)))
            req = DynamicInferenceRequest(request_id=m.rid, prompt_tokens=torch.tensor(m.prompt),
                                          sampling_params=SamplingParams(
                                              num_tokens_to_generate=m.gen))
            split = len(m.prompt) > 6 and rng.random() < 0.5
            chunk = 4 if split else len(m.prompt)
            if ctx.active_token_count + chunk > ctx.max_tokens or \
                    not all(ctx.check_availability(req)):
                break
            if queue:
                queue.pop(0)
            else:
                next_rid += 1
            add(ctx, req, chunk_length=chunk if split else None)
            if split:
                ctx.chunked_prefill_request_id = m.rid
                chunked = (m, req)
            skipped = int(ctx.request_kv_length_offsets[ctx.total_request_count - 1].item())
            m.kept, m.query, m.added = m.prompt[:skipped], m.prompt[skipped:chunk], chunk
            # Prefix caching publishes the full prompt blocks: a rewind stops short of them.
            m.published = len(m.prompt) // bs * bs if caching else 0
            live[m.rid] = m
        if ctx.get_active_request_count() == 0:
            break
        ctx.initialize_attention_state()
        P, T = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids().tolist()
        active = [live[rid] for rid in ids[P:T]]
        n = ctx.active_token_count
        tokens, positions = ctx.token_to_input_ids[:n].tolist(), ctx.token_to_pos_ids[:n].tolist()
        at = 0
        for m in active:
            query = m.query if m.pending is None else [m.pending] + m.drafts
            assert tokens[at:at + len(query)] == query, m.rid
            assert positions[at:at + len(query)] == list(range(len(m.kept),
                                                              len(m.kept) + len(query)))
            m.step = m.kept + query
            at += len(query)
        assert at == n
        _write_kv(ctx, lambda row: live[ids[row]].step)
        if k:
            # Speculative rows: some drafts accepted first (rewind_kv_cache).
            accepted = [int(rng.integers(0, k + 1)) if m.pending is not None else 0
                        for m in active]
            ctx.rewind_kv_cache(torch.tensor(accepted))
            for m, a in zip(active, accepted):
                if m.pending is not None:
                    m.step = m.step[:len(m.kept) + 1 + a]
        # The rewind: random rows drop random counts (often past this step's tokens and across
        # blocks), never into a published block, never the chunked prefill; sometimes a rewind
        # that reaches a published block, refused with nothing changed.
        counts = []
        for m in active:
            most = len(m.step) - max(1, m.published)
            chunking = chunked is not None and m is chunked[0]
            draw = rng.random()
            counts.append(0 if chunking or most <= 0 or draw < 0.55 else
                          int(rng.integers(1, min(3, most) + 1)) if draw < 0.93 else
                          int(rng.integers(1, most + 1)))
        reachable = [i for i, m in enumerate(active) if m.published and
                     not (chunked is not None and m is chunked[0]) and len(m.step) > m.published]
        if reachable and rng.random() < 0.2:
            bad = list(counts)
            bad[reachable[0]] = len(active[reachable[0]].step) - 1
            row = P + reachable[0]
            block = int(ctx.block_table_host[row, 0])
            if ctx.block_allocator.cached[block] or ctx.block_allocator.ref_counts[block] > 1:
                before = snapshot(ctx, device=True)
                with pytest.raises(ValueError, match="prefix cache published or another"):
                    ctx.rewind_tokens(bad)
                assert_same(before, snapshot(ctx, device=True))
                stats["refused"] += 1
        counts_table = ctx.kv_block_counts_host
        held = [ctx.block_table_host[P + i, :counts_table[P + i]].tolist()
                for i in range(len(active))]
        avail = ctx.block_allocator.total_avail
        released = ctx.rewind_tokens(torch.tensor(counts)).tolist()
        expected = []
        for m, c, blocks in zip(active, counts, held):
            m.step = m.step[:len(m.step) - c]
            expected += blocks[-(-len(m.step) // bs):]
            stats["multi_block"] += len(blocks[-(-len(m.step) // bs):]) > 1
        assert released == expected
        assert ctx.block_allocator.total_avail == avail + len(released)
        assert ctx.get_active_sequence_lengths().tolist() == [len(m.step) for m in active]
        stats["rewinds"] += sum(c > 0 for c in counts)
        stats["rewound_tokens"] += sum(counts)
        stats["released"] += len(released)
        check_invariants(ctx)
        # The update: random finishes, new tokens (and drafts) for the rows that go on.
        mask, new = [], []
        for m in active:
            m.kept = m.step
            prefilling = m.added < len(m.prompt)
            keep = prefilling or (len(m.kept) + 2 + k < 64 and rng.random() > 0.05)
            mask.append(keep)
            new.append(int(rng.integers(0, 50)))
        drafts = torch.from_numpy(rng.integers(0, 50, size=(k, len(active))))
        old_paused = set(ids[:P])
        ctx.update_requests(torch.tensor(mask), torch.tensor(new), drafts if k else None)
        for m, keep, token, i in zip(active, mask, new, range(len(active))):
            if not keep:
                del live[m.rid]
            elif m.added < len(m.prompt):
                m.pending = None
            else:
                m.pending, m.drafts = token, drafts[:, i].tolist()
        for rid in ctx.evicted_request_ids.tolist():
            # Recompute: the kept tokens and the pending one are the new prompt.
            m = live.pop(rid)
            m.prompt, m.added = m.kept + [m.pending], 0
            m.kept, m.pending, m.drafts = [], None, []
            queue.append(m)
            stats["evictions"] += 1
        check_invariants(ctx)
        ids = ctx.host_request_ids().tolist()
        P = ctx.paused_request_count
        assert set(ids) == set(live)
        stats["pauses"] += len(set(ids[:P]) - old_paused)
        for row, rid in enumerate(ids):
            m = live[rid]
            need = len(m.kept) + (1 + k if row >= P and m.pending is not None else 0)
            assert ctx.kv_block_counts_host[row] == -(-need // bs), (rid, need)
            # The K/V of every kept token: what a prefill of the kept tokens writes.
            assert _kv_of(ctx, row, len(m.kept)) == [_value(m.kept, p)
                                                      for p in range(len(m.kept))], rid
    # From scratch: a fresh context prefills every live request's kept tokens; its K/V equal.
    fresh = make_ctx(block_size_tokens=bs, max_tokens=512, max_requests=8,
                     buffer_size_gb=100 * block_bytes / GIB)
    ids = ctx.host_request_ids().tolist()
    for rid in ids:
        if live[rid].kept:
            add(fresh, DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.tensor(
                live[rid].kept), sampling_params=SamplingParams(num_tokens_to_generate=1)))
    fresh.initialize_attention_state()
    fresh_ids = fresh.host_request_ids()[:fresh.total_request_count].tolist()
    _write_kv(fresh, lambda row: live[fresh_ids[row]].kept)
    for row, rid in enumerate(fresh_ids):
        length = len(live[rid].kept)
        assert _kv_of(fresh, row, length) == _kv_of(ctx, ids.index(rid), length), rid
    return stats


@pytest.mark.parametrize("seed, options", [
    pytest.param(0, dict(), id="k0"),
    pytest.param(1, dict(blocks=10, paused=1), id="k0-tight"),
    pytest.param(2, dict(host_views=False, blocks=12), id="k0-device-mirrors"),
    pytest.param(3, dict(caching=True, blocks=20), id="k0-prefix-caching"),
    pytest.param(4, dict(k=2, blocks=14, paused=3), id="k2"),
])
def test_random_rewinds_keep_what_a_prefill_of_the_kept_tokens_writes(seed, options):
    stats = _random_workload(seed, **options)
    assert stats["rewinds"] > 50 and stats["released"] > 30, stats
    if options.get("caching"):
        assert stats["refused"] > 0, stats
    if options.get("blocks", 16) < 16:
        # Memory pressure: pauses, evictions (re-added with their kept tokens), and rewinds
        # that release several blocks of a row at once.
        assert stats["pauses"] > 0 and stats["evictions"] > 0, stats
        assert stats["multi_block"] > 0, stats
