"""Review of async scheduling (engine/overlap.py): cases that broke it, or came closest,
each against the synchronous engine (``async_scheduling=False``)."""

from __future__ import annotations

import random
from typing import Dict, List

import pytest
from e2e_helpers import (
    build_engine,
    case_engine_sizes,
    make_prompts,
    pressure_workload,
    tiny_llama,
)
from test_async_scheduling import CASE, _events_of_async_run, outcome, with_stop
from test_llama_engine import BASE_GENS, BASE_LENGTHS

from dynctx.context import DynamicInferenceRequest, SamplingParams


def test_a_result_is_delivered_once_its_row_left_the_context_and_its_id_is_free():
    """A request that stops in the step whose update pauses it: its result comes with a step
    after which the context no longer holds it (as in the synchronous engine), so its id can be
    given to a new request at once; both engines then give the same outputs, and a drained
    engine has nothing left in the context."""
    hf = tiny_llama(seed=4)
    _, requests, arrivals = pressure_workload(hf, CASE, BASE_LENGTHS, BASE_GENS)
    at_pause, _ = _events_of_async_run(hf, requests, arrivals)
    rid, token = min(at_pause.items())
    stopping = with_stop(requests, rid, token)

    def run(async_scheduling):
        engine = build_engine(hf, **case_engine_sizes(CASE), kernel_backend="torch",
                              async_scheduling=async_scheduling)
        for request, arrival in zip(stopping, arrivals):
            engine.add_request(request, arrival_step=arrival)
        results: Dict[int, list] = {}
        while engine.has_unfinished_requests():
            step = engine.step()
            ctx = engine.context
            held = set(ctx.host_request_ids()[:ctx.total_request_count].tolist())
            for result in step.finished:
                assert result.request_id not in held, \
                    f"request {result.request_id} was delivered while the context holds it"
                results.setdefault(result.request_id, []).append(result)
                if result.request_id == rid and len(results[rid]) == 1:
                    # Its id is free again: a new request may take it.
                    engine.add_request(DynamicInferenceRequest(
                        request_id=rid, prompt_tokens=list(stopping[0].prompt_tokens) + [7],
                        sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=3)))
        assert not engine.context.has_unfinished_requests()
        return engine, [r for rid_ in sorted(results) for r in results[rid_]]

    _, sync = run(False)
    engine, asynchronous = run(True)
    assert engine.async_scheduling_counts["retired_paused"] >= 1
    assert len(asynchronous) == len(stopping) + 1
    assert outcome(asynchronous) == outcome(sync)


class _Boom(Exception):
    """What the review's step callback raises."""


def _random_workload(seed: int, blocks=None, count=None):
    """Engine sizes (few blocks: pauses and evictions), requests and arrival steps: prompts
    of 1 to 48 tokens (block multiples and one off them too), 1 to 40 tokens to generate,
    greedy or seeded top-k/top-p sampling, log probs on some, and a termination id on most,
    taken from the request's own output without one (its first, last or a random token)."""
    rng = random.Random(seed)
    blocks = rng.randint(5, 8) if blocks is None else blocks
    sizes = dict(block_size=16, blocks=blocks, paused_blocks=1,
                 max_tokens=rng.choice([16, 24, 32, 64]))
    count = rng.randint(6, 12) if count is None else count
    lengths = [rng.choice([1, 2, 15, 16, 17, 31, 32, 33, rng.randint(1, 48)])
               for _ in range(count)]
    prompts = make_prompts(lengths, 256, seed=seed)
    seeded = rng.random() < 0.4

    def requests(stops):
        made = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(top_k=1, num_tokens_to_generate=gens[i],
                                    termination_id=stops[i], return_log_probs=log_probs[i],
                                    skip_prompt_log_probs=skips[i])
            if seeded:
                params.temperature, params.top_k, params.top_p, params.seed = \
                    0.9, 20, 0.95, 1000 + i
            made.append(DynamicInferenceRequest(request_id=i, prompt_tokens=prompt,
                                                sampling_params=params))
        return made

    gens = [rng.choice([1, rng.randint(8, 40), rng.randint(8, 40)]) for _ in range(count)]
    log_probs = [rng.random() < 0.4 for _ in range(count)]
    skips = [rng.random() < 0.5 for _ in range(count)]
    arrivals = [rng.randint(0, 2) for _ in range(count)]
    return sizes, requests, arrivals, rng


