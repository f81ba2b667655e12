"""The steady decode update (``update_plan.plan_decode``, ``RequestTable.commit_decode``,
``DeviceState.apply_decode``) against the general path (``plan_update``, ``commit_update``,
``apply_update``): two contexts driven in lockstep by the same seeded random workload, one with
the shortcut (the default) and one without (``_decode_shortcut = False``), compared in full after
every call: every host row, the request metadata, the block table, the allocator's stack and
reference counts, the live ids and counters, the device block tables and pending tokens, the
step's token arrays and attention metadata, and what ``update_requests`` returns and reports.

The workloads use 4-token blocks, so that requests fill their last block every few steps (the
shortcut's pause-and-resume), and budgets small enough that requests also pause for good and are
evicted (the general path); chunked prefills, finishes and ``max_sequence_length`` finishes mix
in. Each run also counts how often each path decided, so that neither is left untested.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, assert_same, check_invariants, make_ctx, snapshot
from triton_marks import needs_triton

from dynctx.context import DynamicInferenceRequest, SamplingParams, update_plan

WORKLOADS = {
    # Plenty of blocks: nearly every update is a decode update, with block crossings.
    "roomy": dict(buffer_size_gb=120 * BLOCK / GIB, paused_buffer_size_gb=8 * BLOCK / GIB,
                  max_requests=16, max_tokens=64, max_sequence_length=64),
    # Tight: crossings that cannot all resume, pauses for good and evictions.
    "tight": dict(buffer_size_gb=24 * BLOCK / GIB, paused_buffer_size_gb=3 * BLOCK / GIB,
                  max_requests=12, max_tokens=48, max_sequence_length=40),
}


def full_state(ctx) -> dict:
    """``helpers.snapshot(device=True)`` plus every row of the host table and the device
    buffers, the table's counters and the allocator."""
    state = snapshot(ctx, device=True)
    # Nothing writes K/V here, and the buffer starts uninitialised (torch.empty).
    del state["kv_bytes"]
    table, device, alloc = ctx._table, ctx._device, ctx.block_allocator
    state.update(
        all_rows=table.rows.copy(), all_blocks=table.block_table.copy(),
        metadata={label: values.copy() for label, values in table.metadata.items()},
        table_counts=(table.paused, table.total, table.active_tokens, table.num_prefill,
                      table.fed_decode, table.continuation_added, table.partial_id,
                      table.dirty_from, alloc.total_avail, alloc.active_count,
                      alloc.paused_count, device.current, tuple(device.rows_used)),
        device_tables=torch.stack([t.clone() for t in device.block_tables]),
        device_tokens=torch.stack([t.clone() for t in device.next_tokens]),
        device_req=device.arena.device["req"].clone(),
        device_drafts=None if device.spec is None else device.spec.drafts.clone(),
        step_counts=(ctx.padded_active_token_count, ctx.padded_active_request_count,
                     ctx.using_cuda_graph_this_step() if ctx.is_tensor_state_allocated else None),
    )
    return state


def assert_equal_states(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys()
    for key in ("all_rows", "all_blocks", "device_tables", "device_tokens", "device_req",
                "device_drafts"):
        x, y = a.pop(key), b.pop(key)
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y)
        assert same, f"{where}: {key} differs"
    for label in a["metadata"]:
        assert np.array_equal(a["metadata"][label], b["metadata"][label]), \
            f"{where}: metadata {label} differs"
    a.pop("metadata"), b.pop("metadata")
    try:
        assert_same(a, b)
    except AssertionError as error:
        raise AssertionError(f"{where}: {error}") from None


