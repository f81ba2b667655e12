"""DynamicInferenceContext: construction, admission, the update state machine, suspend/resume,
and bad input (which must raise and leave the context exactly as it was)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import (  # tests/context is on sys.path under pytest (rootdir conftest)
    BLOCK,
    GIB,
    add,
    assert_same,
    check_invariants,
    make_ctx,
    request,
    snapshot,
    step,
)

from dynctx.context import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextErrorFactory,
    ContextOverflowError,
    DynamicInferenceContext,
    DynamicInferenceRequest,
    InferenceBatchDimensions,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TensorStateDeallocatedError,
    TokenOverflowError,
    get_mem_size_str,
)


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("layers,kv,heads,block,gb,total,paused,active", [
    pytest.param(4, 8, 2, 128, 0.03, 491, 98, 392, id="4layers-0.03GB"),
    pytest.param(2, 64, 8, 128, 1.0, 1024, 204, 819, id="2layers-1GB"),
])
def test_block_counts_match_reference_examples(layers, kv, heads, block, gb, total, paused, active):
    ctx = DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=layers, kv_channels=kv, num_attention_heads=heads,
        max_sequence_length=512, buffer_size_gb=gb, paused_buffer_size_gb=0.2 * gb,
        block_size_tokens=block, unified_memory_level=0, device="cpu", max_tokens=None)
    alloc = ctx.block_allocator
    assert (alloc.total_count, alloc.paused_count, alloc.active_count) == (total, paused, active)
    assert alloc.dummy_block_idx == total - 1 and alloc.total_avail == total - 1
    expected = total - 1
    expected -= expected % 4
    assert ctx.max_requests == expected
    assert ctx.max_tokens == DynamicInferenceContext.DEFAULT_MAX_TOKENS
    assert ctx.block_size_bytes == 4 * 2 * layers * block * heads * kv
    assert ctx.memory_buffer.shape == (2, layers, total, block, heads, kv)


def test_default_paused_split_is_half_of_the_buffer_and_cpu_level1_is_level0():
    level0 = make_ctx(paused_buffer_size_gb=None, unified_memory_level=0)
    level1 = make_ctx(paused_buffer_size_gb=None, unified_memory_level=1)
    blocks = 40
    active = (blocks - 1) // 2
    for ctx in (level0, level1):
        alloc = ctx.block_allocator
        assert (alloc.active_count, alloc.paused_count, alloc.total_count) == (
            active, active, 2 * active + 1)
    assert level1.unified_memory_level == 0


def test_tensor_parallel_divides_heads_and_rounders():
    ctx = make_ctx(num_attention_heads=4, tensor_model_parallel_size=2)
    assert ctx.num_attention_heads_per_partition == 2
    assert ctx.hidden_size_per_attention_head == 8
    assert DynamicInferenceContext.round_up_tokens(1, tp_size=3) == 66
    assert DynamicInferenceContext.round_up_tokens(0) == 0
    assert DynamicInferenceContext.round_up_requests(5) == 8
    assert DynamicInferenceContext.round_up_requests(5, tp_size=3) == 6
    # tp_size=0 divided by zero; a negative value rounded to a negative request count.
    for call, match in [(lambda: DynamicInferenceContext.round_up_tokens(5, tp_size=0),
                         "tp_size=0 must be None or an int >= 1"),
                        (lambda: DynamicInferenceContext.round_up_requests(-5),
                         "value=-5 must be a finite number >= 0"),
                        (lambda: DynamicInferenceContext.round_up_tokens(5, tp_size=1.5),
                         "tp_size=1.5 must be None or an int >= 1")]:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.warns(DeprecationWarning):
        assert DynamicInferenceContext.round_up(65) == 128
    with pytest.raises(ValueError, match="divisible"):
        make_ctx(num_attention_heads=3, tensor_model_parallel_size=2)


def test_mla_buffer_shape_and_bytes():
    ctx = make_ctx(cache_mla_latent=True, kv_lora_rank=16, qk_pos_emb_head_dim=8,
                   block_size_tokens=8)
    assert ctx.block_size_bytes == 4 * 2 * 8 * 24
    assert ctx.memory_buffer.shape == (2, ctx.block_allocator.total_count, 8, 24)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        make_ctx(cache_mla_latent=True, qk_pos_emb_head_dim=8)


@pytest.mark.parametrize("kwargs,error,match", [
    pytest.param(dict(params_dtype=torch.int32), ValueError, "params_dtype", id="int-dtype"),
    pytest.param(dict(num_layers=0), ValueError, "num_layers", id="zero-layers"),
    pytest.param(dict(buffer_size_gb=-1), ValueError, "buffer_size_gb", id="negative-buffer"),
    pytest.param(dict(max_tokens=4), ValueError, "max_tokens", id="tokens-below-requests"),
    pytest.param(dict(unified_memory_level=2), ValueError, "unified_memory_level", id="uvm2"),
    # Pipeline stages need their group (test_megatron_compat.py runs two over gloo).
    pytest.param(dict(pipeline_model_parallel_size=2), ValueError, "pg_collection.pp",
                 id="pp-without-group"),
    pytest.param(dict(context_parallel_size=2), NotImplementedError, "context_parallel", id="cp"),
    pytest.param(dict(expert_model_parallel_size=4), NotImplementedError, "expert", id="ep"),
    pytest.param(dict(paused_buffer_size_gb=40 * BLOCK / GIB), ValueError, "no active blocks",
                 id="paused-eats-buffer"),
    pytest.param(dict(kernel_backend="cuda"), ValueError, "backend", id="bad-backend"),
])
def test_constructor_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_ctx(**kwargs)


def test_from_config_reads_plain_configs():
    class ModelConfig:
        num_layers, kv_channels, num_query_groups, num_attention_heads = 2, 8, 2, 8
        params_dtype, tensor_model_parallel_size = torch.float32, 1
        position_embedding_type, max_position_embeddings = "rope", 4096

    class Model:
        config = ModelConfig()

    class InferenceConfig:
        inference_max_seq_length = 64

    ctx = DynamicInferenceContext.from_config(
        InferenceConfig(), Model(), max_batch_size=8, buffer_size_gb=40 * BLOCK / GIB,
        device="cpu", block_size_tokens=4, max_tokens=64, max_requests=8)
    assert ctx.num_attention_heads_per_partition == 2 and ctx.max_sequence_length == 64
    assert ctx.materialize_only_last_token_logits is False


# ---------------------------------------------------------------- errors and formatting
@pytest.mark.parametrize("error", [
    ContextOverflowError(3, "x"), RequestOverflowError(1), TokenOverflowError(2, "t"),
    MaxSequenceLengthOverflowError(4, "long"), BlockOverflowError(None, is_transient=False),
    ActiveRequestCountOverflowError(4, 9), TensorStateDeallocatedError(7, "suspended"),
], ids=lambda e: type(e).__name__)
def test_errors_round_trip(error):
    data = ContextErrorFactory.serialize(error)
    back = ContextErrorFactory.deserialize(data)
    assert type(back) is type(error)
    assert (back.request_id, back.message, back.is_transient, str(back)) == \
        (error.request_id, error.message, error.is_transient, str(error))


def test_error_details():
    assert MaxSequenceLengthOverflowError(1).is_transient is False
    assert str(ActiveRequestCountOverflowError(4, 9)) == \
        "request -- | active_request_count (9) > max_request_count (4)."
    with pytest.raises(ValueError):
        ActiveRequestCountOverflowError(9, 4)
    with pytest.raises(ValueError, match="type"):
        ContextErrorFactory.deserialize({"type": "KeyError", "request_id": 1, "message": None,
                                         "is_transient": True})


@pytest.mark.parametrize("n,text", [(0, "0 bytes"), (1, "1 bytes"), (1024, "1 KiB"),
                                    (1536, "1.5 KiB"), (524289, "512 KiB"),
                                    (32212254, "30.7 MiB"), (int(1.5 * GIB), "1.5 GiB"),
                                    (10 * 1024 ** 4, "10 TiB")])
def test_get_mem_size_str(n, text):
    assert get_mem_size_str(n) == text


# ---------------------------------------------------------------- admission
def test_add_request_writes_rows_tokens_and_blocks():
    ctx = make_ctx()
    add(ctx, request(5, 4))  # exactly one block
    add(ctx, request(6, 6))
    assert (ctx.total_request_count, ctx.active_token_count, ctx.num_prefill_requests) == (2, 10, 2)
    assert ctx.kv_block_counts_host[:2].tolist() == [1, 2]
    ctx.initialize_attention_state()
    ids, pos = ctx.current_input_and_position_ids()
    assert ids.shape == (1, 64)  # padded to the token rounder, capped at max_tokens
    assert ids[0, :10].tolist() == list(range(105, 109)) + list(range(106, 112))
    assert pos[0, :10].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    cu_q, max_q = ctx.cu_query_lengths()
    cu_kv, kv_lens, max_k = ctx.cu_kv_lengths()
    assert cu_q[:3].tolist() == [0, 4, 10] and max_q == 6
    assert kv_lens[:2].tolist() == [4, 6] and max_k == 6
    assert ctx.padded_active_request_count == 4
    assert cu_q.shape[0] == 5 and cu_q[3:].tolist() == [10, 10]
    table = ctx.block_table_host
    blocks = ctx.token_to_block_idx[:10].tolist()
    assert blocks == [table[0, 0]] * 4 + [table[1, 0]] * 4 + [table[1, 1]] * 2
    assert ctx.token_to_local_position_within_kv_block[:10].tolist() == [
        0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    dummy = ctx.block_allocator.dummy_block_idx
    assert set(ctx.token_to_block_idx[10:64].tolist()) == {dummy}
    assert ctx.token_to_request_idx[:10].tolist() == [0] * 4 + [1] * 6
    # The reference hands out a fresh stack's top blocks in ascending order.
    total = ctx.block_allocator.total_count
    assert table[0, 0] == total - 2 and list(table[1, :2]) == [total - 4, total - 3]
    check_invariants(ctx)


def test_check_availability_and_boundaries():
    ctx = make_ctx(max_requests=4, max_tokens=16)
    assert ctx.check_availability(request(1, 16)) == (True, True, True)
    assert ctx.check_availability(request(1, 17))[1] is False
    add(ctx, request(1, 16))  # exactly max_tokens
    with pytest.raises(TokenOverflowError):
        ctx.add_request(request(2, 1))
    ctx2 = make_ctx(max_requests=4, max_tokens=16)
    for rid in range(4):
        add(ctx2, request(rid, 1))
    assert ctx2.check_availability(request(9, 1))[0] is False
    before = snapshot(ctx2)
    with pytest.raises(RequestOverflowError):
        ctx2.add_request(request(9, 1))
    assert_same(before, snapshot(ctx2))  # the reference leaks blocks here; we must not
    ctx3 = make_ctx()
    add(ctx3, request(1, 56, gen=8))  # prompt + gen == max_sequence_length
    # Beyond max_sequence_length: only the prompt is refused (the block-table row cannot hold
    # it); a longer generation budget is accepted as in Megatron-Core (the engine refuses it at
    # admission) and the request finished when it reaches max_sequence_length.
    before = snapshot(ctx3)
    with pytest.raises(MaxSequenceLengthOverflowError, match="prompt") as info:
        ctx3.add_request(request(2, 65, gen=1))
    assert info.value.is_transient is False
    assert_same(before, snapshot(ctx3))
    ctx4 = make_ctx()
    add(ctx4, request(2, 8, gen=57))  # prompt + gen == max_sequence_length + 1
    assert ctx4.get_max_sequence_lengths().tolist() == [65]


def test_block_overflow_leaves_state():
    ctx = make_ctx(max_sequence_length=256, max_tokens=256)
    free = ctx.block_allocator.total_avail
    add(ctx, request(1, 4 * (free - 1)))
    before = snapshot(ctx)
    assert ctx.check_availability(request(2, 8))[2] is False
    with pytest.raises(BlockOverflowError):
        ctx.add_request(request(2, 8))
    assert_same(before, snapshot(ctx))


def test_chunked_prefill_longer_than_max_tokens():
    ctx = make_ctx(max_tokens=16, max_sequence_length=64)
    req = request(7, 40, gen=4)
    add(ctx, request(1, 3))
    add(ctx, req, chunk_length=13)
    ctx.chunked_prefill_request_id = 7
    assert ctx.get_index_of_chunked_prefill_request() == 1
    for chunk in (15, 12):  # each continuation drops the placeholder decode token
        ctx.initialize_attention_state()
        ctx.update_requests(torch.tensor([True, False]), torch.tensor([11, 99]))
        assert ctx.total_request_count == 2 and ctx.host_request_ids().tolist() == [1, 7]
        last = chunk == req.remaining_prompt_length
        if last:
            ctx.chunked_prefill_request_id = -1
        add(ctx, req, chunk_length=chunk)
        assert ctx.active_token_count == 1 + chunk
        ctx.initialize_attention_state()
        _, pos = ctx.current_input_and_position_ids()
        start = 40 - req.remaining_prompt_length - chunk
        assert pos[0, 1:1 + chunk].tolist() == list(range(start, start + chunk))
        ids = ctx.token_to_input_ids[1:1 + chunk].tolist()
        assert ids == list(range(107 + start, 107 + start + chunk))
    ctx.update_requests(torch.tensor([True, True]), torch.tensor([11, 71]))
    # Request 7 filled its 10th block: it paused, resumed at once, and now leads the rows.
    row = ctx.host_request_ids().tolist().index(7)
    assert ctx.request_kv_length_offsets[row].item() == 40
    assert ctx.kv_block_counts_host[row] == 11
    check_invariants(ctx)


def test_continuation_must_be_the_chunked_request():
    ctx = make_ctx()
    req = request(3, 20)
    add(ctx, req, chunk_length=8)
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="continuation"):
        ctx.add_request(req, chunk_length=4)  # chunked_prefill_request_id was never set
    assert_same(before, snapshot(ctx))


# ---------------------------------------------------------------- update_requests
def test_finish_in_the_middle_compacts_rows():
    ctx = make_ctx()
    for rid in range(5):
        add(ctx, request(rid, 2))
    owned = ctx.block_table_host[[1, 3], 0].copy()
    step(ctx, finished_ids={1, 3})
    assert ctx.host_request_ids().tolist() == [0, 4, 2]  # tail survivor fills the first hole
    assert ctx.active_token_count == 3 and ctx.total_request_count == 3
    free = ctx.block_allocator.block_bag[:ctx.block_allocator.total_avail]
    assert set(owned.tolist()) <= set(free.tolist())
    ctx.initialize_attention_state()
    assert ctx.token_to_input_ids[:3].tolist() == [1, 41, 21]
    assert ctx.token_to_pos_ids[:3].tolist() == [2, 2, 2]
    assert ctx.is_decode_only() and ctx.num_decode_requests == 3
    assert ctx.get_active_sequence_lengths().tolist() == [3, 3, 3]
    assert ctx.get_max_sequence_lengths().tolist() == [10, 10, 10]
    check_invariants(ctx)


def test_all_finished_empties_the_context():
    ctx = make_ctx()
    add(ctx, request(1, 3))
    add(ctx, request(2, 5))
    step(ctx, finished_ids={1, 2})
    assert not ctx.has_unfinished_requests()
    assert ctx.block_allocator.total_avail == ctx.block_allocator.total_count - 1
    check_invariants(ctx)


def test_pause_resume_and_evict():
    # 9 active blocks, 3 paused: requests that cross a block boundary pause when none is free.
    ctx = make_ctx(buffer_size_gb=13 * BLOCK / GIB, paused_buffer_size_gb=3 * BLOCK / GIB)
    alloc = ctx.block_allocator
    assert (alloc.total_count, alloc.paused_count, alloc.active_count) == (13, 3, 9)
    for rid in range(3):
        add(ctx, request(rid, 12))  # 3 full blocks each: all 9 active blocks used
    paused = step(ctx)
    # All three filled their last block and pause; resume (right-most first) needs 4 blocks of
    # the active budget each: two fit (8 <= 9), request 0 stays paused within its budget (3).
    assert paused.tolist() == [0]
    assert ctx.evicted_request_ids.tolist() == []
    assert (ctx.paused_request_count, ctx.total_request_count) == (1, 3)
    assert ctx.host_request_ids().tolist() == [0, 1, 2]
    assert ctx.kv_block_counts_host[:3].tolist() == [3, 4, 4]
    assert alloc.total_avail == 1
    assert ctx.paused_tokens.tolist() == [1]
    assert ctx.check_availability(request(9, 1))[0] is False  # no admission while paused
    check_invariants(ctx)
    ctx.initialize_attention_state()
    assert ctx.token_to_input_ids[:2].tolist() == [11, 21]
    assert ctx.token_to_pos_ids[:2].tolist() == [12, 12]
    assert ctx.token_to_block_idx[:2].tolist() == ctx.block_table_host[1:3, 3].tolist()
    # Finishing the running requests frees their blocks: request 0 resumes with its token.
    step(ctx, finished_ids={1, 2})
    assert (ctx.paused_request_count, ctx.total_request_count) == (0, 1)
    assert ctx.kv_block_counts_host[0] == 4
    ctx.initialize_attention_state()
    assert ctx.token_to_input_ids[:1].tolist() == [1]
    assert ctx.token_to_pos_ids[:1].tolist() == [12]
    check_invariants(ctx)


def test_evicted_ids_and_paused_budget():
    ctx = make_ctx(buffer_size_gb=13 * BLOCK / GIB, paused_buffer_size_gb=1 * BLOCK / GIB,
                   max_sequence_length=32)
    for rid in range(4):
        add(ctx, request(rid, 8))  # 2 blocks each: 8 of 11 active blocks... then growth
    evicted_total = []
    for _ in range(6):
        step(ctx)
        evicted_total += ctx.evicted_request_ids.tolist()
        paused_blocks = ctx.kv_block_counts_host[:ctx.paused_request_count].sum()
        assert paused_blocks <= ctx.block_allocator.paused_count + ctx.kv_block_counts_host.max()
        check_invariants(ctx)
    assert evicted_total, "the workload must evict"
    assert not set(evicted_total) & set(ctx.host_request_ids().tolist())


def test_bad_update_inputs_leave_state():
    ctx = make_ctx()
    add(ctx, request(1, 3))
    add(ctx, request(2, 3))
    ctx.initialize_attention_state()
    before = snapshot(ctx)
    cases = [
        (torch.tensor([1, 1, 1]), torch.tensor([5, 6]), ValueError, "active_requests_mask"),
        # Float masks of exactly 0/1 are accepted (Megatron's tests pass them); not fractions.
        (torch.tensor([1.0, 0.25]), torch.tensor([5, 6]), ValueError, "0 and 1"),
        (torch.tensor([1, 2]), torch.tensor([5, 6]), ValueError, "0 and 1"),
        (torch.tensor([1, 1]), torch.tensor([5]), ValueError, "new_tokens"),
        (torch.tensor([1, 1]), torch.tensor([5.0, 6.0]), TypeError, "new_tokens"),
        (torch.tensor([1, 1]), torch.tensor([[5, 6]]), ValueError, "new_tokens"),
        (torch.tensor([1, 1]), torch.device("meta"), ValueError, "new_tokens"),
        (torch.device("meta"), torch.tensor([5, 6]), ValueError, "active_requests_mask"),
    ]
    for mask, tokens, error, match in cases:
        if isinstance(tokens, torch.device):
            tokens = torch.tensor([5, 6], device=tokens)
        if isinstance(mask, torch.device):
            mask = torch.tensor([1, 1], device=mask)
        with pytest.raises(error, match=match):
            ctx.update_requests(mask, tokens)
        assert_same(before, snapshot(ctx))


@pytest.mark.parametrize("make,error,match", [
    pytest.param(lambda: request(1, 3), ValueError, "already", id="duplicate-id"),
    pytest.param(lambda: DynamicInferenceRequest(request_id=9,
                                                 prompt_tokens=torch.tensor([], dtype=torch.long)),
                 ValueError, "empty", id="empty-prompt"),
    pytest.param(lambda: request(9, 70), MaxSequenceLengthOverflowError, "max_sequence_length",
                 id="too-long"),
    pytest.param(lambda: DynamicInferenceRequest(request_id=9, prompt_tokens=torch.tensor([-3, 4])),
                 ValueError, ">= 0", id="negative-token"),
])
def test_bad_requests_leave_state(make, error, match):
    ctx = make_ctx()
    add(ctx, request(1, 3))
    before = snapshot(ctx)
    with pytest.raises(error, match=match):
        ctx.add_request(make())
    assert_same(before, snapshot(ctx))


def test_float_prompt_and_bad_chunk_rejected():
    # Whole-number floats are token ids (Megatron-Core's tests pass torch.zeros(n)); fractions,
    # NaN and booleans are not.
    for tokens in (torch.tensor([1.0, 2.0]), [1.0, 2.0], np.array([1.0, 2.0])):
        prompt = DynamicInferenceRequest(request_id=1, prompt_tokens=tokens).prompt_tokens
        assert prompt.dtype == torch.int64 and prompt.tolist() == [1, 2]
    for tokens in (torch.tensor([1.5, 2.0]), [1.0, float("nan")], np.array([0.5])):
        with pytest.raises(ValueError, match="prompt_tokens .* whole numbers"):
            DynamicInferenceRequest(request_id=1, prompt_tokens=tokens)
    for tokens in (torch.tensor([True, False]), [True, False]):
        with pytest.raises(TypeError, match="prompt_tokens"):
            DynamicInferenceRequest(request_id=1, prompt_tokens=tokens)
    ctx = make_ctx()
    before = snapshot(ctx)
    for chunk in (0, 4, -1, 1.5):
        with pytest.raises(ValueError, match="chunk_length"):
            ctx.add_request(request(1, 3), chunk_length=chunk)
        assert_same(before, snapshot(ctx))


# ---------------------------------------------------------------- logits
def test_last_token_logits_and_log_probs():
    ctx = make_ctx()
    add(ctx, request(1, 3))
    add(ctx, request(2, 2))
    ctx.initialize_attention_state()
    n, vocab = ctx.padded_active_token_count, 211
    logits = torch.randn(1, n, vocab)
    last = ctx.last_token_logits(logits)
    assert torch.equal(last, logits[0, [2, 4]])
    with pytest.raises(ValueError, match="logits"):
        ctx.last_token_logits(logits[:, :4])
    new_tokens = torch.tensor([3, 7])
    values, full = ctx.calculate_log_probs(logits, new_tokens)
    reference = torch.log_softmax(logits[0].float(), -1)
    assert [len(v) for v in values] == [3, 2]
    expected_targets = [102, 103, 3, 103, 7]
    flat = [x for v in values for x in v]
    assert np.allclose(flat, [reference[t, expected_targets[t]].item() for t in range(5)],
                       atol=1e-6)
    ctx.update_requests(torch.tensor([1, 1]), new_tokens)
    ctx.initialize_attention_state()
    logits = torch.randn(1, ctx.padded_active_token_count, vocab)
    values, _ = ctx.calculate_log_probs(logits, torch.tensor([4, 5]))
    reference = torch.log_softmax(logits[0], -1)
    assert np.allclose([v[0] for v in values], [reference[0, 4].item(), reference[1, 5].item()],
                       atol=1e-6)
    with pytest.raises(RuntimeError, match="initialize_attention_state"):
        ctx.reset_attention_state()
        ctx.last_token_logits(logits)


# ---------------------------------------------------------------- KV cache
def test_append_and_read_kv_cache():
    ctx = make_ctx()
    add(ctx, request(1, 5))
    ctx.initialize_attention_state()
    n = ctx.padded_active_token_count
    key = torch.randn(n, 1, 2, 8)
    value = torch.randn(n, 1, 2, 8)
    ctx.append_key_value_cache(2, key, value)
    k_cache, v_cache = ctx.key_value_cache(2)
    blocks = ctx.block_table_host[0, :2]
    assert torch.equal(k_cache[blocks[0]], key[:4, 0])
    assert torch.equal(v_cache[blocks[1], 0], value[4, 0])
    with pytest.raises(ValueError, match="layer_number"):
        ctx.append_key_value_cache(0, key, value)
    with pytest.raises(ValueError, match="dtype"):
        ctx.append_key_value_cache(1, key.half(), value.half())
    with pytest.raises(ValueError, match="tokens"):
        ctx.append_key_value_cache(1, key[:3], value[:3])


# ---------------------------------------------------------------- lifecycle
def test_suspend_and_resume():
    ctx = make_ctx()
    add(ctx, request(1, 5))
    ctx.deallocate_all_tensors()
    assert ctx.is_tensor_state_allocated is False and ctx.memory_buffer is None
    for call in (lambda: ctx.add_request(request(2, 3)), ctx.initialize_attention_state,
                 lambda: ctx.update_requests(torch.tensor([1]), torch.tensor([1])),
                 lambda: ctx.request_ids, lambda: ctx.key_value_cache(1)):
        with pytest.raises(TensorStateDeallocatedError):
            call()
    ctx.allocate_all_tensors(is_init=False)
    assert ctx.total_request_count == 0
    assert ctx.block_allocator.total_avail == ctx.block_allocator.total_count - 1
    add(ctx, request(1, 5))  # the in-flight request is re-added after resume
    step(ctx)
    check_invariants(ctx)


def test_reset_and_stats_and_metrics_writer():
    logged = []

    class Writer:
        def log(self, data):
            logged.append(data)

    ctx = make_ctx(metrics_writer=Writer())
    add(ctx, request(1, 5))
    add(ctx, request(2, 9))
    stats = ctx.get_kvcache_utilization_stats()
    assert stats["allocated_blocks"] == 5 and stats["active_unique_blocks"] == 5
    assert stats["active_request_count"] == 2 and stats["paused_request_count"] == 0
    step(ctx)
    assert logged and logged[-1]["inference/allocated_blocks"] == 5
    ctx.reset()
    assert ctx.total_request_count == 0 and ctx.active_token_count == 0
    assert ctx.get_kvcache_utilization_stats()["allocated_blocks"] == 0
    check_invariants(ctx)


def test_megatron_only_methods_work():
    ctx = make_ctx()
    with pytest.raises(RuntimeError, match="hybrid"):
        ctx.mamba_states_cache(1)
    # Supported now (test_megatron_compat.py has the dummy requests).
    assert ctx.is_symmetric_memory_initialized is False
    ctx.maybe_initialize_symmetric_memory()  # nothing to set up: recorded only
    assert ctx.is_symmetric_memory_initialized is True
    ctx.add_dummy_requests_parallel([])  # no requests: nothing changes
    assert ctx.total_request_count == 0
    ctx.initialize_attention_state(
        construct_graph_dimensions=InferenceBatchDimensions(4, 0, 4, False))
    assert (ctx.num_decode_requests, ctx.active_token_count) == (4, 4)
    assert ctx.is_static_batching() is False and ctx.using_cuda_graph_this_step() is False


def test_vocab_and_validate_checks():
    ctx = make_ctx(vocab_size=120, validate=True)
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="vocab_size"):
        ctx.add_request(request(30, 3))  # ids 130..132
    assert_same(before, snapshot(ctx))
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    logits = torch.randn(1, ctx.padded_active_token_count, 120)
    logits[0, 10] = float("nan")  # a padding row: ignored
    ctx.last_token_logits(logits)
    logits[0, 2, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        ctx.last_token_logits(logits)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        ctx.calculate_log_probs(logits, torch.tensor([3]))
    with pytest.raises(ValueError, match="vocabulary columns"):
        ctx.last_token_logits(torch.randn(1, ctx.padded_active_token_count, 99))
    before = snapshot(ctx)
    for bad in (torch.tensor([120]), torch.tensor([-1])):
        with pytest.raises(ValueError, match="new_tokens"):
            ctx.update_requests(torch.tensor([True]), bad)
        assert_same(before, snapshot(ctx))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_rotary_methods_match_megatron(interleaved):
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    ctx = make_ctx()
    add(ctx, request(1, 5))
    add(ctx, request(2, 3))
    ctx.initialize_attention_state()
    n = ctx.padded_active_token_count
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    angles = torch.outer(torch.arange(64).float(), inv)
    emb = (torch.stack([angles, angles], -1).flatten(1) if interleaved
           else torch.cat([angles, angles], -1))
    freqs = emb[:, None, None, :]
    config = SimpleNamespace(rotary_interleaved=interleaved, multi_latent_attention=False)
    query, key = torch.randn(n, 1, 4, 8), torch.randn(n, 1, 2, 8)
    positions = ctx.token_to_pos_ids[:n]
    expected_q = _apply_rotary_pos_emb_bshd(query.clone(), freqs[positions],
                                            rotary_interleaved=interleaved)
    expected_k = _apply_rotary_pos_emb_bshd(key.clone(), freqs[positions],
                                            rotary_interleaved=interleaved)
    q_out = ctx.apply_rotary_emb_query(query.clone(), freqs, config, None, None)
    k_out = ctx.apply_rotary_emb_key(key.clone(), freqs, config, None)
    torch.testing.assert_close(q_out[:8], expected_q[:8], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out[:8], expected_k[:8], rtol=1e-6, atol=1e-6)
    if not interleaved:
        cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
        q2, k2 = ctx.apply_fused_qk_rotary_emb(query.clone(), key.clone(), cos_sin, config)
        assert q2.shape == (n, 1, 4, 8)
        torch.testing.assert_close(q2[:8], expected_q[:8], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k2[:8], expected_k[:8], rtol=1e-5, atol=1e-5)
    # The fused rope + KV append writes the rotated key into the cache.
    q3, k3 = ctx.apply_rotary_emb_and_append_key_value_cache(
        1, query.clone(), key.clone(), torch.randn(n, 1, 2, 8), rotary_pos_emb=freqs, config=config)
    k_cache, _ = ctx.key_value_cache(1)
    block = ctx.block_table_host[0, 0]
    torch.testing.assert_close(k_cache[block, :4], expected_k[:4, 0], rtol=1e-6, atol=1e-6)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        ctx.apply_rotary_emb_query(query, freqs, config, None, SimpleNamespace(size=lambda: 2))


def test_fused_qk_rope_returns_each_tensor_as_n_1_h_d():
    from types import SimpleNamespace

    ctx = make_ctx()
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    n = ctx.padded_active_token_count
    config = SimpleNamespace(rotary_interleaved=False)
    q, k = ctx.apply_fused_qk_rotary_emb(torch.randn(n, 4, 8), torch.randn(n, 1, 2, 8),
                                         torch.randn(64, 8), config)
    assert q.shape == (n, 1, 4, 8) and k.shape == (n, 1, 2, 8)
