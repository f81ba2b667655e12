"""Async scheduling (``Engine(..., async_scheduling=True)``, engine/overlap.py): the sampled
tokens are read one step late, after the next step's forward is launched; outputs equal the
synchronous engine's and transformers' greedy ``generate``."""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import pytest
import torch
from e2e_helpers import (
    assert_pressure_stats,
    build_engine,
    case_engine_sizes,
    greedy_requests,
    hf_greedy,
    make_prompts,
    pressure_workload,
    tiny_llama,
)
from test_llama_engine import BASE_GENS, BASE_LENGTHS

import dynctx.engine.step as step_module
from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine.overlap import AsyncScheduling, TokenReadback

CASE = dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32, max_requests=None, scale=1)
GRAPH_CASE = dict(CASE, max_requests=8)


def outcome(results) -> List[tuple]:
    """What async must reproduce: tokens, finish reason, log probs. (Not the steps: a request
    that stops holds its blocks one step longer, so admissions may come a step later.)"""
    return [(r.request_id, r.generated_tokens, r.finish_reason, r.generated_log_probs,
             r.prompt_log_probs) for r in results]


def with_termination_ids(requests, outputs: Dict[int, List[int]]):
    """Copies of ``requests`` where request i stops at the first occurrence of the token at
    position ``(0, 9, 17, -, 25, 30, 3, -)[i % 8]`` of its greedy output (every fourth request
    runs to its length), so that requests stop at many different steps."""
    positions = [0, 9, 17, None, 25, 30, 3, None]
    stopped = []
    for i, request in enumerate(requests):
        params = SamplingParams(**{**vars(request.sampling_params)})
        position = positions[i % len(positions)]
        tokens = outputs[request.request_id]
        if position is not None and position < len(tokens):
            params.termination_id = tokens[position]
        stopped.append(DynamicInferenceRequest(request_id=request.request_id,
                                               prompt_tokens=list(request.prompt_tokens),
                                               sampling_params=params))
    return stopped


def expected_tokens(full: List[int], termination_id: Optional[int]) -> List[int]:
    if termination_id is None or termination_id not in full:
        return full
    return full[:full.index(termination_id) + 1]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_async_equals_sync_and_transformers_under_pressure(graphs):
    """Pauses, evictions, chunked prefill, requests stopping by termination id at different
    steps and by length: async gives the synchronous engine's tokens, finish reasons and
    steps, and transformers' greedy tokens."""
    hf = tiny_llama()
    case = GRAPH_CASE if graphs else CASE
    prompts, requests, arrivals = pressure_workload(hf, case, BASE_LENGTHS, BASE_GENS)
    extra = dict(num_cuda_graphs=4, attention_backend="torch_static") if graphs else {}

    def run(reqs, async_scheduling):
        engine = build_engine(hf, **case_engine_sizes(case), kernel_backend="torch",
                              async_scheduling=async_scheduling, **extra)
        results = engine.generate_requests(reqs, arrival_steps=arrivals)
        assert not engine.has_unfinished_requests()
        assert not engine.context.has_unfinished_requests()
        assert engine.context.block_allocator.total_avail == case["blocks"] - 1
        return engine, results

    _, plain = run(requests, False)
    full = {r.request_id: r.generated_tokens for r in plain}
    stopping = with_termination_ids(requests, full)
    sync_engine, sync = run(stopping, False)
    async_engine, asynchronous = run(stopping, True)

    assert outcome(asynchronous) == outcome(sync)
    reasons = [r.finish_reason for r in asynchronous]
    assert reasons.count("stop") >= 8 and reasons.count("length") >= 4
    assert len({r.finish_step for r in asynchronous if r.finish_reason == "stop"}) >= 6
    assert_pressure_stats(async_engine.stats, asynchronous)
    assert async_engine.stats.generated_tokens == sum(len(r.generated_tokens)
                                                      for r in asynchronous)
    if graphs:
        assert async_engine.graph_replays > 0
    for request, result in zip(stopping, asynchronous):
        stop = request.sampling_params.termination_id
        assert result.generated_tokens == expected_tokens(full[request.request_id], stop)
    # transformers, with its own EOS handling, for a few of them (the rest equal `plain`,
    # which the pressure tests of test_llama_engine.py check against transformers).
    for request, result in list(zip(stopping, asynchronous))[:6]:
        assert result.generated_tokens == hf_greedy(
            hf, prompts[request.request_id], request.sampling_params.num_tokens_to_generate,
            eos=request.sampling_params.termination_id)


