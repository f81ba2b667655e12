"""Every error path of ``update_requests`` and ``add_request`` leaves the context exactly as it
was, and the next valid step works.

Each case builds a state, takes a full snapshot (host rows, block table, allocator stack and
reference counts, live ids, device block table and per-request fields, request metadata,
pending tokens, the step's token arrays and attention metadata, every byte of the KV buffer),
makes the bad call, compares a new snapshot with the first, and then runs one more valid step
(its own check: blocks owned once, device mirrors host). The cases run on the torch backend and,
under ``TRITON_INTERPRET=1``, on ``kernel_backend="triton"`` (the same plan, applied by the
Triton kernels).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, assert_same, check_invariants, make_ctx, snapshot
from triton_marks import needs_triton

from dynctx.context import (
    BlockOverflowError,
    DynamicInferenceRequest,
    InferenceBatchDimensions,
    MambaInferenceStateConfig,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    SamplingParams,
    TensorStateDeallocatedError,
    TokenOverflowError,
)

VOCAB = 500
BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=[
        pytest.mark.interpreter,
        needs_triton]),
]


def req(rid, length=3, gen=8, tokens=None, **sampling):
    if tokens is None:
        tokens = torch.tensor([(rid * 7 + i) % VOCAB for i in range(length)])
    return DynamicInferenceRequest(request_id=rid, prompt_tokens=tokens,
                                   sampling_params=SamplingParams(num_tokens_to_generate=gen,
                                                                  **sampling))


def raw(rid=9, tokens=None, finished=0, gen=8):
    """A request whose remaining prompt is ``tokens`` as given (the context's checks alone)."""
    r = req(rid, gen=gen)
    r.remaining_prompt_tokens = tokens
    r.finished_chunk_token_count = finished
    return r


def _step(ctx, keep=True):
    """initialize (unless this step is initialized) + update: every active request kept (or
    finished) with a token in the vocabulary."""
    if ctx._step is None:
        ctx.initialize_attention_state()
    n = ctx.total_request_count - ctx.paused_request_count
    mask = torch.full((n,), keep, dtype=torch.bool)
    k = ctx.num_speculative_tokens
    return ctx.update_requests(mask, torch.arange(n, dtype=torch.int64) + 7,
                               torch.full((k, n), 9) if k else None)


# ---------------------------------------------------------------- states
def s_prefill(backend):
    """Requests 1 (3 tokens) and 2 (5 tokens) added; the step initialized; K/V written."""
    ctx = make_ctx(kernel_backend=backend, vocab_size=VOCAB, validate=True)
    add(ctx, req(1, 3))
    add(ctx, req(2, 5))
    ctx.initialize_attention_state()
    n = ctx.padded_active_token_count
    kv = torch.arange(n * 16, dtype=torch.float32).reshape(n, 2, 8)
    for layer in (1, 2):
        ctx.append_key_value_cache(layer, kv, kv + 0.5)
    return ctx


def s_decode(backend):
    """Two decode steps later (requests 1 and 2 decoding, metadata built)."""
    ctx = s_prefill(backend)
    _step(ctx)
    _step(ctx)
    ctx.initialize_attention_state()
    return ctx


def s_added(backend):
    """A decode step of 1 and 2 with request 3 added and not yet initialized."""
    ctx = s_decode(backend)
    _step(ctx)
    add(ctx, req(3, 4))
    return ctx


def s_chunked(backend):
    """Request 3's first chunk (8 of 20 tokens) in, chunked id set, one step done: the next
    step needs the continuation."""
    ctx = make_ctx(kernel_backend=backend, vocab_size=VOCAB)
    add(ctx, req(1, 3))
    ctx._chunked = req(3, 20)
    add(ctx, ctx._chunked, chunk_length=8)
    ctx.chunked_prefill_request_id = 3
    _step(ctx)
    return ctx


def s_chunk_in_step(backend):
    """Request 1 and request 3's first chunk (8 of 20 tokens) added, the step initialized."""
    ctx = make_ctx(kernel_backend=backend, vocab_size=VOCAB)
    add(ctx, req(1, 3))
    add(ctx, req(3, 20), chunk_length=8)
    ctx.chunked_prefill_request_id = 3
    ctx.initialize_attention_state()
    return ctx


def s_full_rows(backend):
    ctx = make_ctx(kernel_backend=backend, max_requests=4, max_tokens=64)
    for rid in range(4):
        add(ctx, req(rid + 1, 2))
    ctx.initialize_attention_state()
    return ctx


def s_long(backend):
    """Request 1 at max_sequence_length (16): its next token would be the 17th; it was admitted
    with prompt + gen = 20 > 16, as Megatron-Core's context allows. Request 2 is short."""
    ctx = make_ctx(kernel_backend=backend, max_sequence_length=16)
    add(ctx, req(1, 15, gen=5))
    add(ctx, req(2, 3, gen=5))
    _step(ctx)
    ctx.initialize_attention_state()
    return ctx


def s_stuck(backend):
    """An active budget of 3 blocks and a request about to need its 4th: no request can run."""
    ctx = make_ctx(kernel_backend=backend, buffer_size_gb=6 * BLOCK / GIB,
                   paused_buffer_size_gb=2 * BLOCK / GIB, max_requests=4, max_tokens=64)
    add(ctx, req(1, 11, gen=40))
    _step(ctx)
    ctx.initialize_attention_state()
    return ctx


def s_hybrid_continued(backend):
    """A hybrid: request 3's final continuation chunk added in this step (it must stay last)."""
    layers, conv, ssm = ("M", "*"), (6, 4), (2, 3, 5)
    mamba_bytes = 4 * (24 + 30)
    block = BLOCK // 2 + mamba_bytes  # one attention layer
    ctx = make_ctx(kernel_backend=backend, num_layers=2, buffer_size_gb=40 * block / GIB,
                   paused_buffer_size_gb=8 * block / GIB,
                   mamba_inference_state_config=MambaInferenceStateConfig(layers, conv, ssm))
    add(ctx, req(1, 3))
    r = req(3, 20)
    add(ctx, r, chunk_length=8)
    ctx.chunked_prefill_request_id = 3
    _step(ctx)
    ctx.chunked_prefill_request_id = -1
    add(ctx, r)
    return ctx


T9 = [5, 9, 13, 17, 21, 25, 29, 33, 37]  # two full blocks of 4 and one token


def s_hybrid_cached(backend):
    """A hybrid with prefix caching and 3 Mamba snapshots (0.19's mamba_slot_allocator):
    request 1 (9 tokens) added, its two full blocks cached, the step initialized."""
    layers, conv, ssm = ("M", "*"), (6, 4), (2, 3, 5)
    ctx = make_ctx(kernel_backend=backend, num_layers=2, enable_prefix_caching=True,
                   prefix_caching_mamba_gb=3 * 4 * (24 + 30) / GIB,
                   mamba_inference_state_config=MambaInferenceStateConfig(layers, conv, ssm))
    add(ctx, req(1, tokens=T9))
    ctx.initialize_attention_state()
    return ctx


def s_cache_pending(backend, **overrides):
    """Prefix caching ("lru"): request 1 (9 tokens) computed, its two full blocks published;
    request 2 (the same 9 tokens + 3) added with a hit on them, the step initialized: its third
    block was published at the add (Megatron-Core 0.19's registration)."""
    ctx = make_ctx(kernel_backend=backend, vocab_size=VOCAB, enable_prefix_caching=True,
                   prefix_caching_eviction_policy="lru", **overrides)
    add(ctx, req(1, tokens=T9))
    _step(ctx)
    add(ctx, req(2, tokens=T9 + [41, 45, 49]))
    assert ctx.get_prefix_cache_stats()["prefix_cache_blocks_matched"] == 2
    ctx.initialize_attention_state()
    return ctx


def s_cache_stuck(backend):
    """``s_stuck`` with prefix caching ("ref_zero"): the update would publish request 1's two
    full prompt blocks, and finds no request able to run."""
    ctx = make_ctx(kernel_backend=backend, buffer_size_gb=6 * BLOCK / GIB,
                   paused_buffer_size_gb=2 * BLOCK / GIB, max_requests=4, max_tokens=64,
                   enable_prefix_caching=True)
    add(ctx, req(1, 11, gen=40))
    _step(ctx)
    ctx.initialize_attention_state()
    return ctx


def _salted(r, salt):
    r.prefix_caching_salt = salt
    return r


def s_processed(backend):
    """s_prefill with Megatron-Core 0.19's processed log probs asked for."""
    ctx = s_prefill(backend)
    ctx.config = SimpleNamespace(logprobs_mode="processed_logprobs")
    return ctx


K = 2


def s_speculative(backend, **overrides):
    """``num_speculative_tokens=2`` with ``validate`` and ``vocab_size``: requests 1 (5 tokens)
    and 2 (2 tokens) after one update with drafts; a decode step of 1 + 2 tokens each
    initialized."""
    ctx = make_ctx(kernel_backend=backend, vocab_size=VOCAB, validate=True,
                   num_speculative_tokens=K, **overrides)
    add(ctx, req(1, 5))
    add(ctx, req(2, 2))
    _step(ctx)
    ctx.initialize_attention_state()
    return ctx


def s_settling(backend):
    """``s_speculative`` with deferred rewinds: the step's rewind deferred (request 1 rejects
    one draft), the next step initialized (the device applied the lag): ready to settle."""
    ctx = s_speculative(backend)
    ctx.enable_deferred_rewind()
    ctx.defer_kv_rewind(_tokens(1, 2))
    _step(ctx)
    ctx.initialize_attention_state()
    return ctx


def s_settled(backend):
    """``s_settling`` with request 1's rewind settled."""
    ctx = s_settling(backend)
    ctx.settle_kv_rewind([1], [1])
    return ctx


def s_prepared(backend):
    """Megatron-Core 0.19's async trio: ``s_decode`` resolved and prepared (the next step's
    rows advanced), its sampled tokens not committed yet."""
    ctx = s_decode(backend)
    ctx.resolve_requests(torch.ones(2, dtype=torch.int32))
    ctx.prepare_requests()
    return ctx


def s_overflow(backend):
    """No paused budget and ``k = 2``: requests 1 and 2 added, request 1 paused by hand
    (0.19's tests write the counts): its blocks overflow the paused budget."""
    ctx = make_ctx(kernel_backend=backend, paused_buffer_size_gb=0.0, num_speculative_tokens=K)
    add(ctx, req(1, 5))
    add(ctx, req(2, 2))
    ctx.paused_request_count = 1
    return ctx


def s_hybrid_slot(backend):
    """``s_hybrid_cached`` with a Mamba slot for request 1's first (cached) block."""
    ctx = s_hybrid_cached(backend)
    ctx.mamba_slot_allocator.allocate_slots_batch([int(ctx.block_table_host[0, 0])])
    return ctx


def _hashed(ctx, hashes):
    """Request 7, two full blocks of new tokens, with 0.19's ``precomputed_block_hashes``."""
    bs = ctx.block_size_tokens
    return DynamicInferenceRequest(
        request_id=7, prompt_tokens=torch.arange(2 * bs + 1) + 200,
        sampling_params=SamplingParams(num_tokens_to_generate=4),
        precomputed_block_hashes=hashes, block_size_tokens=bs)


def s_hybrid_deallocated(backend):
    """``s_hybrid_slot`` after ``deallocate_all_tensors``."""
    ctx = s_hybrid_slot(backend)
    ctx.deallocate_all_tensors()
    return ctx


def s_deallocated(backend):
    ctx = s_prefill(backend)
    ctx.deallocate_all_tensors()
    return ctx


def _tokens(*values, dtype=torch.int64, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


U = "update"
A = "add"
# (id, state, call, error, message pattern, recovery: keep or finish the active requests)
CASES = [
    # ---------------------------------------------------------------- update_requests
    (f"{U}/deallocated", s_deallocated, lambda c: c.update_requests(_tokens(1, 1), _tokens(4, 5)),
     TensorStateDeallocatedError, "deallocated", None),
    (f"{U}/before-initialize-after-add", s_added,
     lambda c: c.update_requests(_tokens(1, 1, 1, dtype=torch.bool), _tokens(4, 5, 6)),
     RuntimeError, "initialize_attention_state", True),
    (f"{U}/mask-list", s_prefill, lambda c: c.update_requests([1, 1], _tokens(4, 5)),
     TypeError, "active_requests_mask", True),
    (f"{U}/mask-shape", s_prefill, lambda c: c.update_requests(_tokens(1), _tokens(4, 5)),
     ValueError, "active_requests_mask", True),
    (f"{U}/mask-float-nan", s_prefill,
     lambda c: c.update_requests(_tokens(1, float("nan"), dtype=torch.float32), _tokens(4, 5)),
     ValueError, "active_requests_mask", True),
    (f"{U}/mask-device", s_prefill,
     lambda c: c.update_requests(_tokens(1, 1, device="meta"), _tokens(4, 5)),
     ValueError, "active_requests_mask", True),
    (f"{U}/mask-value-2", s_prefill, lambda c: c.update_requests(_tokens(1, 2), _tokens(4, 5)),
     ValueError, "active_requests_mask", True),
    (f"{U}/new_tokens-list", s_prefill, lambda c: c.update_requests(_tokens(1, 1), [4, 5]),
     TypeError, "new_tokens", True),
    (f"{U}/new_tokens-float", s_prefill,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(4, 5, dtype=torch.float32)),
     TypeError, "new_tokens", True),
    (f"{U}/new_tokens-bool", s_prefill,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(1, 0, dtype=torch.bool)),
     TypeError, "new_tokens", True),
    *[(f"{U}/new_tokens-{dtype}".replace("torch.", ""), s_prefill,
       lambda c, dtype=dtype: c.update_requests(_tokens(1, 1), _tokens(4, 5, dtype=dtype)),
       TypeError, "new_tokens.*int32 or int64", True)
      for dtype in (torch.uint8, torch.int8, torch.int16)],
    (f"{U}/new_tokens-shape", s_prefill,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(4, 5, 6)), ValueError, "new_tokens", True),
    (f"{U}/new_tokens-device", s_prefill,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(4, 5, device="meta")),
     ValueError, "new_tokens", True),
    (f"{U}/new_tokens-outside-vocab", s_decode,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(4, VOCAB)), ValueError, "new_tokens",
     True),
    (f"{U}/new_tokens-negative", s_decode,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(-1, 4)), ValueError, "new_tokens", True),
    (f"{U}/unknown-chunked-id", s_prefill,
     lambda c: (setattr(c, "chunked_prefill_request_id", 77),
                c.update_requests(_tokens(1, 0), _tokens(4, 5))),
     ValueError, "chunked_prefill_request_id=77", True),
    (f"{U}/no-request-can-run", s_stuck,
     lambda c: c.update_requests(_tokens(1), _tokens(4)), RuntimeError, "no request can run",
     False),
    # Prefix caching: the blocks the step computed are published before the plan and taken
    # back when it raises.
    (f"{U}/prefix-caching-unknown-chunked-id", s_cache_pending,
     lambda c: (setattr(c, "chunked_prefill_request_id", 77),
                c.update_requests(_tokens(1, 1), _tokens(4, 5))),
     ValueError, "chunked_prefill_request_id=77", True),
    (f"{U}/prefix-caching-no-request-can-run", s_cache_stuck,
     lambda c: c.update_requests(_tokens(1), _tokens(4)), RuntimeError, "no request can run",
     False),
    (f"{U}/prefix-caching-mask-shape", s_cache_pending,
     lambda c: c.update_requests(_tokens(1), _tokens(4, 5)), ValueError,
     "active_requests_mask", True),
    # KV groups (docs/SEMANTICS.md §22): the windowed groups' maps, pools and bytes too.
    (f"{U}/kv-groups-prefix-caching-unknown-chunked-id",
     lambda b: s_cache_pending(b, kv_layer_windows=[None, 6]),
     lambda c: (setattr(c, "chunked_prefill_request_id", 77),
                c.update_requests(_tokens(1, 1), _tokens(4, 5))),
     ValueError, "chunked_prefill_request_id=77", True),
    (f"{U}/kv-groups-all-windowed-mask-shape",
     lambda b: s_cache_pending(b, kv_layer_windows=[6, 6]),
     lambda c: c.update_requests(_tokens(1), _tokens(4, 5)), ValueError,
     "active_requests_mask", True),
    # ---------------------------------------------------------------- add_request
    (f"{A}/deallocated", s_deallocated, lambda c: c.add_request(req(9)),
     TensorStateDeallocatedError, "deallocated", None),
    (f"{A}/not-a-request", s_prefill, lambda c: c.add_request(42), TypeError, "req", True),
    (f"{A}/request_id-str", s_prefill, lambda c: c.add_request(req("a", tokens=[1, 2])),
     TypeError, "request_id", True),
    (f"{A}/request_id-negative", s_prefill, lambda c: c.add_request(req(-1)), ValueError,
     "request_id", True),
    (f"{A}/request_id-huge", s_prefill, lambda c: c.add_request(req(2 ** 40)), ValueError,
     "request_id", True),
    (f"{A}/duplicate-id", s_prefill, lambda c: c.add_request(req(1)), ValueError,
     "request_id=1", True),
    (f"{A}/prompt-missing", s_prefill, lambda c: c.add_request(raw(tokens=None)), ValueError,
     "prompt", True),
    (f"{A}/prompt-float-tensor", s_prefill,
     lambda c: c.add_request(raw(tokens=torch.tensor([1.0, 2.0]))), TypeError, "prompt", True),
    (f"{A}/prompt-float-list-not-whole", s_prefill,
     lambda c: c.add_request(raw(tokens=[1.5, 2.0])), ValueError, "prompt", True),
    (f"{A}/prompt-bool-list", s_prefill, lambda c: c.add_request(raw(tokens=[True, False])),
     TypeError, "prompt", True),
    (f"{A}/prompt-2d", s_prefill, lambda c: c.add_request(raw(tokens=torch.tensor([[1, 2]]))),
     ValueError, "prompt", True),
    (f"{A}/prompt-empty", s_prefill,
     lambda c: c.add_request(raw(tokens=torch.tensor([], dtype=torch.int64))), ValueError,
     "prompt", True),
    (f"{A}/prompt-device", s_prefill,
     lambda c: c.add_request(raw(tokens=torch.tensor([1, 2], device="meta"))), ValueError,
     "prompt", True),
    (f"{A}/prompt-negative", s_prefill, lambda c: c.add_request(req(9, tokens=[3, -1])),
     ValueError, "prompt", True),
    (f"{A}/prompt-outside-vocab", s_decode, lambda c: c.add_request(req(9, tokens=[3, VOCAB])),
     ValueError, "vocab", True),
    (f"{A}/chunk_length-0", s_prefill, lambda c: c.add_request(req(9, 4), 0), ValueError,
     "chunk_length", True),
    (f"{A}/chunk_length-too-long", s_prefill, lambda c: c.add_request(req(9, 4), 5), ValueError,
     "chunk_length", True),
    (f"{A}/chunk_length-float", s_prefill, lambda c: c.add_request(req(9, 4), 1.5), ValueError,
     "chunk_length", True),
    (f"{A}/finished_chunk_token_count-negative", s_prefill,
     lambda c: c.add_request(raw(tokens=torch.tensor([1, 2]), finished=-2)), ValueError,
     "finished_chunk_token_count", True),
    (f"{A}/num_tokens_to_generate-None", s_prefill, lambda c: c.add_request(req(9, gen=None)),
     ValueError, "num_tokens_to_generate", True),
    (f"{A}/num_tokens_to_generate-negative", s_prefill, lambda c: c.add_request(req(9, gen=-1)),
     ValueError, "num_tokens_to_generate", True),
    (f"{A}/num_tokens_to_generate-2.5", s_prefill,
     lambda c: c.add_request(_with_gen(req(9), 2.5)), ValueError, "num_tokens_to_generate",
     True),
    (f"{A}/num_tokens_to_generate-str", s_prefill,
     lambda c: c.add_request(_with_gen(req(9), "abc")), TypeError, "num_tokens_to_generate",
     True),
    (f"{A}/max_sequence_length", s_prefill, lambda c: c.add_request(req(9, 65, gen=0)),
     MaxSequenceLengthOverflowError, "max_sequence_length", True),
    (f"{A}/max_tokens", s_prefill, lambda c: c.add_request(req(9, 60, gen=1)),
     TokenOverflowError, "max_tokens", True),
    (f"{A}/max_requests", s_full_rows, lambda c: c.add_request(req(9)), RequestOverflowError,
     "max_requests", True),
    (f"{A}/blocks", s_stuck, lambda c: c.add_request(req(9, 12, gen=1)), BlockOverflowError,
     "blocks", False),
    (f"{A}/top_k-beyond-int32", s_prefill, lambda c: c.add_request(req(9, top_k=2 ** 40)),
     ValueError, "top_k", True),
    (f"{A}/termination_id-beyond-int64", s_prefill,
     lambda c: c.add_request(req(9, termination_id=2 ** 70)), ValueError, "termination_id",
     True),
    (f"{A}/continuation-not-last-row", s_prefill,
     lambda c: c.add_request(raw(tokens=torch.tensor([1, 2]), finished=4)), ValueError,
     "continuation", True),
    (f"{A}/continuation-of-a-decoding-request", s_decode,
     lambda c: c.add_request(raw(rid=2, tokens=torch.tensor([1, 2]), finished=5)), ValueError,
     "decoding", True),
    (f"{A}/continuation-claims-more-than-cached", s_chunked,
     lambda c: c.add_request(_continuation(c, claim=10)), ValueError, "cached", "chunk"),
    (f"{A}/new-request-after-a-hybrid-continuation", s_hybrid_continued,
     lambda c: c.add_request(req(9)), ValueError, "hybrid", True),
    (f"{A}/new-request-while-chunked", s_chunked, lambda c: c.add_request(req(9)), ValueError,
     "chunked", "chunk"),
    # Prefix caching: a hit's checks (the computed part against max_tokens, the salt).
    (f"{A}/prefix-caching-hit-max_tokens", lambda b: s_cache_pending(b, max_tokens=16),
     lambda c: c.add_request(req(9, tokens=T9 + list(range(50, 66)), gen=1)),
     TokenOverflowError, "8 prompt tokens cached", True),
    (f"{A}/kv-groups-prefix-caching-hit-max_tokens",
     lambda b: s_cache_pending(b, max_tokens=16, kv_layer_windows=[6, 6]),
     lambda c: c.add_request(req(9, tokens=T9 + list(range(50, 66)), gen=1)),
     TokenOverflowError, "8 prompt tokens cached", True),
    (f"{A}/prefix-caching-salt-type", s_cache_pending,
     lambda c: c.add_request(_salted(req(9, tokens=T9), [1])), TypeError,
     "prefix_caching_salt", True),
    (f"{A}/prefix-caching-duplicate-id", s_cache_pending,
     lambda c: c.add_request(req(2, tokens=T9)), ValueError, "request_id=2", True),
    (f"{A}/prefix-caching-prompt-outside-vocab", s_cache_pending,
     lambda c: c.add_request(req(9, tokens=T9 + [VOCAB])), ValueError, "vocab", True),
    # Megatron-Core 0.19's names: the chunk length under both names (context/megatron019.py,
    # docs/SEMANTICS.md §16).
    (f"{A}/prefill_chunk_length-and-chunk_length", s_prefill,
     lambda c: c.add_request(req(9), 2, chunk_length=2), TypeError, "not both", True),
    # Megatron-Core 0.19's step API (context/step_api.py, context/async_steps.py).
    ("reset_tensors/with-requests", s_decode, lambda c: c.reset_tensors(), RuntimeError,
     "reset_tensors", True),
    ("initialize/ep-dummy-and-capture", s_decode,
     lambda c: c.initialize_attention_state(
         construct_graph_dimensions=InferenceBatchDimensions(8, 0, 8),
         is_expert_parallel_dummy_cuda_graph_step=True), ValueError, "expert-parallel", True),
    ("initialize/transfer-flag-type", s_decode,
     lambda c: c.initialize_attention_state(transfer_bookkeeping_to_gpu=1), TypeError,
     "transfer_bookkeeping_to_gpu", True),
    ("async/prepare-with-a-prefill", s_added, lambda c: c.prepare_requests(), RuntimeError,
     "decode-only", True),
    ("async/resolve-mask-length", s_decode,
     lambda c: c.resolve_requests(torch.ones(5, dtype=torch.int32)), RuntimeError,
     "Expected active mask of length 2", True),
    ("async/resolve-mask-values", s_decode,
     lambda c: c.resolve_requests(torch.tensor([2, 1])), ValueError, "only 0 and 1", True),
    ("async/resolve-while-chunked", s_chunked,
     lambda c: c.resolve_requests(torch.ones(c.total_request_count, dtype=torch.int32)),
     RuntimeError, "chunked prefill", "chunk"),
    ("async/commit-count", s_decode,
     lambda c: c.commit_sampled_tokens(torch.tensor([5])), RuntimeError,
     "Expected 2 new tokens", True),
    ("async/commit-float", s_decode,
     lambda c: c.commit_sampled_tokens(torch.tensor([5.0, 6.0])), TypeError, "integer", True),
    ("async/commit-drafts-without-k", s_decode,
     lambda c: c.commit_sampled_tokens(torch.tensor([5, 6]), torch.tensor([[1, 2]])),
     RuntimeError, "disabled", True),
    ("rows/swap-drafts-not-2-d", s_decode,
     lambda c: c._swap_book_keeping_tensors(torch.tensor([0]), torch.tensor([1]), None,
                                            new_speculative_tokens=torch.zeros(3)),
     TypeError, "new_speculative_tokens", True),
    # Megatron-Core 0.19's row operations by hand (context/row_ops.py).
    ("rows/release-index-out-of-range", s_prefill,
     lambda c: c.release_memory_blocks_from_request_indexes(torch.tensor([0, 99])), ValueError,
     "max_requests", True),
    ("rows/release-a-row-twice", s_prefill,
     lambda c: c.release_memory_blocks_from_request_indexes([1, 1]), ValueError, "twice", True),
    ("rows/release-float-indexes", s_prefill,
     lambda c: c.release_memory_blocks_from_request_indexes(torch.tensor([0.0])), TypeError,
     "integer", True),
    ("rows/evict-wrong-active-count", s_decode,
     lambda c: c.evict_overflow_paused_requests(5, _tokens(1, 2)), ValueError,
     "active_request_count=5", True),
    ("rows/evict-active-count-type", s_decode,
     lambda c: c.evict_overflow_paused_requests("2", _tokens(1, 2)), TypeError,
     "active_request_count", True),
    # rewind_tokens (docs/SEMANTICS.md §19, "Token rewind", context/token_rewind.py).
    ("rewind_tokens/outside-a-step", s_added, lambda c: c.rewind_tokens([0, 0, 0]),
     RuntimeError, "between initialize_attention_state", True),
    ("rewind_tokens/shape", s_decode, lambda c: c.rewind_tokens(_tokens(1)), ValueError,
     "rewind_counts has shape", True),
    ("rewind_tokens/float", s_decode,
     lambda c: c.rewind_tokens(_tokens(1.0, 0.0, dtype=torch.float32)), TypeError,
     "rewind_counts", True),
    ("rewind_tokens/negative", s_decode, lambda c: c.rewind_tokens(_tokens(-1, 0)), ValueError,
     r"rewind_counts\[0\]=-1", True),
    ("rewind_tokens/every-token", s_decode, lambda c: c.rewind_tokens(_tokens(0, 99)),
     ValueError, r"rewind_counts\[1\]=99 must lie in", True),
    ("rewind_tokens/the-chunked-prefill", s_chunk_in_step,
     lambda c: c.rewind_tokens(_tokens(0, 1)), ValueError, "chunked prefill in flight", True),
    ("rewind_tokens/into-a-published-block", s_cache_pending,
     lambda c: c.rewind_tokens(_tokens(0, 5)), ValueError, "prefix cache published", True),
    ("rewind_tokens/hybrid", s_hybrid_cached, lambda c: c.rewind_tokens(_tokens(1)),
     ValueError, "hybrid", True),
    # Speculative steps (docs/SEMANTICS.md §19): the rewinds' counts and the drafts.
    ("rewind_kv_cache/complex", s_speculative,
     lambda c: c.rewind_kv_cache(torch.zeros(2, dtype=torch.complex64)), TypeError,
     "accepted_counts must be an integer tensor", True),
    ("rewind_kv_cache/meta", s_speculative,
     lambda c: c.rewind_kv_cache(_tokens(0, 0, device="meta")), ValueError,
     "accepted_counts is on the meta device", True),
    ("rewind_tokens/meta", s_speculative,
     lambda c: c.rewind_tokens(_tokens(0, 0, device="meta")), ValueError,
     "rewind_counts is on the meta device", True),
    ("rewind_tokens/ragged", s_speculative, lambda c: c.rewind_tokens([[0], [0, 1]]),
     TypeError, "rewind_counts must be integers of one shape", True),
    ("update/drafts-outside-vocab", s_speculative,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(4, 5), torch.full((K, 2), VOCAB)),
     ValueError, r"new_speculative_tokens holds ids in \[500, 500\], outside \[0, 500\)", True),
    ("update/drafts-negative", s_speculative,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(4, 5), torch.full((K, 2), -1)),
     ValueError, "new_speculative_tokens holds ids in", True),
    ("update/drafts-forwarded-outside-vocab", s_speculative,
     lambda c: c.update_requests(_tokens(1, 1), _tokens(4, 5),
                                 torch.tensor([[3, -1], [VOCAB, -1]]), draft_counts=[2, 0]),
     ValueError, "new_speculative_tokens holds ids in", True),
    ("defer_kv_rewind/complex", s_speculative,
     lambda c: c.defer_kv_rewind(torch.zeros(2, dtype=torch.complex64)), TypeError,
     "accepted_counts must be an integer tensor", True),
    ("defer_kv_rewind/negative-with-validate", s_speculative,
     lambda c: c.defer_kv_rewind(_tokens(-5, 0)), ValueError,
     r"accepted_counts\[0\]=-5 must lie in \[0, num_speculative_tokens=2\]", True),
    ("defer_kv_rewind/beyond-k-with-validate", s_speculative,
     lambda c: c.defer_kv_rewind(_tokens(0, 9)), ValueError,
     r"accepted_counts\[1\]=9 must lie in", True),
    ("settle_kv_rewind/float-ids", s_settling, lambda c: c.settle_kv_rewind([1.5], [1]),
     TypeError, "request_ids must hold integers", True),
    ("settle_kv_rewind/bool-ids", s_settling, lambda c: c.settle_kv_rewind([True], [1]),
     TypeError, "request_ids must hold integers", True),
    ("settle_kv_rewind/str-ids", s_settling, lambda c: c.settle_kv_rewind(["a"], [1]),
     TypeError, "request_ids must hold integers", True),
    ("settle_kv_rewind/huge-id", s_settling, lambda c: c.settle_kv_rewind([2 ** 70], [1]),
     TypeError, "request_ids must hold integers", True),
    ("settle_kv_rewind/counts-meta", s_settling,
     lambda c: c.settle_kv_rewind([1], _tokens(1, device="meta")), ValueError,
     "rejected_counts is on the meta device", True),
    ("settle_kv_rewind/an-id-twice", s_settling, lambda c: c.settle_kv_rewind([1, 1], [1, 1]),
     ValueError, "request 1 is settled twice in this step", True),
    ("settle_kv_rewind/again-in-the-step", s_settled, lambda c: c.settle_kv_rewind([1], [1]),
     ValueError, "request 1 is settled twice in this step", True),
    # Megatron-Core 0.19's Mamba slots: a slot only for a cached block (mamba_slot_allocator).
    ("mamba_slots/allocate-an-uncached-block", s_hybrid_cached,
     lambda c: c.mamba_slot_allocator.allocate_slots_batch(
         [int(c.block_table_host[0, 0]), int(c.block_table_host[0, 2])]), ValueError,
     "not a cached prompt block", True),
    ("mamba_slots/store-without-a-slot", s_hybrid_cached,
     lambda c: c.mamba_slot_allocator.store_from_tensors(
         int(c.block_table_host[0, 0]), 0, torch.zeros(2, 3, 5), torch.zeros(6, 4)),
     ValueError, "no Mamba cache slot", True),
    ("mamba_slots/allocate-a-str", s_hybrid_cached,
     lambda c: c.mamba_slot_allocator.allocate_slots_batch(["a"]), TypeError,
     "block_ids must hold integer block ids", True),
    ("mamba_slots/store-layer-negative", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_tensors(
         int(c.block_table_host[0, 0]), -1, torch.zeros(2, 3, 5), torch.zeros(6, 4)),
     ValueError, r"layer_idx=-1 must be an int in \[0, 1\)", True),
    ("mamba_slots/store-a-broadcast", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_tensors(
         int(c.block_table_host[0, 0]), 0, torch.tensor(1.0), torch.zeros(6, 4)),
     ValueError, r"ssm_state must be a floating tensor of shape \[2, 3, 5\]", True),
    ("mamba_slots/live-slot-beyond", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_live_batch([99], [0]), ValueError,
     r"slots=\[99\]: each must lie in \[0, max_slots=3\)", True),
    ("mamba_slots/live-lengths", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_live_batch([0, 1], [0]), ValueError,
     "slots has 2 entries, request_indices 1", True),
    ("mamba_slots/live-row-free", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_live_batch([0], [5]), ValueError,
     r"request_indices=\[5\]: each must be a live row", True),
    ("mamba_slots/restore-row-negative", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.restore_to_live(-1, int(c.block_table_host[0, 0])),
     ValueError, r"request_idx=\[-1\]: each must be a live row", True),
    ("mamba_slots/register-lengths", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.register_block_hashes_batch([1, 2], [5]), ValueError,
     "hashes has 1 entries, block_ids 2", True),
    ("mamba_slots/invalidate-a-float", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.invalidate_block(int(c.block_table_host[0, 0]) + 0.5),
     TypeError, r"block_id=\d+\.5 must be an int", True),
    ("mamba_slots/restore-block-str", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.restore_to_live(0, "x"), TypeError,
     "block_id='x' must be an int", True),
    ("mamba_slots/store-complex", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_tensors(
         int(c.block_table_host[0, 0]), 0, torch.zeros(2, 3, 5, dtype=torch.complex64),
         torch.zeros(6, 4)), ValueError, r"ssm_state must be a floating tensor.*complex64",
     True),
    ("mamba_slots/store-int", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_tensors(
         int(c.block_table_host[0, 0]), 0, torch.zeros(2, 3, 5),
         torch.zeros(6, 4, dtype=torch.int64)), ValueError,
     r"conv_state must be a floating tensor.*int64", True),
    ("mamba_slots/live-a-slot-twice", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.store_from_live_batch([0, 0], [0, 0]), ValueError,
     r"slots=\[0, 0\]: each must lie in \[0, max_slots=3\), each once", True),
    ("mamba_slots/register-a-str-hash", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.register_block_hashes_batch(
         [int(c.block_table_host[0, 0])], ["x"]), TypeError, "hashes must hold integer", True),
    ("mamba_slots/offsets-row-negative", s_hybrid_slot,
     lambda c: c.mamba_slot_allocator.compute_and_store_offsets(req(5, 9), -1, 0, 9, 0, [], 3),
     ValueError, r"current_id=-1 must be a row in \[0, max_requests=", True),
    ("mamba_slots/live-deallocated", s_hybrid_deallocated,
     lambda c: c.mamba_slot_allocator.store_from_live_batch([0], [0]),
     TensorStateDeallocatedError, "deallocated", True),
    ("mamba_slots/restore-deallocated", s_hybrid_deallocated,
     lambda c: c.mamba_slot_allocator.restore_to_live(0, 0), TensorStateDeallocatedError,
     "deallocated", True),
    ("mamba_slots/offsets-deallocated", s_hybrid_deallocated,
     lambda c: c.mamba_slot_allocator.compute_and_store_offsets(req(5, 9), 0, 0, 9, 0, [], 3),
     TensorStateDeallocatedError, "deallocated", True),
    # Megatron-Core 0.19's allocator (kv_block_allocator): counts and hashes.
    ("kv_block_allocator/evict-negative", s_cache_pending,
     lambda c: c.kv_block_allocator.evict_lru_blocks(-1), ValueError,
     "num_blocks_needed=-1 must be >= 0", True),
    ("kv_block_allocator/evict-float", s_cache_pending,
     lambda c: c.kv_block_allocator.evict_lru_blocks(1.5), TypeError,
     "num_blocks_needed=1.5 must be an int", True),
    ("kv_block_allocator/evict-str", s_cache_pending,
     lambda c: c.kv_block_allocator.evict_lru_blocks("1"), TypeError,
     "num_blocks_needed='1' must be an int", True),
    ("kv_block_allocator/available-negative-matches", s_cache_pending,
     lambda c: c.kv_block_allocator.is_memory_available(1, potential_matched_count=-100),
     ValueError, "potential_matched_count=-100 must be >= 0", True),
    ("kv_block_allocator/register-hash-minus-1", s_cache_pending,
     lambda c: c.kv_block_allocator.register_kv_block_hashes(
         [int(c.kv_block_allocator.block_bag[0])], [-1]), ValueError,
     r"block_hashes=\[-1\]: each must be >= 1", True),
    ("kv_block_allocator/timestamps-negative-block", s_cache_pending,
     lambda c: c.kv_block_allocator.update_timestamps([-1]), ValueError,
     r"block_ids=\[-1\]: each must lie in", True),
    ("kv_block_allocator/register-a-block-twice", s_cache_pending,
     lambda c: c.kv_block_allocator.register_kv_block_hashes(
         [int(c.kv_block_allocator.block_bag[0])] * 2, [5, 6]), ValueError,
     "each block at most once", True),
    ("kv_block_allocator/register-negative-parent", s_cache_pending,
     lambda c: c.kv_block_allocator.register_kv_block_hashes(
         [int(c.kv_block_allocator.block_bag[0])], [5], [-3]), ValueError,
     r"parent_hashes=\[-3\]: each must be >= 0", True),
    ("block_allocator/release-more-than-referenced", s_decode,
     lambda c: c.block_allocator.release_memory_blocks([int(c.block_table_host[0, 0])] * 2),
     RuntimeError, r"2\] times, more than their references \[1\]", True),
    ("block_allocator/release-negative-id", s_decode,
     lambda c: c.block_allocator.release_memory_blocks([-2]), ValueError,
     r"release of block ids \[-2\]: each must lie in \[0, total_count\)", True),
    # The async trio's sampled tokens: integer ids of the vocabulary (validate).
    ("async/commit-bool", s_prepared,
     lambda c: c.commit_sampled_tokens(_tokens(1, 0, dtype=torch.bool)), TypeError,
     r"sampled tokens must be an integer \(int32 or int64\)", True),
    ("async/commit-outside-vocab", s_prepared,
     lambda c: c.commit_sampled_tokens(_tokens(5, VOCAB)), ValueError,
     r"sampled tokens holds ids in \[5, 500\], outside \[0, 500\)", True),
    ("async/copy-negative", s_prepared,
     lambda c: c.copy_async_sched_sample_to_forward(_tokens(-1, 6)), ValueError,
     "sampled tokens holds ids in", True),
    ("async/copy-meta", s_prepared,
     lambda c: c.copy_async_sched_sample_to_forward(torch.empty(2, dtype=torch.int64,
                                                                device="meta")),
     ValueError, "sampled tokens are on meta, the context on cpu", True),
    ("async/resolve-mask-2-d", s_decode,
     lambda c: c.resolve_requests(torch.ones(1, 2, dtype=torch.int32)), RuntimeError,
     r"Expected active mask of length 2, got shape \(1, 2\)", True),
    ("async/resolve-mask-meta", s_decode,
     lambda c: c.resolve_requests(torch.ones(2, dtype=torch.int32, device="meta")), ValueError,
     "active_requests_mask is on meta", True),
    # Megatron-Core 0.19's eviction moves the caller's tensors: checked before anything moves.
    ("rows/evict-drafts-too-few-columns", s_overflow,
     lambda c: c.evict_overflow_paused_requests(1, _tokens(50, 51),
                                                torch.zeros(K, 1, dtype=torch.int64)),
     ValueError, r"new_speculative_tokens has shape \(2, 1\)", "evict"),
    ("rows/evict-next-tokens-list", s_overflow,
     lambda c: c.evict_overflow_paused_requests(1, [50, 51]), TypeError,
     "next_tokens must be a torch.Tensor", "evict"),
    ("rows/evict-next-tokens-short", s_overflow,
     lambda c: c.evict_overflow_paused_requests(1, _tokens(50)), ValueError,
     r"next_tokens has shape \(1,\)", "evict"),
    ("rows/move-drafts-given-as-swap", s_speculative,
     lambda c: c._move_book_keeping_tensors(torch.tensor([0]), torch.tensor([1]), _tokens(7, 8),
                                            torch.zeros(K, 2, dtype=torch.int64)), TypeError,
     "swap must be a bool, got Tensor", True),
    # 0.19's precomputed_block_hashes name the blocks the add publishes: each in [1, 2**63).
    ("add/precomputed-hash-negative", s_cache_pending,
     lambda c: c.add_request(_hashed(c, [-5, -6])), ValueError,
     r"precomputed_block_hashes=\[-5, -6\]: each must be an int in \[1, 2\*\*63 - 1\]", True),
    ("add/precomputed-hash-float", s_cache_pending,
     lambda c: c.add_request(_hashed(c, [5.5, 6.5])), ValueError,
     r"precomputed_block_hashes=\[5.5, 6.5\]", True),
    ("add/precomputed-hash-str", s_cache_pending,
     lambda c: c.add_request(_hashed(c, ["x", "y"])), ValueError,
     r"precomputed_block_hashes=\['x', 'y'\]", True),
    # reset's flags, and the queries' request.
    ("reset/preserve_prefix_cache-str", s_cache_pending,
     lambda c: c.reset(preserve_prefix_cache="no"), TypeError,
     "preserve_prefix_cache must be a bool", True),
    ("reset/preserve_counters-int", s_decode, lambda c: c.reset(preserve_counters=1), TypeError,
     "preserve_counters must be a bool", True),
    ("prefix_cache_lookup/not-a-request", s_cache_pending, lambda c: c.prefix_cache_lookup(42),
     TypeError, "req must be a DynamicInferenceRequest, got int", True),
    ("check_availability/None", s_prefill, lambda c: c.check_availability(None), TypeError,
     "req must be a DynamicInferenceRequest, got NoneType", True),
    ("log_probs/only_last_token_logits-str", s_prefill,
     lambda c: c.calculate_log_probs(torch.zeros(1, c.padded_active_token_count, VOCAB),
                                     _tokens(4, 5), only_last_token_logits="no"), TypeError,
     "only_last_token_logits='no' must be a bool or None", True),
    ("input_ids/warmup-float", s_prefill,
     lambda c: c.current_input_and_position_ids(num_warmup_tokens=2.5), TypeError,
     "num_warmup_tokens=2.5 must be an int or None", True),
    ("input_ids/warmup-bool", s_prefill,
     lambda c: c.current_input_and_position_ids(num_warmup_tokens=True), TypeError,
     "num_warmup_tokens=True must be an int or None", True),
    # Megatron-Core 0.19's processed log probs need a sampling backend (context/sampling.py).
    ("log_probs/backend-gives-a-wrong-shape", s_processed,
     lambda c: c.calculate_log_probs(torch.zeros(1, c.padded_active_token_count, VOCAB),
                                     _tokens(4, 5), sampling=SimpleNamespace(
                                         log_probs_kernel=lambda rows, *a, **k: rows[:1])),
     ValueError, r"sampling.log_probs_kernel returned \(1, 500\) torch.float32, expected",
     True),
    ("log_probs/backend-gives-integers", s_processed,
     lambda c: c.calculate_log_probs(torch.zeros(1, c.padded_active_token_count, VOCAB),
                                     _tokens(4, 5), sampling=SimpleNamespace(
                                         log_probs_kernel=lambda rows, *a, **k: rows.long())),
     ValueError, r"returned \(8, 500\) torch.int64, expected a floating \[8, 500\]", True),
    ("log_probs/processed-without-sampling", s_processed,
     lambda c: c.calculate_log_probs(torch.zeros(1, c.padded_active_token_count, VOCAB),
                                     _tokens(4, 5)), ValueError, "sampling backend", True),
]


