"""Host-device syncs of an engine step, counted with ``bench/step_overhead.py``'s counter (its
CPU emulation of device memory), and the read-back buffers of async scheduling.

The synchronous step reads the device once (the sampled tokens, with sampling's refusals
folded in); sampling uploads its parameters without blocking and the finish mask is built on
the host. Under async scheduling no step that runs a forward waits for the device: the tokens
are copied without blocking and read after the next forward is launched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import step_overhead as so  # noqa: E402  (bench/ is on pytest's pythonpath)
import torch
from e2e_helpers import build_engine, make_prompts, tiny_llama
from test_engine_bad_inputs import NaNLogits

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine.overlap import TokenReadback

LENGTHS = [5, 40, 9, 3, 17]
GENS = [7, 4, 9, 6, 5]


def mixed_requests(vocab: int):
    """Greedy, temperature, top-k and top-p requests; request 1's 40-token prompt is chunked."""
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0.8, seed=11),
              SamplingParams(temperature=0.7, top_k=20, seed=12),
              SamplingParams(temperature=1.0, top_p=0.9, seed=13),
              SamplingParams(temperature=0.8, seed=14)]
    requests = []
    for i, (prompt, gen, p) in enumerate(zip(make_prompts(LENGTHS, vocab, seed=5), GENS,
                                             params)):
        p.num_tokens_to_generate = gen
        requests.append(DynamicInferenceRequest(request_id=i, prompt_tokens=prompt,
                                                sampling_params=p))
    return requests


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_steps_read_the_device_once_and_never_wait_in_async_mode(async_scheduling,
                                                                         graphs):
    """Every synchronous step reads the device at most once; with async scheduling no step
    that runs a forward waits for the device (the last step, which only reads the last
    tokens, waits once). Eager: request 4's logits turn NaN from the fourth forward on, and its
    refusal travels in the same read. With CUDA graphs (the stand-in runner on a CPU) most steps
    replay a graph, whose forward is not counted, as an eager forward is not (a graph's
    forward has no host sync: the runner refuses one before capturing)."""
    hf = tiny_llama(seed=31)
    engine = build_engine(hf, block_size=16, blocks=16, paused_blocks=4, max_tokens=24,
                          max_sequence_length=96, kernel_backend="torch",
                          num_cuda_graphs=4 if graphs else None,
                          async_scheduling=async_scheduling)
    if not graphs:  # a replay runs the captured forward, not a wrapper set afterwards
        engine.model = NaNLogits(engine.model, bad_id=4, from_step=3)
    for request in mixed_requests(hf.config.vocab_size):
        engine.add_request(request, arrival_step=request.request_id // 2)
    steps = so.count_engine_steps(engine, 200)
    assert not engine.has_unfinished_requests()
    forwards = [s for s in steps if not s["idle"]]
    assert len(forwards) > 8 and engine.stats.chunked_prefills >= 1
    # With graphs most steps replay one (the others fall outside the ladder and run eagerly).
    replayed = sum(s["replayed"] for s in forwards)
    assert (replayed > len(forwards) // 2) if graphs else replayed == 0, (replayed, len(forwards))
    over = {s["step"]: s["sync_sites"] for s in forwards if s["syncs"] > (0 if async_scheduling
                                                                          else 1)}
    assert not over, over
    if async_scheduling:
        assert engine.async_scheduling_counts["early_reads"] == 0
        assert [s["syncs"] for s in steps if s["idle"]][-1] == 1  # the flush
    else:
        # The one read is there, and it is the sampled tokens'.
        assert all(s["sync_sites"] == {"readback:Tensor.tolist": 1} for s in forwards)
    assert engine.stats.errors == (0 if graphs else 1)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculative_steps_read_once_and_never_wait_in_async_mode(async_scheduling, graphs):
    """Speculative steps (k = 2, n-gram drafts on repetitive prompts, greedy and seeded
    sampled requests): a synchronous step reads the device once (tokens, accepted counts and
    drafts in one tensor); under async scheduling no step that runs a forward waits for the
    device, the rewinds deferred and settled one step late."""
    from dynctx.engine.drafters import NgramDrafter

    hf = tiny_llama(seed=31)
    engine = build_engine(hf, block_size=16, blocks=16, paused_blocks=4, max_tokens=24,
                          max_sequence_length=96, kernel_backend="torch",
                          num_cuda_graphs=4 if graphs else None,
                          async_scheduling=async_scheduling, num_speculative_tokens=2,
                          drafter=NgramDrafter(min_ngram=1))
    if not async_scheduling:
        # The arena apart from the host buffer, as on CUDA (async scheduling's deferred
        # rewinds set it so): the drafts' moves read the update's row plan from it, which on a
        # CPU's shared arena the counter takes for host memory.
        engine.context._host_views = False
        if graphs:
            engine.graph_runner.capture_all()
    for request in mixed_requests(hf.config.vocab_size):
        request.prompt_tokens = torch.tensor(([3, 4, 5] * 14)[:len(request.prompt_tokens)])
        if request.request_id % 2 == 0:   # greedy (under async scheduling, drafted)
            request.sampling_params.temperature = 0.0
            request.sampling_params.num_tokens_to_generate = 14
        engine.add_request(request, arrival_step=request.request_id // 2)
    steps = so.count_engine_steps(engine, 200)
    assert not engine.has_unfinished_requests()
    forwards = [s for s in steps if not s["idle"]]
    assert engine.stats.speculative["draft_tokens"] > 0 and engine.stats.errors == 0
    over = {s["step"]: s["sync_sites"] for s in forwards if s["syncs"] > (0 if async_scheduling
                                                                          else 1)}
    assert not over, over
    if graphs:
        assert sum(s["replayed"] for s in forwards) > 0


def test_sampling_uploads_its_parameters_without_blocking():
    """The counter sees the upload as a non-blocking host-to-device copy (an op, no sync)."""
    from dynctx.engine.sampling import sample_checked

    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(top_k=1),
              SamplingParams(temperature=0.5, top_k=8, seed=2),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3)]
    counter = so.OverheadCounter("cpu", device_roots=[SimpleNamespace(logits=logits)])
    with counter.counting():
        sample_checked(logits, params, [0, 1, 2, 3], None)
    assert sum(counter.syncs.values()) == 0, counter.sync_ops
    assert counter.ops["h2d:Tensor.to"] == 1


# ------------------------------------------------------------------ read-back buffers
def test_a_readback_is_never_overwritten_before_it_is_read():
    """Two buffers: a third copy while both hold unread copies raises instead of overwriting
    the oldest (before, the buffer flipped on every start); a read or a discard frees one."""
    readback = TokenReadback(torch.device("cpu"), capacity=4)
    first = readback.start(torch.tensor([1, 2, 3]))
    second = readback.start(torch.tensor([4, 5]))
    with pytest.raises(RuntimeError, match="hold copies not read yet"):
        readback.start(torch.tensor([6]))
    readback.discard(second)  # the step that started it raised: never read
    third = readback.start(torch.tensor([7, 8, 9, 10]))
    assert readback.read(first) == [1, 2, 3]
    assert readback.read(third) == [7, 8, 9, 10]
    with pytest.raises(RuntimeError, match="already read or discarded"):
        readback.read(first)
    with pytest.raises(RuntimeError, match="exceed the readback buffer of 4"):
        readback.start(torch.arange(5))
    assert readback.reads == 2


def test_the_copy_is_taken_when_started():
    """A read gives the values as they were at ``start`` (the copy), not the tensor's values
    at the read."""
    readback = TokenReadback(torch.device("cpu"), capacity=3, dtype=torch.float32)
    values = torch.tensor([0.5, 1.5])
    handle = readback.start(values)
    values.fill_(9.0)
    assert readback.read(handle) == [0.5, 1.5]