@pytest.mark.parametrize("log_probs", [False, True], ids=["tokens", "with-log-probs"])
def test_tokens_are_read_only_after_the_next_forward_is_launched(monkeypatch, log_probs):
    """Every host read of a step's sampled tokens (tolist, item, numpy, cpu on any view of
    them, or the read of their copy to the host), and of their log probs when requests ask for
    them (without prompt log probs), comes after the next step's forward was launched, except
    the last step's, read once nothing is left to run; the synchronous engine reads them
    before."""
    hf = tiny_llama(seed=3)
    prompts = make_prompts([4, 9, 2, 13, 6], hf.config.vocab_size, seed=4)
    gens = [6, 3, 8, 5, 7]
    log: List[tuple] = []
    sampled: List[torch.Tensor] = []
    watched: List[List[torch.Tensor]] = []  # per step; kept alive: their data_ptrs stay unique
    copies: List[tuple] = []  # (readback handle, step); the handles kept alive
    real_sample = step_module.sample_checked
    real_log_probs = AsyncScheduling.device_log_probs
    real_start, real_read = TokenReadback.start, TokenReadback.read

    def watched_sample(*args, **kwargs):
        tokens, readout = real_sample(*args, **kwargs)
        sampled.append(tokens)
        watched.append([tokens, readout])
        return tokens, readout

    def watched_log_probs(self, last, tokens):
        values = real_log_probs(self, last, tokens)
        watched[-1].append(values)
        return values

    def step_of(tensor):
        return next((k for k, tensors in enumerate(watched)
                     if any(tensor.data_ptr() == t.data_ptr() for t in tensors)), None)

    def watched_start(self, tensor):
        handle = real_start(self, tensor)
        copies.append((handle, step_of(tensor)))
        return handle

    def watched_read(self, handle):
        log.extend(("read", k) for h, k in copies if h is handle and k is not None)
        return real_read(self, handle)

    def reader(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if self.numel():
                k = step_of(self)
                if k is not None:
                    log.append(("read", k))
            return original(self, *args, **kwargs)
        return read

    monkeypatch.setattr(step_module, "sample_checked", watched_sample)
    monkeypatch.setattr(AsyncScheduling, "device_log_probs", watched_log_probs)
    monkeypatch.setattr(TokenReadback, "start", watched_start)
    monkeypatch.setattr(TokenReadback, "read", watched_read)
    for name in ("tolist", "item", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, reader(name))

    def orders(async_scheduling):
        log.clear()
        sampled.clear()
        watched.clear()
        copies.clear()
        engine = build_engine(hf, block_size=16, blocks=16, paused_blocks=4, max_tokens=32,
                              kernel_backend="torch", async_scheduling=async_scheduling)
        forward = engine.model.forward

        def logged_forward(*args, **kwargs):
            log.append(("forward", len(sampled)))
            return forward(*args, **kwargs)

        engine.model.forward = logged_forward
        update = engine.context.update_requests
        masks = []

        def logged_update(mask, new_tokens):
            # The mask is on the host (read without waiting for the device) and the tokens are
            # the sampled device tensor itself.
            masks.append(mask.device.type)
            assert new_tokens is sampled[-1]
            return update(mask, new_tokens)

        engine.context.update_requests = logged_update
        requests = greedy_requests(prompts, gens)
        for request in requests:
            request.sampling_params.return_log_probs = log_probs
            request.sampling_params.skip_prompt_log_probs = True
        results = engine.generate_requests(requests)
        assert engine.stats.evictions == 0
        assert masks and set(masks) == {"cpu"}
        if log_probs:
            assert all(len(r.generated_log_probs) == len(r.generated_tokens) for r in results)
            assert not async_scheduling or all(len(w) == 3 for w in watched)
        return [(r.generated_tokens, r.generated_log_probs) for r in results], list(log), \
            len(sampled)

    sync_tokens, sync_log, _ = orders(False)
    async_tokens, async_log, steps = orders(True)
    assert async_tokens == sync_tokens
    assert sync_log.index(("read", 0)) < sync_log.index(("forward", 1))
    reads = [k for kind, k in async_log if kind == "read"]
    assert sorted(set(reads)) == list(range(steps - 1)) or sorted(set(reads)) == \
        list(range(steps))
    for position, (kind, k) in enumerate(async_log):
        if kind == "read" and k + 1 < steps:
            assert ("forward", k + 1) in async_log[:position], \
                f"step {k}'s tokens were read before step {k + 1}'s forward"


def test_log_probs_suspend_and_streaming_equal_sync():
    """Log probs (prompt ones across chunks too), a suspend/resume mid-run and the streamed
    tokens: async equals the synchronous engine."""
    hf = tiny_llama(seed=9)
    prompts = make_prompts([40, 6, 12, 27, 3], hf.config.vocab_size, seed=10)
    gens = [6, 10, 16, 12, 9]

    def run(async_scheduling):
        streamed: Dict[int, List[int]] = {}
        engine = build_engine(
            hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=24, kernel_backend="torch",
            async_scheduling=async_scheduling,
            step_callback=lambda step: [streamed.setdefault(rid, []).append(tok)
                                        for rid, tok in step.new_tokens.items()])
        for i, (prompt, gen) in enumerate(zip(prompts, gens)):
            engine.add_request(DynamicInferenceRequest(
                request_id=i, prompt_tokens=prompt,
                sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=gen,
                                               return_log_probs=i < 3,
                                               skip_prompt_log_probs=i == 1)))
        finished = []
        for _ in range(5):
            finished += engine.step().finished
        engine.suspend()
        engine.resume()
        finished += engine.run()
        assert not engine.context.has_unfinished_requests()
        finished.sort(key=lambda r: r.request_id)
        for result in finished:
            assert streamed[result.request_id] == result.generated_tokens
        return finished

    sync, asynchronous = run(False), run(True)
    assert [(r.generated_tokens, r.finish_reason, r.generated_log_probs, r.prompt_log_probs)
            for r in asynchronous] == \
        [(r.generated_tokens, r.finish_reason, r.generated_log_probs, r.prompt_log_probs)
         for r in sync]
    assert asynchronous[0].num_prefill_chunks >= 2
    for prompt, gen, result in zip(prompts, gens, asynchronous):
        assert result.generated_tokens == hf_greedy(hf, prompt, gen)


