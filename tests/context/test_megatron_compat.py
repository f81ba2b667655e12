"""Megatron-Core's order of calls and hand-written states, on dynctx (docs/SEMANTICS.md §16):
lazy step arrays, counts and limits set by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import add, make_ctx, request

from dynctx.context import RequestOverflowError

STEP_ARRAYS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
               "token_to_block_idx", "token_to_position_in_request",
               "token_to_local_position_within_kv_block")


def _arrays(ctx, n):
    return {name: getattr(ctx, name)[:n].clone() for name in STEP_ARRAYS}


def test_step_arrays_read_before_initialize_attention_state_are_the_steps():
    lazy, eager = make_ctx(), make_ctx()
    for ctx in (lazy, eager):
        add(ctx, request(1, 5))
        add(ctx, request(2, 3))
    eager.initialize_attention_state()
    expected = _arrays(eager, 8)
    assert lazy._step is None
    got = _arrays(lazy, 8)  # the first read builds the step
    assert lazy._step is not None
    for name in STEP_ARRAYS:
        assert torch.equal(got[name], expected[name]), name
    assert got["token_to_input_ids"].tolist() == list(range(101, 106)) + list(range(102, 105))
    # The model's own initialize_attention_state rebuilds the same step.
    lazy.initialize_attention_state()
    for name in STEP_ARRAYS:
        assert torch.equal(getattr(lazy, name)[:8], expected[name]), name
    # After an update the arrays are the next (decode) step's, read before its initialize.
    for ctx in (lazy, eager):
        ctx.update_requests(torch.ones(2, dtype=torch.bool), torch.tensor([7, 9]))
    eager.initialize_attention_state()
    assert lazy.token_to_input_ids[:2].tolist() == [7, 9]
    assert lazy.token_to_pos_ids[:2].tolist() == eager.token_to_pos_ids[:2].tolist() == [5, 3]


def test_hot_path_reads_do_not_rebuild_the_step():
    ctx = make_ctx()
    add(ctx, request(1, 5))
    ctx.initialize_attention_state()
    step = ctx._step
    for name in STEP_ARRAYS:
        getattr(ctx, name)
    assert ctx._step is step


def test_calculate_log_probs_before_initialize_attention_state():
    lazy, eager = make_ctx(), make_ctx()
    for ctx in (lazy, eager):
        add(ctx, request(1, 4))
    eager.initialize_attention_state()
    logits = torch.randn(1, eager.padded_active_token_count, 300)
    new_tokens = torch.tensor([11])
    expected, _ = eager.calculate_log_probs(logits, new_tokens)
    got, _ = lazy.calculate_log_probs(logits, new_tokens)
    assert got == expected and len(got[0]) == 4


def test_empty_context_reads_do_not_build_a_step():
    ctx = make_ctx()
    assert torch.all(ctx.token_to_request_idx == -1) and ctx._step is None


def test_counts_and_max_requests_set_by_hand():
    ctx = make_ctx()
    ctx.max_requests = 2
    add(ctx, request(1, 2))
    add(ctx, request(2, 2))
    with pytest.raises(RequestOverflowError):
        ctx.add_request(request(3, 2))
    for value, error, match in ((9, ValueError, r"max_requests=9 .*, 8\] \(the rows allocated\)"),
                                (1, ValueError, "total_request_count=2"),
                                (2.5, TypeError, "max_requests=2.5")):
        with pytest.raises(error, match=match):
            ctx.max_requests = value
    ctx.max_requests = 8
    add(ctx, request(3, 2))
    with pytest.raises(ValueError, match=r"paused_request_count=9 must lie in \[0, "
                                         r"_request_rows=8\]"):
        ctx.paused_request_count = 9
    with pytest.raises(TypeError, match="active_token_count"):
        ctx.active_token_count = "1"
    # A state written by hand is taken as forwarded: update_requests runs without a step.
    ctx.num_prefill_requests = 0
    ctx.active_token_count = 3
    ctx.update_requests(torch.tensor([1, 0, 1]), torch.tensor([5, 6, 7]))
    assert ctx.host_request_ids().tolist() == [1, 3]


def test_mamba_metadata_lives_with_the_context():
    from dynctx.context import MambaInferenceStateConfig

    config = MambaInferenceStateConfig(["M", "*"], (6, 4), (2, 4, 3))
    ctx = make_ctx(mamba_inference_state_config=config, max_requests=4, max_tokens=32)
    assert make_ctx().mamba_metadata is None  # not a hybrid
    meta = ctx.mamba_metadata
    assert meta is not None and meta.mamba_state_free_slot_count == 4
    assert meta.request_to_mamba_state_idx.tolist() == [-1] * 4
    assert all(getattr(meta, name) is None for name in meta.STEP_FIELDS)
    add(ctx, request(1, 3))
    ctx.initialize_attention_state()
    assert ctx.mamba_metadata is meta and meta.batch_indices_prefill[:1].tolist() == [3]
    assert meta.request_to_mamba_state_idx[:1].tolist() == [3]
    assert meta.mamba_state_free_slot_count == 3
    ctx.update_requests(torch.tensor([False]), torch.tensor([5]))
    assert ctx.mamba_metadata is meta and meta.batch_indices_prefill is None
    assert meta.mamba_state_free_slot_count == 4
    assert meta.allocate_slot() == 3 and meta.mamba_state_free_slot_count == 3
    meta.mamba_state_free_slot_count = 4
    for value, error in ((5, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="mamba_state_free_slot_count"):
            meta.mamba_state_free_slot_count = value
    ctx.reset()
    assert ctx.mamba_metadata is meta and meta.mamba_state_free_slot_count == 4


def test_paused_tokens_set_by_hand():
    ctx = make_ctx()
    ctx.paused_tokens = None  # Megatron's reset value: nothing changes
    for rid in range(3):
        add(ctx, request(rid, 2))
    ctx.paused_request_count = 2
    ctx.paused_tokens = torch.tensor([41, 42], dtype=torch.int32)
    assert ctx.paused_tokens.tolist() == [41, 42]
    with pytest.raises(ValueError, match="paused_request_count=2"):
        ctx.paused_tokens = torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match="paused_tokens"):
        ctx.paused_tokens = torch.tensor([1.0])


def test_float_masks_and_assertion_compatible_errors():
    from dynctx.context import NotHybridError, StepShapeError

    ctx = make_ctx()
    for rid in range(3):
        add(ctx, request(rid, 2))
    ctx.initialize_attention_state()
    # Megatron code asserts these shapes: our errors are ValueErrors and AssertionErrors.
    for mask, tokens in ((torch.ones(2), torch.tensor([1, 2, 3])),
                         (torch.ones(3), torch.tensor([1, 2]))):
        with pytest.raises(StepShapeError) as info:
            ctx.update_requests(mask, tokens)
        assert isinstance(info.value, ValueError) and isinstance(info.value, AssertionError)
    ctx.update_requests(torch.Tensor([1, 0, 1]), torch.tensor([7, 8, 9]))  # float 0/1 mask
    assert ctx.host_request_ids().tolist() == [0, 2]
    with pytest.raises(NotHybridError, match="hybrid") as info:
        ctx.mamba_states_cache(1)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, AssertionError)


def _dummy(rid, length, gen=2):
    from dynctx.context import DynamicInferenceRequest, SamplingParams

    return DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.arange(length) + 10 * rid,
                                   sampling_params=SamplingParams(num_tokens_to_generate=gen))


@pytest.mark.parametrize("as_prefill", [True, False], ids=["prefill", "decode"])
def test_dummy_requests_run_a_step_and_release_nothing(as_prefill):
    from helpers import check_invariants

    ctx = make_ctx()
    dummy = ctx.block_allocator.dummy_block_idx
    free = ctx.block_allocator.total_avail
    ctx.add_dummy_requests_parallel([_dummy(1, 5), _dummy(2, 3)], count_as_prefill=as_prefill)
    assert ctx.block_allocator.total_avail == free
    assert ctx.num_prefill_requests == (2 if as_prefill else 0)
    assert ctx.num_decode_requests == (0 if as_prefill else 2)
    assert ctx.block_table_host[:2, :2].tolist() == [[dummy, dummy], [dummy, -1]]
    add(ctx, request(3, 2))  # a real request after them reads its own prompt
    ctx.initialize_attention_state()
    assert ctx.token_to_input_ids[:10].tolist() == [10, 11, 12, 13, 14, 20, 21, 22, 103, 104]
    assert ctx.token_to_block_idx[:8].tolist() == [dummy] * 8
    assert ctx.token_to_pos_ids[:10].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    ctx.update_requests(torch.tensor([0, 1, 1]), torch.tensor([7, 8, 9]))
    # The finished dummy released no block (the dummy block is never on the free stack).
    assert ctx.block_allocator.total_avail == free - 1
    assert dummy not in ctx.block_allocator.block_bag[:ctx.block_allocator.total_avail]
    assert ctx.host_request_ids().tolist() == [3, 2]  # the last row fills the hole
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([0, 0]), torch.tensor([1, 1]))
    assert ctx.block_allocator.total_avail == free
    check_invariants(ctx)


def test_dummy_request_errors_change_nothing():
    from helpers import assert_same, snapshot

    from dynctx.context import TokenOverflowError

    ctx = make_ctx(max_requests=4)
    add(ctx, request(1, 2))
    before = snapshot(ctx)
    for requests, kwargs, error, match in (
            ([_dummy(2, 2)] * 2, {}, ValueError, r"\[2\] are already"),
            ([_dummy(1, 2)], {}, ValueError, r"\[1\] are already"),
            ([_dummy(i, 1) for i in range(2, 6)], {}, RequestOverflowError, "max_requests"),
            ([_dummy(2, 63)], {}, TokenOverflowError, "max_tokens"),
            ([_dummy(2, 2)], dict(count_as_prefill=False), ValueError, "precede"),
            ([_dummy(2, 2)], dict(count_as_prefill=1), TypeError, "count_as_prefill"),
            (_dummy(2, 2), {}, TypeError, "sequence")):
        with pytest.raises(error, match=match):
            ctx.add_dummy_requests_parallel(requests, **kwargs)
        assert_same(before, snapshot(ctx))


def test_dummy_requests_for_cudagraph_capture_and_hybrid_slots():
    from dynctx.context import InferenceBatchDimensions, MambaInferenceStateConfig

    config = MambaInferenceStateConfig(["M", "*"], (6, 4), (2, 4, 3))
    ctx = make_ctx(mamba_inference_state_config=config)
    ctx.mamba_conv_states.fill_(5.0)
    ctx.mamba_ssm_states.fill_(5.0)
    ctx.add_dummy_requests_for_cudagraph_capture(InferenceBatchDimensions(9, 2, 3, False))
    assert ctx.host_request_ids().tolist() == [0, 1, 2, 3, 4]
    assert (ctx.num_decode_requests, ctx.num_prefill_requests) == (3, 2)
    assert ctx._h_req[1, :5].tolist() == [1, 1, 1, 3, 3]  # query lengths: 6 prefill tokens
    slots = ctx.mamba_metadata.request_to_mamba_state_idx[:5].tolist()
    assert sorted(slots) == [3, 4, 5, 6, 7]
    assert torch.all(ctx.mamba_conv_states[:, slots] == 0)
    assert torch.all(ctx.mamba_ssm_states[:, slots] == 0)
    assert torch.all(ctx.mamba_conv_states[:, :3] == 5)
    ctx.initialize_attention_state()
    assert ctx.mamba_metadata.batch_indices_decode[:3].tolist() == slots[:3]


def _pipeline_rank(rank, world, port, result):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        class Groups:
            pp = dist.new_group(list(range(world)))

        # Stage 0 holds 3 layers, stage 1 one: alone, stage 1 would get 3x the blocks.
        ctx = make_ctx(num_layers=3 if rank == 0 else 1, pipeline_model_parallel_size=world,
                       pg_collection=Groups(), paused_buffer_size_gb=None)
        alone = make_ctx(num_layers=3 if rank == 0 else 1, paused_buffer_size_gb=None)
        result[rank] = (ctx.block_allocator.total_count, alone.block_allocator.total_count,
                        ctx.pipeline_model_parallel_size, ctx.layer_map)
    finally:
        dist.destroy_process_group()


def test_pipeline_stages_share_the_smallest_block_count():
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("fork")
    result = context.Manager().dict()
    ranks = [context.Process(target=_pipeline_rank, args=(rank, 2, port, result))
             for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
    assert [process.exitcode for process in ranks] == [0, 0], dict(result)
    (total0, alone0, pp0, map0), (total1, alone1, pp1, map1) = result[0], result[1]
    assert alone1 > alone0 and total0 == total1 == alone0 and pp0 == pp1 == 2
    assert map0 == {0: 0, 1: 1, 2: 2} and map1 == {0: 0}  # each stage's own layers


def test_bookkeeping_written_by_hand_reaches_the_host_on_a_cpu_device():
    """Megatron's tests write the bookkeeping tensors by hand: on a CPU device they are views of
    the host arrays, so the next update sees the writes, and the device mirror follows."""
    from helpers import check_invariants

    ctx = make_ctx()
    blocks = ctx.block_allocator.allocate_memory_blocks(3)
    ctx.total_request_count, ctx.paused_request_count, ctx.active_token_count = 3, 0, 3
    for row in range(3):
        ctx.request_ids[row] = 10 + row
        ctx.request_query_lengths[row] = 1
        ctx.request_kv_block_counts[row] = 1
        ctx.request_last_kv_block_id[row] = blocks[row]
        ctx.request_to_kv_block_ids[row, 0] = blocks[row]
    ctx.request_metadata["temperature"][:3] = 0.5
    assert ctx.host_request_ids().tolist() == [10, 11, 12]
    assert ctx.block_table_host[:3, 0].tolist() == blocks.tolist()
    free = ctx.block_allocator.total_avail
    ctx.update_requests(torch.tensor([1, 0, 1]), torch.tensor([5, 6, 7]))
    assert ctx.host_request_ids().tolist() == [10, 12]
    assert ctx.block_allocator.total_avail == free + 1
    mirrors = ctx._device.mirrors(ctx._table)
    assert mirrors["block_table"][:2, 0].tolist() == [int(blocks[0]), int(blocks[2])]
    assert mirrors["metadata"]["temperature"][:2].tolist() == [0.5, 0.5]
    assert ctx.token_to_input_ids[:2].tolist() == [5, 7]
    check_invariants(ctx)


def test_pull_bookkeeping_from_device_when_views_are_device_mirrors():
    """The CUDA path (device mirrors handed out, then pulled back), run on the CPU by handing
    out the device mirrors instead of host views."""
    ctx = make_ctx()
    ctx._host_views = False
    add(ctx, request(1, 4))
    add(ctx, request(2, 4))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([1, 1]), torch.tensor([5, 6]))
    ids = ctx.request_ids
    assert ids.data_ptr() != torch.from_numpy(ctx._table.rows).data_ptr()
    ids[0] = 77  # a device write: the host does not see it yet
    ctx.request_metadata["temperature"][1] = 0.25
    assert ctx.host_request_ids().tolist() == [1, 2]
    ctx.pull_bookkeeping_from_device()
    assert ctx.host_request_ids().tolist() == [77, 2]
    assert ctx._table.metadata["temperature"][1] == 0.25
    add(ctx, request(3, 2))
    with pytest.raises(RuntimeError, match="host changed"):
        ctx.pull_bookkeeping_from_device()


@pytest.mark.parametrize("swap", [False, True], ids=["move", "swap"])
def test_move_and_swap_book_keeping_tensors(swap):
    ctx = make_ctx()
    for rid in (1, 2, 3):
        add(ctx, request(rid, 5, gen=3 + rid))
    ctx.initialize_attention_state()
    ctx.update_requests(torch.ones(3, dtype=torch.bool), torch.tensor([11, 12, 13]))
    table = ctx.block_table_host[:3].copy()
    fields = ctx._h_req[:, :3].copy()
    tokens = torch.tensor([21, 22, 23])
    op = ctx._swap_book_keeping_tensors if swap else ctx._move_book_keeping_tensors
    op(torch.tensor([2]), torch.tensor([0]), tokens)
    order = [2, 1, 0] if swap else [2, 1, 2]
    assert np.array_equal(ctx._h_req[:, :3], fields[:, order])
    assert np.array_equal(ctx.block_table_host[:3], table[order])
    assert tokens.tolist() == [[21, 22, 23][i] for i in order]
    pending = ctx._device.next_tokens[ctx._device.current][:3].tolist()
    assert pending == [[11, 12, 13][i] for i in order]
    mirrors = ctx._device.mirrors(ctx._table)
    assert np.array_equal(mirrors["block_table"][:3].numpy(), table[order])
    for src, dst, error, match in (([0], [0, 1], ValueError, "src_idxs has 1"),
                                   ([0, 1], [2, 2], ValueError, "distinct"),
                                   ([9], [0], ValueError, r"\[9\] outside"),
                                   ([0.5], [0], TypeError, "src_idxs")):
        with pytest.raises(error, match=match):
            op(src, dst, None)


def test_capture_dummies_need_an_empty_context_and_check_first():
    from helpers import assert_same, snapshot

    from dynctx.context import InferenceBatchDimensions, TokenOverflowError

    ctx = make_ctx(max_requests=4)
    for dims, error, match in ((InferenceBatchDimensions(6, 2, 3, False), RequestOverflowError,
                                "max_requests"),
                               (InferenceBatchDimensions(70, 1, 1, False), TokenOverflowError,
                                "max_tokens"),
                               (InferenceBatchDimensions(3, 2, 2, False), ValueError,
                                "1 tokens for 2 prefill")):
        before = snapshot(ctx)
        with pytest.raises(error, match=match):
            ctx.add_dummy_requests_for_cudagraph_capture(dims)
        assert_same(before, snapshot(ctx))
    add(ctx, request(1, 2))
    with pytest.raises(RuntimeError, match="empty context"):
        ctx.add_dummy_requests_for_cudagraph_capture(InferenceBatchDimensions(2, 0, 2, False))
