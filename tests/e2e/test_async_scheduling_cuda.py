"""Async scheduling on CUDA (``gpu``: section 4 of bench/device_check.sh; skipped without a CUDA
device): the sampled tokens travel back through pinned memory and an event, with and without
CUDA graphs, under memory pressure, with a busy kernel queued after every step so that each
read-back lands late. Tokens, finish reasons and log probs must equal the synchronous engine's
on the same device, and a few of them transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    DEVICES,
    assert_pressure_stats,
    build_engine,
    case_engine_sizes,
    hf_greedy,
    pressure_workload,
    tiny_llama,
)
from test_async_scheduling import CASE, GRAPH_CASE, outcome, with_termination_ids
from test_llama_engine import BASE_GENS, BASE_LENGTHS

CUDA = [p for p in DEVICES if p.id == "cuda"]
# About 10 ms of device time at 2 GHz: longer than a tiny model's host step.
BUSY_CYCLES = 20_000_000


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_async_on_cuda_equals_sync_with_the_device_busy(device, graphs):
    hf = tiny_llama(device=device)
    case = GRAPH_CASE if graphs else CASE
    prompts, requests, arrivals = pressure_workload(hf, case, BASE_LENGTHS, BASE_GENS)
    extra = dict(num_cuda_graphs=4) if graphs else {}
    late = []

    def busy(result):
        # Still running the last one? Then the host is ahead and the next read-back waits.
        late.append(bool(busy.event is not None and not busy.event.query()))
        torch.cuda._sleep(BUSY_CYCLES)
        busy.event = torch.cuda.Event()
        busy.event.record()

    busy.event = None

    def run(reqs, async_scheduling, step_callback=None):
        engine = build_engine(hf, **case_engine_sizes(case), kernel_backend="triton",
                              async_scheduling=async_scheduling, step_callback=step_callback,
                              **extra)
        results = engine.generate_requests(reqs, arrival_steps=arrivals)
        assert not engine.context.has_unfinished_requests()
        assert engine.context.block_allocator.total_avail == case["blocks"] - 1
        return engine, results

    _, plain = run(requests, False)
    full = {r.request_id: r.generated_tokens for r in plain}
    stopping = with_termination_ids(requests, full)
    _, sync = run(stopping, False)
    async_engine, asynchronous = run(stopping, True, busy)

    assert outcome(asynchronous) == outcome(sync)
    assert_pressure_stats(async_engine.stats, asynchronous)
    assert any(late), "the device never ran behind the host: the read-back was never late"
    if graphs:
        assert async_engine.graph_replays > 0
    for request, result in list(zip(stopping, asynchronous))[:6]:
        assert result.generated_tokens == hf_greedy(
            hf, prompts[request.request_id], request.sampling_params.num_tokens_to_generate,
            eos=request.sampling_params.termination_id)