@pytest.mark.parametrize("kwargs,error,match", [
    pytest.param(dict(validate=True), ValueError, "validate=True", id="validate"),
    pytest.param(dict(record_logits=True), ValueError, "record_logits=True", id="record_logits"),
])
def test_conflicting_options_are_refused(kwargs, error, match):
    hf = tiny_llama(seed=5)
    with pytest.raises(error, match=f"async_scheduling=True conflicts with .*{match}"):
        build_engine(hf, block_size=16, blocks=8, paused_blocks=2, max_tokens=32,
                     kernel_backend="torch", async_scheduling=True, **kwargs)
    # Each alone is fine.
    build_engine(hf, block_size=16, blocks=8, paused_blocks=2, max_tokens=32,
                 kernel_backend="torch", **kwargs)


def test_async_scheduling_must_be_a_bool():
    hf = tiny_llama(seed=5)
    with pytest.raises(TypeError, match="async_scheduling='yes' must be a bool"):
        build_engine(hf, block_size=16, blocks=8, paused_blocks=2, max_tokens=32,
                     kernel_backend="torch", async_scheduling="yes")


def _events_of_async_run(hf, requests, arrivals):
    """An async run without termination ids: ``{request id: token}`` of the requests whose
    token sampled in the step whose update first paused (evicted) them appears there for the
    first time in their output (a step's tokens arrive with the next step)."""
    paused_at: Dict[int, int] = {}
    evicted_at: Dict[int, int] = {}
    sampled: Dict[tuple, tuple] = {}  # (step, request id) -> (token, its index in the output)
    delivered: Dict[int, int] = {}

    def record(step):
        for rid, token in step.new_tokens.items():
            sampled[(step.step - 1, rid)] = (token, delivered.get(rid, 0))
            delivered[rid] = delivered.get(rid, 0) + 1
        for rid in step.paused_ids:
            paused_at.setdefault(rid, step.step)
        for rid in step.evicted_ids:
            evicted_at.setdefault(rid, step.step)

    engine = build_engine(hf, **case_engine_sizes(CASE), kernel_backend="torch",
                          async_scheduling=True, step_callback=record)
    results = {r.request_id: r for r in engine.generate_requests(requests,
                                                                  arrival_steps=arrivals)}

    def first_occurrences(events):
        chosen = {}
        for rid, step in events.items():
            if (step, rid) in sampled:
                token, index = sampled[(step, rid)]
                if token not in results[rid].generated_tokens[:index]:
                    chosen[rid] = token
        return chosen

    return first_occurrences(paused_at), first_occurrences(evicted_at)


