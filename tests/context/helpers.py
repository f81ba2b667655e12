"""Helpers shared by the context tests: a small context, requests, one engine step, snapshots of
the observable state and the invariants every state must satisfy."""

from __future__ import annotations

import numpy as np
import torch
from sizing_warning import built

from dynctx.context import DynamicInferenceContext, DynamicInferenceRequest, SamplingParams
from dynctx.context.dynamic_context import FIELD_BLOCKS

GIB = 1024 ** 3
BLOCK = 4 * 2 * 2 * 4 * 2 * 8  # fp32, K and V, 2 layers, 4 tokens, 2 heads, dim 8

# The per-request fields the context exposes as views ``[max_requests]``, in field order (rows
# 0..6 of the packed table).
FIELD_NAMES = ("request_ids", "request_query_lengths", "request_output_lengths",
               "request_kv_length_offsets", "request_kv_block_counts",
               "request_last_kv_block_id", "request_last_kv_block_offset")
TOKEN_NAMES = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
               "token_to_block_idx", "token_to_position_in_request",
               "token_to_local_position_within_kv_block")


def context_args(**overrides) -> dict:
    """The arguments of a small fp32 context: 2 layers, 2 heads of 8, block 4 tokens (BLOCK
    bytes per block)."""
    args = dict(params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
                max_sequence_length=64, buffer_size_gb=40 * BLOCK / GIB,
                paused_buffer_size_gb=8 * BLOCK / GIB, block_size_tokens=4, max_tokens=64,
                max_requests=8, unified_memory_level=0, device="cpu")
    args.update(overrides)
    return args


def make_ctx(**overrides) -> DynamicInferenceContext:
    """The small context of ``context_args(**overrides)``, its sizing warning asserted where
    small buffers provoke it (``sizing_warning.built``)."""
    return built(lambda: DynamicInferenceContext(**context_args(**overrides)))


def request(rid: int, length: int, gen: int = 8,
            termination_id: int = -1) -> DynamicInferenceRequest:
    return DynamicInferenceRequest(
        request_id=rid, prompt_tokens=torch.arange(100 + rid, 100 + rid + length),
        sampling_params=SamplingParams(num_tokens_to_generate=gen, termination_id=termination_id))


def add(ctx, req, chunk_length=None):
    """``add_request`` and advance the request's chunk bookkeeping, as the engine does."""
    ctx.add_request(req, chunk_length)
    chunk = chunk_length or req.remaining_prompt_length
    req.remaining_prompt_tokens = req.remaining_prompt_tokens[chunk:]
    req.finished_chunk_token_count += chunk


def step(ctx, finished_ids=()):
    """One step: metadata, then every active request samples its id * 10 + step-ish token."""
    ctx.initialize_attention_state()
    P, T = ctx.paused_request_count, ctx.total_request_count
    ids = ctx.host_request_ids()[P:T]
    mask = torch.tensor([int(i) not in set(finished_ids) for i in ids], dtype=torch.bool)
    tokens = torch.tensor([int(i) * 10 + 1 for i in ids], dtype=torch.int64)
    return ctx.update_requests(mask, tokens)


