"""Differential tests: our DynamicInferenceContext against megatron-core 0.16.1's, on the CPU.

Both contexts get the same configuration (an explicit ``paused_buffer_size_gb`` on both sides,
so they size alike: docs/SEMANTICS.md §2.5) and are driven by the same scripted workloads
through the same driver (``megatron_oracle.run_workload``, which plays Megatron's engine and
controller: chunked-prefill scheduling, the continue mask, re-queueing evicted requests for
recompute). Step by step, rows matched by request id, we compare: what was scheduled, token
counts and padding, ``cu_query_lengths`` / ``cu_kv_lengths`` (as per-request query and kv
lengths), ``max_seqlen_q/k``, positions and input ids per request, the finished, paused and
evicted ids, free-block counts, per-request block counts, and, separately, the row order and
the block ids themselves. The driver also checks each run against the host's own truth and
block ownership after every update.

Where megatron-core 0.16.1 is wrong (docs/SEMANTICS.md §0, §15.11), the tests assert OUR behaviour
and say why. What megatron-core 0.16.1 from PyPI actually does, checked here:

* ``update_requests`` returns ``{"newly_paused_request_ids": Tensor | None,
  "evict_request_ids": Tensor | None}``, or ``None`` when the context becomes empty (a bare
  ``return``; ``test_update_requests_return_value_megatron_0_16_1``). Ours returns the API
  text's Tensor of newly paused ids and keeps the evicted ids in ``evicted_request_ids``
  (README, "Differences"); the driver reads either form.
* It HAS the fixed chunked-request swap (docs/SEMANTICS.md §0.1, b705148cdd: step 6.d of
  ``update_requests`` swaps the chunked request back to the last active row unconditionally)
  and the fixed ``row - paused_request_count`` index (docs/SEMANTICS.md §0.2, 096dbeb479), and its
  engine queues evicted requests behind an in-flight chunked prefill instead of raising. The
  workloads below exercise all three (``test_workloads_cover_the_hard_paths``) and the two
  contexts agree there.
* It still has: ``newly_paused_request_ids`` wrong (it drops the LAST ids per resumed request,
  assuming the paused rows keep their order; the pause partition is not stable, and an
  eviction in between breaks it further); blocks leaked when ``add_request`` raises
  ``RequestOverflowError``; eager prefill padding past ``max_tokens``.
"""

from __future__ import annotations

import contextlib
import functools

import megatron_oracle as mo  # noqa: E402
import pytest
import torch
from sizing_warning import built  # noqa: E402

from dynctx.context import (  # noqa: E402
    BlockOverflowError,
    DynamicInferenceContext,
    DynamicInferenceRequest,
    RequestOverflowError,
    SamplingParams,
)

OURS_FACTORY = mo.make_request_factory(DynamicInferenceRequest, SamplingParams)

WORKLOADS = {
    w.name: w
    for w in [
        mo.workload_basic(),
        mo.workload_chunked(),
        mo.workload_pressure(),
        mo.workload_pressure_chunked(),
        *(mo.generate_workload(seed) for seed in range(4)),
        *(mo.workload_long_prompts(seed) for seed in (1, 6, 13)),
    ]
}


def make_ours(config):
    return built(lambda: DynamicInferenceContext(**config, device="cpu"))


@functools.lru_cache(maxsize=None)
def run_both(name):
    """(ours, megatron) step records of one workload (cached: several tests read them)."""
    workload = WORKLOADS[name]
    ours = mo.run_workload(make_ours(workload.config), workload, request_factory=OURS_FACTORY)
    ref = mo.run_workload(mo.make_megatron_context(**workload.config), workload,
                          request_factory=mo.megatron_request_factory)
    return ours, ref


# Per-step fields compared directly (max_seqlen_q/k included: eager maxima, as megatron's
# non-graphed path reports them). newly_paused_ids is left out: megatron's is wrong
# (reference bug, test_newly_paused_ids_are_the_requests_still_paused).
FIELDS = tuple(f for f in mo.COMPARED_FIELDS if f != "newly_paused_ids")


def _fmt(diffs, limit=12):
    return "\n".join(str(d) for d in diffs[:limit]) + (
        f"\n... {len(diffs) - limit} more" if len(diffs) > limit else "")