def with_stop(requests, rid: int, token: int) -> List[DynamicInferenceRequest]:
    """Copies of ``requests`` in which request ``rid`` stops at ``token`` (its termination
    id)."""
    copies = []
    for request in requests:
        params = SamplingParams(**{**vars(request.sampling_params)})
        if request.request_id == rid:
            params.termination_id = token
        copies.append(DynamicInferenceRequest(request_id=request.request_id,
                                              prompt_tokens=list(request.prompt_tokens),
                                              sampling_params=params))
    return copies


@pytest.mark.parametrize("event", ["paused", "evicted"])
def test_a_request_stopping_as_it_pauses_or_is_evicted(event):
    """A request whose token is its termination id in the very step whose update pauses it
    (it retires while paused, and is released once it resumes or is evicted) or evicts it
    (re-queued for recompute, then dropped from the queue once its token is read): its tokens
    and every other request's equal the synchronous engine's."""
    # Seed 4: the token request 6 samples in the step that evicts it is unique in its output
    # (with seed 0 it is not, and it would stop earlier).
    hf = tiny_llama(seed=4)
    prompts, requests, arrivals = pressure_workload(hf, CASE, BASE_LENGTHS, BASE_GENS)
    at_pause, at_evict = _events_of_async_run(hf, requests, arrivals)
    chosen = at_pause if event == "paused" else at_evict
    assert chosen, f"the workload has no request whose {event} step token is unique"
    rid, token = min(chosen.items())
    stopping = with_stop(requests, rid, token)

    def run(async_scheduling):
        engine = build_engine(hf, **case_engine_sizes(CASE), kernel_backend="torch",
                              async_scheduling=async_scheduling)
        results = engine.generate_requests(stopping, arrival_steps=arrivals)
        assert not engine.context.has_unfinished_requests()
        assert engine.context.block_allocator.total_avail == CASE["blocks"] - 1
        return engine, results

    _, sync = run(False)
    engine, asynchronous = run(True)
    assert outcome(asynchronous) == outcome(sync)
    stopped = asynchronous[rid]
    assert stopped.finish_reason == "stop" and stopped.generated_tokens[-1] == token
    counts = engine.async_scheduling_counts
    if event == "paused":
        assert counts["retired_paused"] >= 1, counts
    else:
        assert counts["evicted_stops"] >= 1 and counts["early_reads"] >= 1, counts