class _Counting:
    """Counts the plans made: decode plans (and those with rows that start a block), and
    general plans (of both contexts)."""

    def __init__(self, monkeypatch):
        self.decode = self.crossing = self.general = 0
        real_decode, real_update = update_plan.plan_decode, update_plan.plan_update

        def counted_decode(table, **kwargs):
            plan = real_decode(table, **kwargs)
            if plan is not None:
                self.decode += 1
                self.crossing += plan.full is not None
            return plan

        def counted_update(table, mask, **kwargs):
            self.general += 1
            return real_update(table, mask, **kwargs)

        monkeypatch.setattr("dynctx.context.request_table.plan_decode", counted_decode)
        monkeypatch.setattr("dynctx.context.request_table.plan_update", counted_update)


def _request(rid: int, length: int, gen: int, shared: bool = False) -> DynamicInferenceRequest:
    """Metadata of every size differs per request, so that a row moved wrong shows.
    ``shared``: the prompt starts with one of three 8-token prefixes (prefix cache hits)."""
    prompt = torch.arange(100 + rid, 100 + rid + length)
    if shared:
        prompt = torch.cat([torch.arange(8) + 10 * (rid % 3), prompt])[:max(length, 9)]
    return DynamicInferenceRequest(
        request_id=rid, prompt_tokens=prompt,
        sampling_params=SamplingParams(
            num_tokens_to_generate=gen, temperature=0.5 + rid / 64, top_k=rid % 7,
            top_p=(rid % 10) / 10, termination_id=1000 + rid, return_log_probs=rid % 2 == 1,
            skip_prompt_log_probs=rid % 3 == 1, top_n_logprobs=rid % 5))


def _lockstep(name: str, seed: int, steps: int, monkeypatch, shared: bool = False,
              **extra) -> _Counting:
    """Drive a shortcut context and a general-path context with the same random calls and
    compare them after every call; returns the decision counts. ``num_speculative_tokens``
    in ``extra``: speculative steps, with rewinds and drafts; ``shared``: prompts that share
    prefixes (with ``enable_prefix_caching``)."""
    k = extra.get("num_speculative_tokens", 0)
    counts = _Counting(monkeypatch)
    contexts = [make_ctx(**WORKLOADS[name], **extra) for _ in range(2)]
    contexts[1]._decode_shortcut = False
    rng = random.Random(seed)
    next_rid, chunked = 0, None  # chunked: (requests per context, rid) of a prefill in flight
    generated = {}

    def same(where):
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]), where)

    for step_index in range(steps):
        ctx = contexts[0]
        where = f"{name} seed {seed} step {step_index}"
        # The chunked prefill continues first (the protocol), else new requests may come in.
        if chunked is not None:
            reqs, rid = chunked
            remaining = reqs[0].remaining_prompt_length
            room = ctx.max_tokens - ctx.active_token_count
            chunk = min(remaining, room, rng.randint(1, 6))
            for c, r in zip(contexts, reqs):
                add(c, r, chunk)
                c.chunked_prefill_request_id = rid if chunk < remaining else -1
            if chunk == remaining:
                chunked = None
            same(where + " continuation")
        elif rng.random() < 0.6:
            for _ in range(rng.randint(1, 3)):
                length, gen = rng.randint(1, 14), rng.randint(1, 60)
                length = max(length, 9) if shared else length
                probe = _request(next_rid, length, gen, shared)
                if not all(ctx.check_availability(probe)):
                    break
                first = rng.randint(1, length - 1) if length > 2 and rng.random() < 0.2 else None
                reqs = [_request(next_rid, length, gen, shared) for _ in contexts]
                for c, r in zip(contexts, reqs):
                    add(c, r, first)
                    if first is not None:
                        c.chunked_prefill_request_id = next_rid
                generated[next_rid] = (0, gen)
                next_rid += 1
                same(where + " add")
                if first is not None:
                    chunked = (reqs, next_rid - 1)
                    break
        A = ctx.total_request_count - ctx.paused_request_count
        if A == 0:
            continue
        for c in contexts:
            c.initialize_attention_state()
        same(where + " initialize_attention_state")
        P, T = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids()[P:T].tolist()
        keep = []
        for rid in ids:
            done, gen = generated[rid]
            keep.append(done + 1 < gen and rng.random() > 0.04)
        mask = torch.tensor(keep, dtype=rng.choice([torch.bool, torch.uint8, torch.int64]))
        tokens = torch.tensor([rid * 10 + step_index for rid in ids], dtype=torch.int64)
        drafts = None
        if k:
            # Speculative steps: the verification accepts some drafts (a rewind), and the
            # next drafts come with the update.
            if rng.random() < 0.7:
                accepted = torch.tensor([rng.randint(0, k) for _ in ids])
                released = [c.rewind_kv_cache(accepted.clone()).tolist() for c in contexts]
                assert released[0] == released[1], where
                same(where + " rewind_kv_cache")
            drafts = torch.arange(k * len(ids), dtype=torch.int64).view(k, -1) + step_index
        results = [c.update_requests(mask.clone(), tokens.clone(),
                                     None if drafts is None else drafts.clone())
                   for c in contexts]
        assert results[0].tolist() == results[1].tolist(), where
        for attr in ("evicted_request_ids", "max_length_finished_request_ids"):
            assert getattr(contexts[0], attr).tolist() == getattr(contexts[1], attr).tolist(), \
                f"{where}: {attr}"
        same(where + " update_requests")
        check_invariants(contexts[0])
        for rid, kept in zip(ids, keep):
            if kept:
                done, gen = generated[rid]
                generated[rid] = (done + 1, gen)
        if chunked is not None and chunked[1] not in ctx._live_ids:
            chunked = None
    counts.context = contexts[0]
    return counts