def _stepwise(hf, sizes, requests, arrivals, async_scheduling, seed, suspends=0.1):
    """Step by hand, with a step callback that raises on some steps, a suspend/resume before
    some, and each finished id given at once to a new request; checks that nothing is
    delivered twice or while the context holds it and that the stream equals the results.
    ``suspends``: the chance of a suspend/resume before a step. Returns ``{(request id, 0 or 1
    for the re-added one): result}`` and the engine."""
    rng = random.Random(seed)
    streamed: Dict[tuple, List[int]] = {}
    generation: Dict[int, int] = {}

    def callback(step):
        for rid, token in step.new_tokens.items():
            streamed.setdefault((rid, generation.get(rid, 0)), []).append(token)
        if rng.random() < 0.3:
            raise _Boom()

    engine = build_engine(hf, kernel_backend="torch", async_scheduling=async_scheduling,
                          step_callback=callback, **sizes)
    for request, arrival in zip(requests, arrivals):
        engine.add_request(request, arrival_step=arrival)
    results: Dict[tuple, object] = {}
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        if rng.random() < suspends:
            engine.suspend()
            engine.resume()
        try:
            step = engine.step()
        except _Boom:
            continue
        ctx = engine.context
        held = set(ctx.host_request_ids()[:ctx.total_request_count].tolist())
        for result in step.finished:
            key = (result.request_id, generation.get(result.request_id, 0))
            assert key not in results, f"{key} delivered twice"
            assert result.request_id not in held, f"{key} delivered while held"
            results[key] = result
            if key[1] == 0 and result.finish_reason != "error":
                generation[result.request_id] = 1
                first = requests[result.request_id]
                params = SamplingParams(**{**vars(first.sampling_params)})
                params.num_tokens_to_generate = 3
                engine.add_request(DynamicInferenceRequest(
                    request_id=result.request_id,
                    prompt_tokens=list(first.prompt_tokens)[:5] + [9], sampling_params=params))
    assert not engine.has_unfinished_requests()
    assert not engine.context.has_unfinished_requests()
    for key, result in results.items():
        if result.finish_reason != "error":
            assert streamed.get(key, []) == result.generated_tokens, key
    return results, engine


@pytest.mark.parametrize("seed", [5, 26, 27])
def test_stepwise_with_raising_callbacks_suspends_and_reused_ids_equals_sync(seed):
    """Random workloads under KV pressure (seeds that retire requests while paused), stepped
    by hand: a raising step callback, suspend/resume between steps, every finished id reused
    at once. Tokens, finish reasons and errors equal the synchronous engine's; log probs
    equal them to fp32 rounding (a retired row's extra step changes that step's batch, and
    the matmuls round differently for another batch, in the synchronous engine too)."""
    hf = tiny_llama()
    sizes, make, arrivals, rng = _random_workload(seed)
    plain = build_engine(hf, kernel_backend="torch", **sizes).generate_requests(
        make([None] * len(arrivals)), arrival_steps=arrivals)
    stops = []
    for result in plain:
        tokens = result.generated_tokens
        stop = None
        if tokens and rng.random() < 0.95:
            stop = tokens[rng.choice([0, len(tokens) - 1, rng.randrange(len(tokens))])]
        stops.append(stop)
    requests = make(stops)
    sync, _ = _stepwise(hf, sizes, requests, arrivals, False, seed)
    asynchronous, engine = _stepwise(hf, sizes, requests, arrivals, True, seed)
    assert sorted(sync) == sorted(asynchronous)
    for key in sorted(sync):
        ours, theirs = asynchronous[key], sync[key]
        assert (ours.generated_tokens, ours.finish_reason, ours.error) == \
            (theirs.generated_tokens, theirs.finish_reason, theirs.error), key
        for mine, reference in ((ours.generated_log_probs, theirs.generated_log_probs),
                                (ours.prompt_log_probs, theirs.prompt_log_probs)):
            assert (mine is None) == (reference is None), key
            if mine is not None:
                assert mine == pytest.approx(reference, abs=1e-5), key
    counts = engine.async_scheduling_counts
    assert counts["retired"] >= 3 and engine.stats.suspends >= 1, counts
    assert counts["retired_paused"] + counts["evicted_stops"] >= 1, counts


# (prompt length, tokens to generate, position in the request's own output of the token that
# becomes its termination id, arrival step, return_log_probs, skip_prompt_log_probs): a
# workload found by a random search in which a request stops as it is paused and is then
# evicted while paused (its row retired and evicted, not masked).
RETIRED_EVICTED_WORKLOAD = [
    (35, 27, None, 1, True, False), (17, 28, 15, 0, False, True), (1, 22, None, 2, False, True),
    (1, 31, 30, 0, False, False), (2, 32, 31, 2, True, False), (15, 17, 7, 2, True, True),
    (2, 38, 3, 1, False, True), (5, 10, 0, 1, True, False), (16, 37, None, 0, False, False),
    (2, 14, 11, 1, False, False), (33, 20, None, 0, True, True), (1, 12, 6, 1, False, False),
]