@pytest.mark.parametrize("model", ["llama-prefix-caching", "nemotron-h"])
def test_prefix_caching_and_hybrid_models_equal_sync(model):
    """Prefix caching (LRU: finished requests' blocks stay cached, so a retired request's
    blocks are published and reused) and a hybrid Mamba model (the retired row's extra step
    moves its Mamba state, then releases it): async equals the synchronous engine."""
    if model == "nemotron-h":
        from test_nemotron_h import GENS, LENGTHS, tiny_nemotron_h
        from test_nemotron_h import build_engine as build_hybrid

        hf = tiny_nemotron_h()
        prompts = make_prompts(LENGTHS, hf.config.vocab_size)
        gens, arrivals = GENS, None
        sizes = dict(block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
                     attention_backend="torch")
        build = build_hybrid
    else:
        from test_prefix_caching import shared_prefix_workload

        hf = tiny_llama(seed=5)
        prompts, gens, arrivals = shared_prefix_workload(hf.config.vocab_size)
        sizes = dict(block_size=16, blocks=16, paused_blocks=3, max_tokens=32,
                     enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
        build = build_engine
    requests = greedy_requests(prompts, gens)
    plain = build(hf, kernel_backend="torch", **sizes).generate_requests(
        requests, arrival_steps=arrivals)
    stopping = with_termination_ids(requests, {r.request_id: r.generated_tokens for r in plain})

    def run(async_scheduling):
        engine = build(hf, kernel_backend="torch", async_scheduling=async_scheduling, **sizes)
        results = engine.generate_requests(stopping, arrival_steps=arrivals)
        assert not engine.context.has_unfinished_requests()
        return engine, results

    _, sync = run(False)
    engine, asynchronous = run(True)
    assert outcome(asynchronous) == outcome(sync)
    assert engine.async_scheduling_counts["retired"] >= 3
    if model != "nemotron-h":
        assert engine.stats.pauses > 0
        assert engine.stats.prefix_cache["prefix_cache_hits"] >= 3


def test_seeded_sampling_equals_sync():
    """A seeded draw depends on the request and on how many tokens it generated (counting the
    one still in flight), so seeded sampling also equals the synchronous engine's, with
    pauses and an eviction (a recompute) on the way."""
    hf = tiny_llama()
    prompts, requests, arrivals = pressure_workload(hf, CASE, BASE_LENGTHS, BASE_GENS)
    for i, request in enumerate(requests):
        params = request.sampling_params
        params.temperature, params.top_k, params.top_p, params.seed = 0.9, 20, 0.95, 100 + i

    def run(async_scheduling):
        engine = build_engine(hf, **case_engine_sizes(CASE), kernel_backend="torch",
                              async_scheduling=async_scheduling)
        return engine, engine.generate_requests(requests, arrival_steps=arrivals)

    _, sync = run(False)
    engine, asynchronous = run(True)
    assert outcome(asynchronous) == outcome(sync)
    assert engine.stats.pauses > 0 and engine.stats.evictions > 0


def test_demo_with_async_scheduling_matches(capsys):
    from dynctx import cli_demo

    assert cli_demo.main(["--requests", "8", "--max-new-tokens", "8", "--async-scheduling",
                          "--plot", "", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "check             OK: 8/8 outputs match" in out
    assert "async scheduling  tokens read one step late" in out
    with pytest.raises(SystemExit, match="--async-scheduling with --dtype bf16"):
        cli_demo.main(["--async-scheduling", "--dtype", "bf16", "--plot", "", "--no-progress"])


def test_bench_runs_and_outputs_agree(capsys):
    import async_scheduling

    assert async_scheduling.main(["--requests", "4", "--new-tokens", "4", "--repeats", "1",
                                  "--threads", "0"]) == 0
    out = capsys.readouterr().out
    assert "outputs identical" in out and re.search(r"^async\s+\d+", out, re.M)


def test_context_vocab_size_works_with_async():
    """The context's ``vocab_size`` (without ``validate``) makes the model give every token's
    logits and the engine pick the last rows through the context: no host read, so async
    scheduling takes it and equals the synchronous engine."""
    hf = tiny_llama(seed=6)
    prompts = make_prompts([5, 30, 2], hf.config.vocab_size, seed=7)
    requests = greedy_requests(prompts, [6, 9, 4])

    def run(async_scheduling):
        engine = build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=24,
                              kernel_backend="torch", vocab_size=hf.config.vocab_size,
                              async_scheduling=async_scheduling)
        return engine.generate_requests(requests)

    assert outcome(run(True)) == outcome(run(False))