@pytest.mark.parametrize("small_crossing", [16, 0], ids=["lists", "numpy"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_decode_update_equals_general_update(name, seed, small_crossing, monkeypatch):
    """``small_crossing``: up to how many rows starting a block plan_decode orders with Python
    lists (``update_plan.SMALL_CROSSING``); 0 takes its numpy branch every time."""
    monkeypatch.setattr(update_plan, "SMALL_CROSSING", small_crossing)
    counts = _lockstep(name, seed, 120, monkeypatch)
    # Both paths ran (the general context makes a general plan for every update), and the
    # shortcut met rows that start a block.
    assert counts.decode >= 20 and counts.crossing >= 5, vars(counts)
    assert counts.general - counts.decode >= 10, vars(counts)


@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_update_with_prefix_caching_equals_general_update(seed, policy, monkeypatch):
    """With prefix caching, a decode update once no prompt chain is pending publishes nothing:
    the shortcut leaves what the general path leaves (digests, cached marks, idle blocks, the
    LRU allocator's evictions of idle cached blocks for new ones), prompts sharing prefixes.
    (The roomy workload: the tight one's chunked continuations, which this driver adds
    unchecked, can find no block once cached blocks hold the memory.)"""
    counts = _lockstep("roomy", seed, 120, monkeypatch, shared=True,
                       enable_prefix_caching=True, prefix_caching_eviction_policy=policy)
    assert counts.context.get_prefix_cache_stats()["prefix_cache_hits"] >= 10
    assert counts.decode >= 10 and counts.crossing >= 3, vars(counts)
    assert counts.general - counts.decode >= 10, vars(counts)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_speculative_decode_update_equals_general_update(name, seed, monkeypatch):
    """With ``num_speculative_tokens = 2`` the steady decode update (rows advance by ``1 + k``,
    take their next block early) leaves what the general path leaves, rewinds included."""
    counts = _lockstep(name, seed, 120, monkeypatch, num_speculative_tokens=2)
    assert counts.decode >= 10 and counts.crossing >= 5, vars(counts)
    assert counts.general - counts.decode >= 10, vars(counts)


@pytest.mark.interpreter
@needs_triton
def test_decode_update_equals_general_update_triton(monkeypatch):
    """The same on the Triton kernels (the interpreter): the decode plan's swaps and appended
    blocks reach the compaction kernel as the general plan's do."""
    counts = _lockstep("roomy", 5, 25, monkeypatch, kernel_backend="triton")
    assert counts.decode >= 5 and counts.crossing >= 1, vars(counts)


def test_decode_plan_is_pure(monkeypatch):
    """``plan_decode`` changes nothing, with and without rows that start a block."""
    ctx = make_ctx(**WORKLOADS["roomy"])
    for rid, length in enumerate((3, 4, 7, 1)):
        add(ctx, _request(rid, length, 30))
    seen_full = 0
    for step_index in range(8):
        ctx.initialize_attention_state()
        before = full_state(ctx)
        plan = ctx._table.plan_decode(chunked_id=-1,
                                      max_sequence_length=ctx.max_sequence_length)
        assert plan is not None
        seen_full += plan.full is not None
        assert_equal_states(before, full_state(ctx), f"step {step_index}")
        A = ctx.total_request_count
        ctx.update_requests(torch.ones(A, dtype=torch.bool), torch.arange(A) + step_index)
    assert seen_full >= 3


@pytest.mark.parametrize("when", ["before_step", "before_update"])
def test_decode_update_sees_block_counts_written_by_hand(when, monkeypatch):
    """A decode update takes the active rows' block-count sum from the update that prepared
    the step (``DecodePlan.active_blocks``). A count written by hand through
    ``request_kv_block_counts`` in between, before ``initialize_attention_state`` or before
    ``update_requests``, is seen: with the sum past the active budget, the rows that fill their
    last block cannot all resume, and both contexts pause them (the general path)."""
    counts = _Counting(monkeypatch)
    contexts = [make_ctx(**WORKLOADS["roomy"]) for _ in range(2)]
    contexts[1]._decode_shortcut = False
    for c in contexts:
        for rid, length in enumerate((3, 5, 2, 6)):
            add(c, _request(rid, length, 30))
    crossings = 0
    for step_index in range(12):
        ctx = contexts[0]
        T = ctx.total_request_count
        crossing = bool((ctx.request_last_kv_block_offset[:T] == 3).any())
        written = crossing and crossings >= 1 and ctx.paused_request_count == 0
        if written and when == "before_step":
            for c in contexts:
                c.request_kv_block_counts[0] += c.block_allocator.active_count
        for c in contexts:
            c.initialize_attention_state()
        if written and when == "before_update":
            for c in contexts:
                c.request_kv_block_counts[0] += c.block_allocator.active_count
        general_before = counts.general
        A = ctx.total_request_count - ctx.paused_request_count
        for c in contexts:
            c.update_requests(torch.ones(A, dtype=torch.bool), torch.arange(A) + step_index)
        assert_equal_states(full_state(contexts[0]), full_state(contexts[1]),
                            f"{when} step {step_index}")
        crossings += crossing
        if written:
            # Both contexts took the general path, which paused the crossing rows.
            assert counts.general - general_before == 2, vars(counts)
            assert ctx.paused_request_count > 0
            return
    raise AssertionError(f"no second block crossing in 12 steps ({crossings} crossings)")


def test_aligned_matches_skips_straddling_bytes():
    """``plan_decode``'s byte search finds the int32 values equal to the pattern and only
    those: a match of its first byte inside another value, or of all four bytes across two
    values, is skipped; past ``limit`` candidates it gives up (numpy decides)."""
    values = np.array([511, 255, 0x1FF00, 511, 7, 0xFF, 511], dtype=np.int32)
    data, pattern = values.tobytes(), np.int32(511).tobytes()
    assert update_plan._aligned_matches(data, pattern, 16) == [0, 3, 6]
    straddle = np.array([0xFF000000 - 2**32, 0x000001, 511], dtype=np.int32).tobytes()
    assert straddle.find(pattern) % 4 != 0  # the pattern's bytes across two values
    assert update_plan._aligned_matches(straddle, pattern, 16) == [2]
    assert update_plan._aligned_matches(data, pattern, 2) is None
    assert update_plan._aligned_matches(b"", pattern, 16) == []