def test_a_retired_row_evicted_while_paused_equals_sync():
    """Seeded top-k/top-p sampling on 5 blocks of 16 (1 paused): a request stops in the step
    whose update pauses it, and a later update evicts it while still paused (the path that
    releases a retired row by eviction). Tokens and finish reasons equal the synchronous
    engine's, log probs to fp32 rounding; every block is free at the end."""
    hf = tiny_llama()
    sizes = dict(block_size=16, blocks=5, paused_blocks=1, max_tokens=32)
    prompts = [make_prompts([length], 256, seed=15500 + i)[0]
               for i, (length, *_) in enumerate(RETIRED_EVICTED_WORKLOAD)]
    arrivals = [row[3] for row in RETIRED_EVICTED_WORKLOAD]

    def requests(stops):
        made = []
        for i, (_, gen, _, _, log_probs, skip) in enumerate(RETIRED_EVICTED_WORKLOAD):
            made.append(DynamicInferenceRequest(
                request_id=i, prompt_tokens=prompts[i], sampling_params=SamplingParams(
                    temperature=0.9, top_k=20, top_p=0.95, seed=1000 + i,
                    num_tokens_to_generate=gen, termination_id=stops[i],
                    return_log_probs=log_probs, skip_prompt_log_probs=skip)))
        return made

    def run(reqs, async_scheduling):
        engine = build_engine(hf, kernel_backend="torch", async_scheduling=async_scheduling,
                              **sizes)
        results = engine.generate_requests(reqs, arrival_steps=arrivals)
        assert not engine.has_unfinished_requests()
        assert engine.context.block_allocator.total_avail == sizes["blocks"] - 1
        return engine, results

    _, plain = run(requests([None] * len(prompts)), False)
    stopping = requests([None if row[2] is None else result.generated_tokens[row[2]]
                         for row, result in zip(RETIRED_EVICTED_WORKLOAD, plain)])
    _, sync = run(stopping, False)
    engine, asynchronous = run(stopping, True)
    assert [(r.generated_tokens, r.finish_reason) for r in asynchronous] == \
        [(r.generated_tokens, r.finish_reason) for r in sync]
    for ours, theirs in zip(asynchronous, sync):
        assert (ours.generated_log_probs is None) == (theirs.generated_log_probs is None)
        if ours.generated_log_probs is not None:
            assert ours.generated_log_probs == pytest.approx(theirs.generated_log_probs,
                                                             abs=1e-5)
            assert (ours.prompt_log_probs or []) == pytest.approx(
                theirs.prompt_log_probs or [], abs=1e-5)
    assert engine.async_scheduling_counts["retired_evicted"] >= 1, \
        engine.async_scheduling_counts


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("action", ["suspend", "add-a-request-that-never-fits"])
def test_results_finished_inside_the_step_callback_are_delivered(action, async_scheduling):
    """A step callback that suspends and resumes the engine (async: the suspend reads the
    tokens in flight, which finishes requests) or adds a request that can never run (it
    finishes at once with an error): those results come with a later step, none is lost."""
    hf = tiny_llama()
    prompts = make_prompts([7, 20, 13, 3], 256, seed=3)
    gens = [4, 9, 5, 12]
    box = {}

    def callback(step):
        engine = box["engine"]
        if step.step != 4:
            return
        if action == "suspend":
            engine.suspend()
            engine.resume()
        else:
            engine.add_request(DynamicInferenceRequest(
                request_id=99, prompt_tokens=[5] * 200,
                sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=100)))

    engine = build_engine(hf, block_size=16, blocks=16, paused_blocks=2, max_tokens=64,
                          kernel_backend="torch", async_scheduling=async_scheduling,
                          step_callback=callback)
    box["engine"] = engine
    for i, (prompt, gen) in enumerate(zip(prompts, gens)):
        engine.add_request(DynamicInferenceRequest(
            request_id=i, prompt_tokens=prompt,
            sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=gen)))
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step().finished
    by_id = {r.request_id: r for r in finished}
    assert len(finished) == len(by_id)
    expected = [0, 1, 2, 3] + ([99] if action != "suspend" else [])
    assert sorted(by_id) == expected
    for i, gen in enumerate(gens):
        assert by_id[i].finish_reason == "length" and len(by_id[i].generated_tokens) == gen
    if action != "suspend":
        assert by_id[99].finish_reason == "error" and "exceeds" in by_id[99].error