def _with_gen(r, gen):
    r.sampling_params.num_tokens_to_generate = gen  # past SamplingParams' own check
    return r


def _continuation(ctx, claim):
    r = ctx._chunked
    return raw(rid=3, tokens=r.prompt_tokens[claim:], finished=claim, gen=8)


def _recover(ctx, recovery):
    """One valid step after the error."""
    if recovery == "evict":   # the hand-written overflow: the valid eviction
        evicted = ctx.evict_overflow_paused_requests(
            1, torch.tensor([50, 51]), torch.zeros(K, 2, dtype=torch.int64))
        assert evicted.tolist() == [1]
        return
    if recovery == "chunk":
        r = ctx._chunked
        add(ctx, raw(rid=3, tokens=r.prompt_tokens[8:], finished=8, gen=8))
        ctx.chunked_prefill_request_id = -1
        recovery = True
    _step(ctx, keep=recovery)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state,call,error,match,recovery",
                         [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_error_leaves_context_unchanged_and_next_step_works(backend, state, call, error, match,
                                                            recovery):
    ctx = state(backend)
    allocated = ctx.is_tensor_state_allocated
    before = snapshot(ctx, device=allocated)
    with pytest.raises(error, match=match):
        call(ctx)
    if ctx.chunked_prefill_request_id == 77:
        ctx.chunked_prefill_request_id = -1  # the case set it; the context must not have moved
    assert_same(before, snapshot(ctx, device=allocated))
    if not allocated:
        ctx.allocate_all_tensors(is_init=False)
        add(ctx, req(1, 3))
        recovery = True
    _recover(ctx, recovery)
    check_invariants(ctx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_that_requires_grad_is_written_detached(backend):
    """K/V that require grad are written (both), and the cache keeps no autograd graph."""
    ctx = s_prefill(backend)
    n = ctx.padded_active_token_count
    key = torch.randn(n, 2, 8, requires_grad=True)
    value = torch.randn(n, 1, 2, 8, requires_grad=True)
    ctx.append_key_value_cache(1, key * 2, value * 3)
    k_cache, v_cache = ctx.key_value_cache(1)
    assert not ctx.memory_buffer.requires_grad and ctx.memory_buffer.grad_fn is None
    blocks = ctx.token_to_block_idx[:ctx.active_token_count]
    slots = ctx.token_to_local_position_within_kv_block[:ctx.active_token_count]
    active = ctx.active_token_count
    assert torch.equal(k_cache[blocks, slots], (key * 2).detach()[:active])
    assert torch.equal(v_cache[blocks, slots], (value * 3).detach()[:active, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_request_kept_past_max_sequence_length_is_finished_and_reported(backend):
    """The update that would give a kept request a token beyond max_sequence_length finishes it
    instead (its blocks freed, its id in max_length_finished_request_ids), decided before
    anything changes; the other request runs on, and the next step is valid."""
    ctx = s_long(backend)
    assert ctx.host_request_ids().tolist() == [1, 2] and ctx.kv_block_counts_host[0] == 4
    _step(ctx)
    assert ctx.max_length_finished_request_ids.tolist() == [1]
    assert ctx.host_request_ids().tolist() == [2]
    # Request 1's 4 blocks are free again: only request 2's are in use.
    assert ctx.block_allocator.get_total_used() == ctx.kv_block_counts_host[0] == 2
    check_invariants(ctx)
    _step(ctx)
    assert ctx.max_length_finished_request_ids.tolist() == []
    assert ctx.host_request_ids().tolist() == [2]
    check_invariants(ctx)


def test_plans_are_pure_under_memory_pressure():
    """``plan_update`` and ``plan_add`` change nothing, whatever they decide (finish, pause,
    resume, evict); the update that follows applies exactly one plan."""
    ctx = make_ctx(buffer_size_gb=16 * BLOCK / GIB, paused_buffer_size_gb=2 * BLOCK / GIB,
                   max_requests=8, max_tokens=64)
    gen = torch.Generator().manual_seed(3)
    rid, paused_steps, evicted = 0, 0, 0
    for step_index in range(30):
        while ctx.total_request_count < 8 and ctx.paused_request_count == 0:
            rid += 1
            r = req(rid, int(torch.randint(1, 12, (1,), generator=gen)), gen=20)
            if not all(ctx.check_availability(r)):
                break
            before = snapshot(ctx, device=True)
            ctx._table.plan_add(r, None, max_sequence_length=ctx.max_sequence_length,
                                metadata_types=ctx.request_metadata_types, device=ctx.device,
                                vocab_size=None)
            assert_same(before, snapshot(ctx, device=True))
            add(ctx, r)
        ctx.initialize_attention_state()
        active = ctx.total_request_count - ctx.paused_request_count
        mask = torch.rand(active, generator=gen) > 0.15
        before = snapshot(ctx, device=True)
        for _ in range(2):
            ctx._table.plan_update(mask.numpy(), chunked_id=-1,
                                   max_sequence_length=ctx.max_sequence_length)
        assert_same(before, snapshot(ctx, device=True))
        ctx.update_requests(mask, torch.arange(active) + step_index)
        check_invariants(ctx)
        paused_steps += ctx.paused_request_count > 0
        evicted += len(ctx.evicted_request_ids)
    assert paused_steps >= 5 and evicted >= 3  # the workload really pauses and evicts


OFFLOAD_OPTION_ERRORS = [
    pytest.param(dict(kv_offload_gb=-1.0), ValueError, r"kv_offload_gb=-1.0 must be a finite "
                 r"number >= 0", id="negative"),
    pytest.param(dict(kv_offload_gb=float("nan")), ValueError, r"kv_offload_gb=nan must be",
                 id="nan"),
    pytest.param(dict(kv_offload_gb=float("inf")), ValueError, r"kv_offload_gb=inf must be",
                 id="inf"),
    pytest.param(dict(kv_offload_gb="1"), TypeError, r"kv_offload_gb='1' must be a number",
                 id="string"),
    pytest.param(dict(kv_offload_gb=True), TypeError, r"kv_offload_gb=True must be a number",
                 id="bool"),
    pytest.param(dict(kv_offload_gb=BLOCK / GIB / 2), ValueError, r"holds no KV block",
                 id="under_one_block"),
    pytest.param(dict(kv_offload_gb=np.complex128(1)), TypeError,
                 r"kv_offload_gb=np.complex128\(1\+0j\) must be a number", id="complex"),
    pytest.param(dict(kv_offload_gb=1e9), ValueError, r"kv_offload_gb=1000000000.0 asks for "
                 r".* of host memory, but the host has .* available", id="beyond_the_host"),
    pytest.param(dict(kv_cache_management_mode="swap"), ValueError,
                 r"kv_cache_management_mode='swap' must be one of \['persist', 'offload', "
                 r"'recompute'\]", id="unknown_mode"),
    pytest.param(dict(kv_cache_management_mode=3), ValueError,
                 r"kv_cache_management_mode=3 must be one of", id="mode_not_a_string"),
    pytest.param(dict(prefix_caching_host_tier="yes"), TypeError,
                 r"prefix_caching_host_tier='yes' must be a bool or None", id="tier_not_a_bool"),
    pytest.param(dict(prefix_caching_host_tier=True, kv_offload_gb=1e-3), ValueError,
                 r"prefix_caching_host_tier=True needs enable_prefix_caching=True",
                 id="tier_without_prefix_caching"),
    pytest.param(dict(prefix_caching_host_tier=True, enable_prefix_caching=True), ValueError,
                 r"prefix_caching_host_tier=True needs a host pool: kv_offload_gb=0.0 must be "
                 r"> 0 \(or kv_cache_management_mode='offload'\)", id="tier_without_a_pool"),
]


@pytest.mark.parametrize("options, error, match", OFFLOAD_OPTION_ERRORS)
def test_bad_offload_options_raise_naming_the_argument(options, error, match):
    with pytest.raises(error, match=match):
        make_ctx(**options)


def test_offload_modes_accept_the_enum_and_size_a_default_pool():
    from dynctx.context.config import KVCacheManagementMode

    ctx = make_ctx(kv_cache_management_mode=KVCacheManagementMode.OFFLOAD)
    assert ctx.kv_cache_management_mode == "offload"
    # OFFLOAD without kv_offload_gb: a host block for every device block.
    stats = ctx.get_kv_offload_stats()
    assert stats["kv_offload_host_blocks"] == ctx.block_allocator.total_count - 1
    assert make_ctx(kv_cache_management_mode="PERSIST").get_kv_offload_stats() == {}
    assert make_ctx().kv_cache_management_mode == "recompute"


def test_failed_add_of_a_saved_request_keeps_its_host_copy():
    """An ``add_request`` that raises (here: too few free blocks) leaves the host copy where it
    was, and the next add restores it."""
    ctx = make_ctx(buffer_size_gb=16 * BLOCK / GIB, paused_buffer_size_gb=2 * BLOCK / GIB,
                   max_requests=8, max_tokens=64, kv_offload_gb=32 * BLOCK / GIB)
    rid, evicted = 0, []
    for step_index in range(40):
        while ctx.total_request_count < 8 and ctx.paused_request_count == 0:
            rid += 1
            r = req(rid, 6, gen=30)
            if not all(ctx.check_availability(r)):
                break
            add(ctx, r)
        _step(ctx)
        evicted += ctx.evicted_request_ids.tolist()
        if evicted:
            break
    assert evicted, "the workload should evict"
    offload = ctx._parts.offload
    entry = offload.entries[evicted[0]]
    tokens = entry.tokens
    again = req(evicted[0], tokens + 1, gen=4)
    hog = ctx.block_allocator.total_avail
    taken = ctx.block_allocator.allocate_memory_blocks(hog)   # nothing free now
    before = snapshot(ctx, device=True)
    with pytest.raises(BlockOverflowError):
        ctx.add_request(again)
    assert_same(before, snapshot(ctx, device=True))
    assert offload.entries[evicted[0]] is entry
    offload.check()
    ctx.block_allocator.release_memory_blocks(taken)
    assert ctx.prefix_cache_lookup(again) == tokens
    while ctx.total_request_count:   # room for it: every request finishes
        _step(ctx, keep=False)
    ctx.add_request(again)
    assert evicted[0] not in offload.entries
    assert ctx.get_kv_offload_stats()["kv_offload_restored_tokens"] == tokens
    offload.check()