# ------------------------------------------------------------------------------------------
def test_same_configuration_same_sizes():
    for workload in (mo.workload_pressure(), mo.workload_basic()):
        ours, ref = make_ours(workload.config), mo.make_megatron_context(**workload.config)
        for name in ("total_count", "paused_count", "active_count", "total_avail",
                     "dummy_block_idx"):
            assert getattr(ours.block_allocator, name) == getattr(ref.block_allocator, name), name
        for name in ("max_requests", "max_tokens", "max_kv_block_count", "block_size_bytes"):
            assert getattr(ours, name) == getattr(ref, name), name


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_step_by_step_same_as_megatron(name):
    ours, ref = run_both(name)
    diffs = mo.compare_records(ours, ref, fields=FIELDS)
    assert not diffs, f"{name}: ours differs from megatron-core 0.16.1:\n{_fmt(diffs)}"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_row_order_and_block_ids_same_as_megatron(name):
    """Same compaction, pause partition, LIFO resume, eviction swaps and LIFO block stack:
    the rows come out in the same order (so cu_query_lengths, cu_kv_lengths, positions and
    input ids agree as raw arrays, not only per request) and the same block ids are used."""
    ours, ref = run_both(name)
    diffs = mo.compare_records(ours, ref, fields=mo.ORDER_FIELDS + ("block_ids_by_id_after",))
    assert not diffs, f"{name}:\n{_fmt(diffs)}"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_newly_paused_ids_are_the_requests_still_paused(name):
    """Ours reports exactly the requests this update paused that are still paused at its end
    (not the resumed ones, not the evicted ones; evicted ids come separately).

    REFERENCE BUG (docs/SEMANTICS.md §9.3, §15.11): megatron-core 0.16.1 builds the list in row
    order before the pause partition, then drops its LAST r entries for r resumed requests; the
    partition is not stable and an eviction moves rows too, so it can report resumed or
    evicted requests as paused and miss ones that stay paused. We do not compare with it."""
    ours, ref = run_both(name)
    for a in ours:
        assert sorted(a.newly_paused_ids) == sorted(a.newly_paused_truth), (name, a.step)
    # Where megatron is right, it agrees with us.
    for a, b in zip(ours, ref):
        if sorted(b.newly_paused_ids) == sorted(b.newly_paused_truth):
            assert sorted(a.newly_paused_ids) == sorted(b.newly_paused_ids)


def test_reference_newly_paused_bug_is_exercised():
    misreports = sum(mo.summarize(run_both(n)[1])["newly_paused_misreports"] for n in WORKLOADS)
    assert misreports > 0


def test_workloads_cover_the_hard_paths():
    """The workloads really exercise what the comparison is for."""
    stats = [mo.summarize(run_both(n)[1]) for n in WORKLOADS]
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    assert total["pause_events"] >= 20
    assert total["evictions"] >= 5
    assert total["max_paused"] and max(s["max_paused"] for s in stats) >= 3
    # §0 fix 1: a request ahead of the chunked one finishes, the chunked row moves, and must be
    # swapped back (megatron 0.16.1 has the fix: it would otherwise fail "Continuation
    # current_id mismatch").
    assert total["finish_ahead_of_chunked"] >= 3
    # §0 fix 2: pausing while a middle chunk is in flight and P > 0.
    assert total["chunked_with_paused"] >= 1
    # 0.16.1's engine: evictions while a chunked prefill is in flight.
    assert total["evictions_during_chunked"] >= 1


# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def raises_named(name):
    """pytest.raises by class name: megatron raises its own classes of the same names."""
    with pytest.raises(Exception) as info:
        yield info
    assert type(info.value).__name__ == name, repr(info.value)


def _request(factory, rid, n, gen=4):
    return factory(rid, torch.arange(1, n + 1, dtype=torch.long), gen)


def _two_steps(ctx, factory):
    """Add two requests, finish one, then the other; return both update_requests results."""
    ctx.add_request(_request(factory, 7, 5))
    ctx.add_request(_request(factory, 8, 3))
    ctx.initialize_attention_state()
    first = ctx.update_requests(torch.tensor([1, 0], dtype=torch.uint8),
                                torch.tensor([11, 12], dtype=torch.long))
    ctx.initialize_attention_state()
    last = ctx.update_requests(torch.tensor([0], dtype=torch.uint8),
                               torch.tensor([13], dtype=torch.long))
    assert ctx.total_request_count == 0
    return first, last


