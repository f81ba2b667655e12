"""Megatron-Core 0.19's step API beyond its own ported tests (context/step_api.py,
context/async_steps.py): the async-scheduling trio leaves each request where
``update_requests`` does, and the next step built from it forwards the same tokens; the prefill
flags and the logit rows follow the step; the bookkeeping transfer's event protocol."""

from __future__ import annotations

import pytest
import torch
from helpers import add, check_invariants, make_ctx, request

from dynctx.context import InferenceBatchDimensions


def _per_request(ctx) -> dict:
    """request id -> (KV offset, query length, block count, its step tokens and positions)."""
    paused, total = ctx.paused_request_count, ctx.total_request_count
    ids = ctx.request_ids[paused:total].tolist()
    start = 0
    out = {}
    for row, rid in zip(range(paused, total), ids):
        q = int(ctx.request_query_lengths[row])
        tokens = ctx.token_to_input_ids[start:start + q].tolist()
        positions = ctx.token_to_pos_ids[start:start + q].tolist()
        blocks = ctx.token_to_block_idx[start:start + q].tolist()
        table = ctx.request_to_kv_block_ids[row]
        # Each token sits in the block its position says, in both layouts.
        assert blocks == [int(table[p // ctx.block_size_tokens]) for p in positions]
        out[rid] = (int(ctx.request_kv_length_offsets[row]), q,
                    int(ctx.request_kv_block_counts[row]), tokens, positions)
        start += q
    return out


@pytest.mark.parametrize("k", [0, 2])
def test_trio_leaves_every_request_where_update_requests_does(k):
    """Five steps, requests finishing and crossing block boundaries: resolve + prepare +
    commit, then a step, equals update_requests, then a step, per request (the rows' order
    may differ: update_requests pauses and resumes a row that needs a block, prepare does
    not; the tokens and finishes are per request id)."""
    sync, trio = make_ctx(num_speculative_tokens=k), make_ctx(num_speculative_tokens=k)
    for ctx in (sync, trio):
        for rid, length in ((1, 3), (2, 5), (3, 2), (4, 7)):
            add(ctx, request(rid, length))
        ctx.initialize_attention_state()
    finish = {2: 1, 3: 4}

    def sampled(ctx, step):
        ids = ctx.request_ids[:ctx.total_request_count].long()
        mask = (ids != finish.get(step, 0)).to(torch.int32)
        tokens = ids * 10 + step
        drafts = torch.stack([ids * 100 + j for j in range(k)]) if k else None
        return mask, tokens, drafts

    for step in range(5):
        assert sync.paused_request_count == 0
        sync.update_requests(*sampled(sync, step))
        sync.initialize_attention_state()
        mask, tokens, drafts = sampled(trio, step)
        _, survivors = trio.resolve_requests(mask)
        assert trio.can_prepare_requests()
        trio.prepare_requests()
        trio.commit_sampled_tokens(tokens[survivors],
                                   None if drafts is None else drafts[:, survivors])
        trio.initialize_attention_state()
        assert _per_request(trio) == _per_request(sync)
        assert trio.active_token_count == sync.active_token_count
        check_invariants(trio)
        assert trio.block_allocator.total_avail == sync.block_allocator.total_avail


def test_prepared_token_arrays_are_those_the_step_builds():
    """prepare_requests writes 0.19's token arrays (but the input ids); the step built after
    commit_sampled_tokens writes the same, and the sampled tokens as input ids."""
    ctx = make_ctx(num_speculative_tokens=1)
    for rid, length in ((1, 2), (2, 3)):  # the second crosses into its second block
        add(ctx, request(rid, length))
    ctx.initialize_attention_state()
    ctx.resolve_requests(torch.ones(2, dtype=torch.int32))
    ctx.prepare_requests()
    n = ctx.active_token_count
    names = ("token_to_pos_ids", "token_to_request_idx", "token_to_block_idx",
             "token_to_position_in_request", "token_to_local_position_within_kv_block")
    prepared = {name: getattr(ctx, name)[:n].clone() for name in names}
    ctx.commit_sampled_tokens(torch.tensor([41, 42]), torch.tensor([[51, 52]]))
    assert ctx.token_to_input_ids[:n].tolist() == [41, 51, 42, 52]
    ctx.initialize_attention_state()
    for name in names:
        assert torch.equal(getattr(ctx, name)[:n], prepared[name]), name
    assert ctx.token_to_input_ids[:n].tolist() == [41, 51, 42, 52]


def test_prepare_refusals_change_nothing():
    """No block for a row that needs one (the active budget spent, or no free block):
    RuntimeError, the rows and the allocator as they were."""
    ctx = make_ctx()
    add(ctx, request(1, 4))  # its next token starts its second block
    ctx.initialize_attention_state()
    ctx.resolve_requests(torch.ones(1, dtype=torch.int32))
    allocator = ctx.kv_block_allocator
    budget, avail = allocator.active_count, allocator.total_avail
    rows, table = ctx._h_req.copy(), ctx.block_table_host.copy()
    allocator.active_count = allocator.get_active_used()
    assert not ctx.can_prepare_requests()
    with pytest.raises(RuntimeError, match="cannot pause requests"):
        ctx.prepare_requests()
    allocator.active_count, allocator.total_avail = budget, 0
    with pytest.raises(RuntimeError, match="cannot evict requests"):
        ctx.prepare_requests()
    assert (ctx._h_req == rows).all() and (ctx.block_table_host == table).all()
    allocator.total_avail = avail
    ctx.prepare_requests()
    assert ctx.request_kv_block_counts[0] == 2 and allocator.total_avail == avail - 1
    check_invariants(ctx)


def test_prefill_flags_follow_the_rows():
    ctx = make_ctx()
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(1, dtype=torch.int32), torch.tensor([5]))
    add(ctx, request(2, 4))
    flags = ctx.request_in_prefill_status_tensor
    assert flags.dtype == torch.int32 and flags.tolist() == [0, 1] + [-1] * 6


@pytest.mark.parametrize("k", [0, 2])
def test_active_logit_idxs_keep_their_address_and_zero_their_tail(k):
    ctx = make_ctx(num_speculative_tokens=k)
    for rid, length in ((1, 3), (2, 5), (3, 4)):
        add(ctx, request(rid, length))
    ctx.initialize_attention_state()
    first = ctx.active_logit_idxs
    assert first[:3].tolist() == [2, 7, 11] and int(first[3:].abs().sum()) == 0
    drafts = torch.zeros(k, 3, dtype=torch.int64) if k else None
    ctx.update_requests(torch.tensor([1, 0, 1]), torch.tensor([4, 5, 6]), drafts)
    ctx.initialize_attention_state()
    again = ctx.active_logit_idxs
    assert again.data_ptr() == first.data_ptr()
    assert again[:2 * (1 + k)].tolist() == list(range(2 * (1 + k)))
    assert int(again[2 * (1 + k):].abs().sum()) == 0
    if k:
        assert ctx.speculative_required_logit_indices().data_ptr() == again.data_ptr()


@pytest.mark.parametrize("record", [False, True])
def test_initialize_attention_state_returns_the_transfer_event(record):
    ctx = make_ctx()
    add(ctx, request(1, 3))
    event = ctx.initialize_attention_state(record_bookkeeping_done_event=record)
    assert (event is not None) == record
    if record:
        event.synchronize()
        assert event.query()
    assert ctx.initialize_attention_state(transfer_bookkeeping_to_gpu=False) is None


def test_expert_parallel_dummy_step_is_one_decode_request_of_1_plus_k_tokens():
    ctx = make_ctx(num_speculative_tokens=2)
    assert ctx.num_speculative_tokens == 2  # the keyword form's attribute (it read 0)
    ctx.initialize_attention_state(is_expert_parallel_dummy_cuda_graph_step=True)
    assert ctx.batch_dimensions == InferenceBatchDimensions(3, 0, 1)


def test_reset_tensors_on_an_empty_context_resets_the_token_arrays():
    ctx = make_ctx()
    ctx.token_to_request_idx[:4] = 3
    ctx.reset_tensors()
    assert ctx.token_to_request_idx[:4].tolist() == [-1] * 4
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    assert ctx.token_to_request_idx[:3].tolist() == [0, 0, 0]


def test_context_gpu_view_is_one_buffer_of_views():
    from dynctx.context import ContextGPUView

    view = ContextGPUView(max_requests=3, max_tokens=5, max_kv_blocks=2,
                          device=torch.device("cpu"), max_mamba_chunks=2)
    fields = [value for value in vars(view).values()
              if isinstance(value, torch.Tensor) and value is not view._buf]
    base = view._buf.data_ptr()
    spans = sorted((t.data_ptr() - base, t.numel() * t.element_size()) for t in fields)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # disjoint, in order
    assert spans[-1][0] + spans[-1][1] == view._buf.numel()
    assert view.mamba_batch_indices_decode.data_ptr() % 8 == 0
    view.token_to_pos_ids[:] = 7
    assert view._buf[40:48].tolist() == [7, 0, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="max_tokens=0"):
        ContextGPUView(max_requests=3, max_tokens=0, max_kv_blocks=2, device="cpu")
    with pytest.raises(TypeError, match="max_requests"):
        ContextGPUView(max_requests=3.0, max_tokens=5, max_kv_blocks=2, device="cpu")


def test_ctx_gpu_view_names_the_step_arrays_and_the_views_are_cut_once():
    ctx = make_ctx()
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    assert ctx.gpu_view.token_to_input_ids is ctx.token_to_input_ids
    assert ctx.gpu_view.token_to_request_idx is ctx.token_to_request_idx
    with pytest.raises(AttributeError, match="temperature"):
        ctx.gpu_view.temperature
    first = ctx.current_input_and_position_ids()
    assert ctx.current_input_and_position_ids()[0] is first[0]
    ctx.deallocate_all_tensors()
    ctx.allocate_all_tensors(is_init=False)
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    again = ctx.current_input_and_position_ids()
    assert again[0] is not first[0] and again[0][0, :3].tolist() == [101, 102, 103]


def test_a_resolved_prefill_shares_its_blocks_and_a_hybrid_snapshots_its_boundary():
    """With prefix caching the prompt's blocks are shared from its add on, and the resolve
    snapshots a hybrid's state where its computed tokens end on a block boundary, as the update
    does: a later request of the same prompt skips to it."""
    from test_prefix_cache import hybrid_ctx

    per_request = 4 * (6 * 4 + 2 * 3 * 5)
    ctx = hybrid_ctx(prefix_caching_mamba_gb=2 * per_request / 1024 ** 3)
    prompt = list(range(20, 28))          # two full blocks of 4
    first = request(1, 8)
    first.prompt_tokens = first.remaining_prompt_tokens = torch.tensor(prompt)
    add(ctx, first)
    ctx.initialize_attention_state()
    conv, ssm = ctx.mamba_states_cache(1)
    slot = int(ctx.mamba_metadata.request_to_mamba_state_idx[0])
    conv[slot].fill_(3.0)                 # "the forward": the state after 8 tokens
    ssm[slot].fill_(4.0)
    ctx.resolve_requests(torch.ones(1, dtype=torch.int32))
    snaps = ctx.prefix_cache.mamba
    assert len(snaps.index) == 1
    index = next(iter(snaps.index.values()))
    assert (snaps.conv[:, index] == 3.0).all() and (snaps.ssm[:, index] == 4.0).all()
    second = request(2, 9)
    second.prompt_tokens = second.remaining_prompt_tokens = torch.tensor(prompt + [5])
    assert ctx.prefix_cache_lookup(second) == 8