def _np(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy().copy()


def snapshot(ctx, device: bool = False) -> dict:
    """Everything observable that bad input must not change.

    With ``device=True`` also the device mirrors (block table, per-request fields, metadata,
    pending tokens), the step's token arrays and attention metadata, and the KV buffer's bytes.
    Reading the device views uploads staged host writes first, which changes nothing observable;
    the step's token arrays are read from the device state, without building a step.
    """
    alloc = ctx.block_allocator
    counts = (ctx.paused_request_count, ctx.total_request_count, ctx.active_token_count,
              ctx.num_prefill_requests, ctx.chunked_prefill_request_id, alloc.total_avail)
    state = dict(counts=counts, bag=alloc.block_bag.copy(), refs=alloc.ref_counts.copy(),
                 live=set(ctx._live_ids), allocated=ctx.is_tensor_state_allocated)
    cache = getattr(ctx, "prefix_cache", None)
    if cache is not None:
        # Prefix caching: the digest table, the pending chains, the cached marks, the idle
        # section and the counters.
        state.update(prefix_entries=dict(cache.entries),
                     prefix_pending={rid: (p.links, p.published)
                                     for rid, p in cache.pending.items()},
                     prefix_cached=alloc.cached.copy(), prefix_idle=alloc.idle_count,
                     prefix_stats=cache.stats.as_dict(),
                     prefix_snapshots=None if cache.mamba is None else dict(cache.mamba.index))
    for g, group in enumerate(getattr(ctx._kv, "groups", ()), start=1):
        # KV groups: each windowed group's map, pool and idle copies.
        state.update({f"kv_group{g}_map": group.map.copy(),
                      f"kv_group{g}_free": group.free[:group.free_count].copy(),
                      f"kv_group{g}_idle": group.idle_since.copy()})
    if not ctx.is_tensor_state_allocated:
        return state
    T = ctx.total_request_count
    state.update(fields=ctx._h_req[:, :T].copy(), table=ctx.block_table_host[:T].copy())
    if device:
        P = ctx.paused_request_count
        # The device mirrors themselves (on a CPU device the public views are host arrays).
        mirrors = ctx._device.mirrors(ctx._table)
        state["device_table"] = _np(mirrors["block_table"])
        state["device_fields"] = _np(mirrors["req"][:len(FIELD_NAMES), :T])
        state["device_metadata"] = {label: _np(value[:T])
                                    for label, value in mirrors["metadata"].items()}
        state["paused_tokens"] = None if P == 0 else _np(ctx.paused_tokens)
        # The device buffers themselves: reading ctx.token_to_* before a step would build it.
        state["tokens"] = np.stack([_np(getattr(ctx._device, name)) for name in TOKEN_NAMES])
        meta = ctx.active_attn_metadata
        state["attention"] = None if meta is None else (
            ctx.padded_active_token_count, ctx.padded_active_request_count,
            meta.max_seqlen_q, meta.max_seqlen_k, _np(meta.cu_query_seq_lengths),
            _np(meta.cu_kv_seq_lengths), _np(meta.kv_seq_lengths), _np(meta.block_table))
        state["kv_bytes"] = ctx.memory_buffer.detach().reshape(-1).view(torch.uint8).clone()
        for g, cache in enumerate(getattr(ctx._kv, "caches", ())[1:], start=1):
            state[f"kv_group{g}_bytes"] = cache.buffer.detach().reshape(-1).view(
                torch.uint8).clone()
    return state


def assert_same(a: dict, b: dict) -> None:
    """The two snapshots agree on every key both hold."""
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f"{key} changed"
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{key} changed"
        elif key == "attention" and x is not None and y is not None:
            assert x[:4] == y[:4], "attention metadata changed"
            assert all(np.array_equal(p, q) for p, q in zip(x[4:], y[4:])), \
                "attention metadata changed"
        elif key == "device_metadata":
            assert x.keys() == y.keys()
            assert all(np.array_equal(x[k], y[k]) for k in x), "request metadata changed"
        else:
            assert x == y, f"{key} changed: {x!r} -> {y!r}"


def check_invariants(ctx) -> None:
    """Every block is free or owned by exactly one live request; device mirrors the host."""
    T = ctx.total_request_count
    table = ctx.block_table_host
    owned = table[:T][table[:T] >= 0]
    alloc = ctx.block_allocator
    if getattr(ctx, "prefix_cache", None) is not None:
        # Shared prefix blocks: one reference per block-table entry holding the block.
        holders = np.bincount(owned, minlength=alloc.total_count)
        assert np.array_equal(alloc.ref_counts, holders), "reference counts != holdings"
        owned = np.unique(owned)
    assert owned.size == np.unique(owned).size, "a block is owned twice"
    assert np.all(table[T:] == -1)
    free = alloc.block_bag[:alloc.total_avail]
    assert np.intersect1d(free, owned).size == 0
    assert owned.size + alloc.total_avail == alloc.total_count - 1, "blocks leaked"
    counts = ctx.kv_block_counts_host[:T]
    assert np.array_equal((table[:T] >= 0).sum(axis=1), counts)
    # The device mirrors themselves (on a CPU device the public views are the host arrays).
    mirrors = ctx._device.mirrors(ctx._table)
    assert np.array_equal(mirrors["block_table"].cpu().numpy(), table)
    assert np.array_equal(mirrors["req"][FIELD_BLOCKS, :T].cpu().numpy(), counts)