def test_update_requests_return_value_megatron_0_16_1():
    """What megatron-core 0.16.1 (PyPI) returns: a dict of two tensors-or-None, and None (a
    bare return) when the context becomes empty."""
    cfg = mo.base_config(total_blocks=33, paused_blocks=8)
    first, last = _two_steps(mo.make_megatron_context(**cfg), mo.megatron_request_factory)
    assert isinstance(first, dict)
    assert set(first) == {"newly_paused_request_ids", "evict_request_ids"}
    assert first["newly_paused_request_ids"] is None and first["evict_request_ids"] is None
    assert last is None


def test_update_requests_return_value_ours():
    """Ours returns the form its README documents (the API text's Tensor of newly paused ids,
    evicted ids in ``evicted_request_ids``), or megatron-core 0.16.1's dict / None; the
    driver accepts both, and the per-step ids are compared above."""
    cfg = mo.base_config(total_blocks=33, paused_blocks=8)
    ctx = make_ours(cfg)
    first, last = _two_steps(ctx, OURS_FACTORY)
    if isinstance(first, dict):
        assert set(first) == {"newly_paused_request_ids", "evict_request_ids"}
        assert last is None
    else:
        for value in (first, last):
            assert isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == 0
        assert isinstance(ctx.evicted_request_ids, torch.Tensor)
        assert ctx.evicted_request_ids.numel() == 0


def test_request_overflow_does_not_leak_blocks():
    """REFERENCE BUG (docs/SEMANTICS.md §8 add_request, §15.11): megatron allocates the blocks
    before the max_requests check, so RequestOverflowError leaks them. Ours checks first."""
    cfg = dict(mo.base_config(total_blocks=33, paused_blocks=8), max_requests=2)
    results = {}
    for side, ctx, factory in (("ours", make_ours(cfg), OURS_FACTORY),
                               ("megatron", mo.make_megatron_context(**cfg),
                                mo.megatron_request_factory)):
        ctx.add_request(_request(factory, 1, 5))
        ctx.add_request(_request(factory, 2, 5))
        before = ctx.block_allocator.total_avail
        with raises_named(RequestOverflowError.__name__):
            ctx.add_request(_request(factory, 3, 40))  # 3 blocks
        results[side] = before - ctx.block_allocator.total_avail
    assert results == {"ours": 0, "megatron": 3}


def test_block_overflow_changes_nothing():
    cfg = mo.base_config(total_blocks=5, paused_blocks=1)  # 4 usable blocks
    for ctx, factory in ((make_ours(cfg), OURS_FACTORY),
                         (mo.make_megatron_context(**cfg), mo.megatron_request_factory)):
        ctx.add_request(_request(factory, 1, 40))  # 3 blocks
        with raises_named(BlockOverflowError.__name__):
            ctx.add_request(_request(factory, 2, 20))  # 2 blocks
        assert ctx.block_allocator.total_avail == 1
        assert ctx.total_request_count == 1 and ctx.active_token_count == 40


def test_eager_prefill_padding_capped_at_max_tokens():
    """REFERENCE BUG (docs/SEMANTICS.md §8 initialize_attention_state, §15.11): megatron pads an
    eager prefill step to round_up_tokens(active), uncapped, past the token buffer when
    max_tokens is not a multiple of 64. Ours caps the padding at max_tokens."""
    cfg = dict(mo.base_config(total_blocks=33, paused_blocks=8), max_tokens=100)
    padded = {}
    for side, ctx, factory in (("ours", make_ours(cfg), OURS_FACTORY),
                               ("megatron", mo.make_megatron_context(**cfg),
                                mo.megatron_request_factory)):
        ctx.add_request(_request(factory, 1, 70))
        ctx.initialize_attention_state()
        padded[side] = ctx.padded_active_token_count
        ids, pos = ctx.current_input_and_position_ids()
        assert ids.shape == pos.shape
        if side == "ours":
            assert ids.shape[1] == ctx.padded_active_token_count
    assert padded == {"ours": 100, "megatron": 128}
