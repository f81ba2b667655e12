"""Every tensor a captured forward reads lives at one address across steps (docs/SEMANTICS.md §6,
§13): a CUDA graph replays its kernels on the addresses of its capture.

The tensors: the input and position ids of ``current_input_and_position_ids()``, the per-token
arrays (``token_to_*``), the attention metadata (query and kv lengths, the cumulative lengths,
the block-table view), every attention layer's K/V cache, and for a hybrid the Mamba metadata
tensors and every Mamba layer's states. A probe model records their ``data_ptr()`` in every
forward of an engine run that pauses, evicts, chunks, and suspends and resumes.

What is stable, precisely:

* **Between resume points** (from ``allocate_all_tensors`` to the next
  ``deallocate_all_tensors``), every one of these tensors has one address in every step, and
  every step's view starts at its buffer's start (a slice ``[:n]``, never an offset view);
  a metadata field the step has no use for may be ``None`` (Mamba prefill indices in a decode
  step), and has the same address again whenever it is present.
* **Across a suspend** nothing is: ``deallocate_all_tensors`` frees every device tensor and the
  resume allocates new ones. Graphs captured before a suspend must be captured again after the
  resume (the engine does: ``engine/graphs.py``); the set of tensors read is the same.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List

import pytest
import torch
from helpers import BLOCK, GIB, make_ctx
from test_hybrid import BYTES_PER_BLOCK, make_hybrid

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine

VOCAB = 16
TOKEN_ARRAYS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                "token_to_block_idx", "token_to_position_in_request",
                "token_to_local_position_within_kv_block")
ATTENTION = ("query_lengths", "cu_query_seq_lengths", "cu_kv_seq_lengths", "kv_seq_lengths",
             "block_table")
# Tensor fields of ``mamba_metadata`` (the host tuples ``device_decode_prefill`` and
# ``device_chunked_prefill`` are not read from device memory).
MAMBA = ("request_to_mamba_state_idx", "batch_indices_decode", "batch_indices_prefill",
         "batch_indices_chunked_prefill", "cu_seqlens", "seq_idx")


def forward_addresses(ctx) -> Dict[str, int]:
    """``data_ptr()`` of every tensor a forward reads, by name (public API only)."""
    out: Dict[str, int] = {}
    input_ids, position_ids = ctx.current_input_and_position_ids()
    out["input_ids"], out["position_ids"] = input_ids.data_ptr(), position_ids.data_ptr()
    for name in TOKEN_ARRAYS:
        out[name] = getattr(ctx, name).data_ptr()
    meta = ctx.active_attn_metadata
    for name in ATTENTION:
        out[f"attn.{name}"] = getattr(meta, name).data_ptr()
    for index, kind in enumerate(ctx.layer_types):
        if kind == "*":
            key, value = ctx.key_value_cache(index + 1)
            out[f"kv.{index + 1}.key"], out[f"kv.{index + 1}.value"] = \
                key.data_ptr(), value.data_ptr()
        elif kind == "M":
            conv, ssm = ctx.mamba_states_cache(index + 1)
            out[f"mamba_states.{index + 1}.conv"] = conv.data_ptr()
            out[f"mamba_states.{index + 1}.ssm"] = ssm.data_ptr()
    if ctx.is_hybrid_model:
        for name in MAMBA:
            value = getattr(ctx.mamba_metadata, name)
            if value is not None:
                out[f"mamba.{name}"] = value.data_ptr()
    return out


class AddressProbe:
    """A model that records the addresses its forward would read, and gives zero logits."""

    vocab_size = VOCAB

    def __init__(self):
        self.epoch = 0
        self.records: List[tuple] = []      # (epoch, addresses)
        self.views_at_start: List[str] = []

    def forward(self, ctx, *, last_token_only: bool = True) -> torch.Tensor:
        addresses = forward_addresses(ctx)
        self.records.append((self.epoch, addresses))
        if addresses["input_ids"] != ctx.token_to_input_ids.data_ptr():
            self.views_at_start.append("input_ids")
        if addresses["position_ids"] != ctx.token_to_pos_ids.data_ptr():
            self.views_at_start.append("position_ids")
        logits = torch.zeros(1, ctx.padded_active_token_count, VOCAB)
        return ctx.last_token_logits(logits) if last_token_only else logits


def run_workload(ctx) -> tuple:
    """An engine run over ``ctx`` with the probe: pressure (pauses, evictions), chunked
    prefills, and two suspends and resumes; returns ``(probe, engine)``. The context has a
    graph ladder, so the engine also captures its graphs (stand-in runner) at the start and
    after each resume: the probe sees the capture forwards too."""
    probe = AddressProbe()
    engine = Engine(probe, ctx)
    lengths = [3, 21, 6, 9, 14, 2, 30, 5, 11, 4]
    gens = [14, 10, 18, 12, 9, 16, 8, 15, 11, 13]
    for rid, (length, gen) in enumerate(zip(lengths, gens)):
        engine.add_request(DynamicInferenceRequest(
            request_id=rid, prompt_tokens=[1 + i % (VOCAB - 1) for i in range(length)],
            sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=gen,
                                           termination_id=-1)), arrival_step=rid // 3)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps in (9, 20):
            engine.suspend()
            probe.epoch += 1
            engine.resume()  # captures the graphs again: forwards of the new epoch
    return probe, engine


def pressure_ctx(hybrid: bool):
    # Block of 4 tokens; 10 active and 2 paused blocks; 8 tokens a step (chunked prefill).
    common = dict(max_tokens=8, max_requests=8, num_cuda_graphs=4)
    if hybrid:
        return make_hybrid(buffer_size_gb=12 * BYTES_PER_BLOCK / GIB,
                           paused_buffer_size_gb=2 * BYTES_PER_BLOCK / GIB, **common)
    return make_ctx(buffer_size_gb=12 * BLOCK / GIB, paused_buffer_size_gb=2 * BLOCK / GIB,
                    **common)


@pytest.mark.parametrize("hybrid", [False, True], ids=["mha", "hybrid"])
def test_forward_inputs_keep_their_addresses_between_resume_points(hybrid):
    probe, engine = run_workload(pressure_ctx(hybrid))
    stats = engine.stats
    assert stats.pauses > 0 and stats.evictions > 0, "the workload should pause and evict"
    assert stats.chunked_prefills > 0 and stats.suspends == 2
    assert probe.views_at_start == []

    by_epoch: Dict[int, Dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for epoch, addresses in probe.records:
        for name, address in addresses.items():
            by_epoch[epoch][name].add(address)
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch, names in by_epoch.items():
        moved = {name: sorted(addresses) for name, addresses in names.items()
                 if len(addresses) > 1}
        assert not moved, f"between resume points {epoch}: addresses changed: {moved}"
    # The same tensors are read in every epoch (for a hybrid, the Mamba fields a step needs:
    # decode and prefill indices both appear over a workload).
    expected = set(by_epoch[0])
    assert all(set(names) == expected for names in by_epoch.values())
    if hybrid:
        assert {"mamba.batch_indices_decode", "mamba.batch_indices_prefill", "mamba.cu_seqlens",
                "mamba.seq_idx", "mamba.request_to_mamba_state_idx"} <= expected
    # Every step's forward and both forwards of every capture (its warm-up, then the recorded
    # one) were probed.
    assert engine.graph_runner is not None and sum(engine.graph_runner.replays.values()) > 0
    assert len(probe.records) == stats.forward_steps + 2 * engine.graph_runner.captures


def test_a_padded_graph_step_reads_the_same_addresses_as_an_eager_step():
    """The capture dummies (``construct_graph_dimensions``) and a real step read the same
    tensors: what a capture records is what a replay finds."""
    ctx = pressure_ctx(hybrid=False)
    graph = ctx.cuda_graph_batch_dimensions_list[0]
    ctx.initialize_attention_state(construct_graph_dimensions=graph)
    captured = forward_addresses(ctx)
    ctx.reset()
    probe, _ = run_workload(ctx)
    first_epoch = [addresses for epoch, addresses in probe.records if epoch == 0]
    assert all(addresses == captured for addresses in first_epoch)
