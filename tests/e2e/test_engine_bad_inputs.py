"""The engine isolates requests (a tiny random Llama, fp32, torch backends).

* A call with a bad argument raises ``TypeError``/``ValueError`` naming the argument, the value
  and the limit, and leaves the engine's queue and results and the context exactly as they were;
  the good requests then run on and give transformers' greedy tokens.
* A request that can only fail later (the context refuses it, its logits hold NaN with
  ``validate=True``) finishes with ``finish_reason="error"``; every other request gets its
  result.
* A step callback or metrics writer that raises once loses no result and leaves the engine and
  the context agreeing; ``generate_requests`` and ``run`` hand back what they had collected.
* ``vocab_size`` as a context keyword works; ``stats.history`` is bounded.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from e2e_helpers import build_engine, greedy_requests, hf_greedy, make_prompts, tiny_llama

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine
from dynctx.engine.engine import DEFAULT_HISTORY_WINDOW
from dynctx.engine.sampling import sample, sample_checked

VOCAB = 256
PROMPT_LENGTHS = [5, 23, 9, 40]
GENS = [8, 6, 10, 5]


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(seed=21, vocab=VOCAB)


@pytest.fixture(scope="module")
def prompts(hf):
    return make_prompts(PROMPT_LENGTHS, VOCAB, seed=22)


@pytest.fixture(scope="module")
def greedy(hf, prompts):
    """transformers' greedy tokens for each prompt alone."""
    return [hf_greedy(hf, p, g) for p, g in zip(prompts, GENS)]


def small_engine(hf, **kwargs) -> Engine:
    """10 blocks of 16 tokens (2 paused), 24 tokens a step: the 40-token prompt is chunked;
    requests up to 96 tokens (6 blocks: one request alone always fits the active budget)."""
    kwargs.setdefault("max_sequence_length", 96)
    return build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=24,
                        kernel_backend="torch", **kwargs)


def state(engine: Engine) -> dict:
    """The engine's queue, requests and undelivered results, and the context's rows and
    allocator: what a refused call must leave unchanged."""
    ctx = engine.context
    engine_side = dict(queued=engine.scheduler.queued_ids(),
                       unfinished=engine.unfinished_request_ids(),
                       undelivered=[r.request_id for r in engine.undelivered_results],
                       step=engine.step_count, suspended=engine.suspended)
    if not ctx.is_tensor_state_allocated:
        return engine_side
    T = ctx.total_request_count
    return dict(engine_side, rows=ctx.host_request_ids()[:T].tolist(),
                counts=(T, ctx.paused_request_count, ctx.active_token_count,
                        ctx.chunked_prefill_request_id),
                free_blocks=ctx.block_allocator.total_avail,
                block_table=ctx.block_table_host[:T].tolist())


def request(rid, prompt, gen=4, **params) -> DynamicInferenceRequest:
    params.setdefault("top_k", 1)
    return DynamicInferenceRequest(request_id=rid, prompt_tokens=list(prompt),
                                   sampling_params=SamplingParams(num_tokens_to_generate=gen,
                                                                  **params))


def with_params(rid, prompt, **fields) -> DynamicInferenceRequest:
    """A request whose sampling fields are set after construction (past SamplingParams'
    own checks), as a caller mutating a request would."""
    req = request(rid, prompt)
    for name, value in fields.items():
        setattr(req.sampling_params, name, value)
    return req


def assert_greedy(results, greedy, ids=None):
    ids = range(len(greedy)) if ids is None else ids
    by_id = {r.request_id: r for r in results}
    assert sorted(by_id) == sorted(ids), f"results for {sorted(by_id)}, wanted {sorted(ids)}"
    for rid in ids:
        assert by_id[rid].finish_reason == "length", (rid, by_id[rid].error)
        assert by_id[rid].generated_tokens == greedy[rid], f"request {rid}"


# ------------------------------------------------------------------ refused at add_request
BAD_REQUESTS = [
    pytest.param(lambda p: request(-1, p), ValueError,
                 r"request_id=-1 must lie in \[0, 2147483647\]", id="id_negative"),
    pytest.param(lambda p: request(2 ** 40, p), ValueError,
                 r"request_id=1099511627776 .*2147483647", id="id_2_40"),
    pytest.param(lambda p: request(True, p), TypeError, r"request_id=True must be an int",
                 id="id_bool"),
    pytest.param(lambda p: request(0, p), ValueError, r"request_id=0 is already in use",
                 id="id_duplicate"),
    pytest.param(lambda p: request(50, p, top_k=2 ** 40), ValueError,
                 r"top_k=1099511627776 must lie in \[-2147483648, 2147483647\].*int32",
                 id="top_k_2_40"),
    pytest.param(lambda p: request(50, p, termination_id=2 ** 70), ValueError,
                 r"termination_id=1180591620717411303424 must lie in .*9223372036854775807",
                 id="termination_2_70"),
    pytest.param(lambda p: request(50, [3, -1, 4]), ValueError,
                 r"prompt_tokens\[1\]=-1 is outside the vocabulary \[0, 256\)",
                 id="token_negative"),
    pytest.param(lambda p: request(50, [3, VOCAB, 4]), ValueError,
                 r"prompt_tokens\[1\]=256 is outside the vocabulary \[0, 256\)",
                 id="token_vocab"),
    pytest.param(lambda p: request(50, p, seed="abc"), TypeError, r"seed='abc' must be an int",
                 id="seed_str"),
    pytest.param(lambda p: request(50, []), ValueError, r"prompt_tokens is empty",
                 id="empty_prompt"),
    pytest.param(lambda p: request(50, p, gen=0), ValueError,
                 r"num_tokens_to_generate=0 must lie in \[1, inf\]", id="gen_zero"),
    pytest.param(lambda p: with_params(50, p, num_tokens_to_generate=2.5), TypeError,
                 r"num_tokens_to_generate=2.5 must be an int", id="gen_float"),
    pytest.param(lambda p: with_params(50, p, num_tokens_to_generate="abc"), TypeError,
                 r"num_tokens_to_generate='abc' must be an int", id="gen_str"),
    pytest.param(lambda p: with_params(50, p, temperature=float("nan")), ValueError,
                 r"temperature=nan must be a finite number >= 0", id="temperature_nan"),
    pytest.param(lambda p: with_params(50, p, top_p=1.5), ValueError,
                 r"top_p=1.5 must lie in \[0, 1\]", id="top_p"),
    pytest.param(lambda p: {"request_id": 50}, TypeError,
                 r"request must be a DynamicInferenceRequest, got dict", id="not_a_request"),
]


@pytest.mark.parametrize("make, error, message", BAD_REQUESTS)
def test_bad_request_is_refused_before_anything_changes(hf, prompts, greedy, make, error,
                                                        message):
    engine = small_engine(hf)
    for req in greedy_requests(prompts, GENS):
        engine.add_request(req)
    finished = engine.step().finished + engine.step().finished
    before = state(engine)
    assert before["rows"], "requests must be running when the bad one comes"
    with pytest.raises(error, match=message):
        engine.add_request(make(prompts[0]))
    assert state(engine) == before
    assert_greedy(finished + engine.run(), greedy)


def test_bad_arrival_step_is_refused(hf, prompts, greedy):
    engine = small_engine(hf)
    before = state(engine)
    with pytest.raises(ValueError, match=r"arrival_step=-3 must lie in \[0, inf\]"):
        engine.add_request(request(0, prompts[0], GENS[0]), arrival_step=-3)
    with pytest.raises(TypeError, match=r"arrival_step='1' must be an int"):
        engine.add_request(request(0, prompts[0], GENS[0]), arrival_step="1")
    assert state(engine) == before
    assert_greedy(engine.generate_requests(greedy_requests(prompts, GENS)), greedy)


# ------------------------------------------------------------------ generate_requests / generate
def test_generate_requests_checks_every_request_before_queueing_any(hf, prompts, greedy):
    engine = small_engine(hf)
    good = greedy_requests(prompts, GENS)
    before = state(engine)
    with pytest.raises(ValueError, match=r"requests\[2\]\.prompt_tokens is empty"):
        engine.generate_requests(good[:2] + [request(9, [])])
    with pytest.raises(ValueError, match=r"arrival_steps\[1\]=-1 must lie in \[0, inf\]"):
        engine.generate_requests(good, arrival_steps=[0, -1, 0, 0])
    with pytest.raises(ValueError, match=r"requests\[1\]\.request_id=0 repeats requests\[0\]"):
        engine.generate_requests([good[0], request(0, prompts[1])])
    with pytest.raises(ValueError, match="arrival_steps has 2 entries for 4 requests"):
        engine.generate_requests(good, arrival_steps=[0, 1])
    with pytest.raises(TypeError, match=r"requests is one DynamicInferenceRequest"):
        engine.generate_requests(good[0])
    assert state(engine) == before
    # Nothing of the refused calls runs later, and the next call gets all of its results.
    assert_greedy(engine.generate_requests(good), greedy)
    assert not engine.has_unfinished_requests()


def test_generate_requests_refused_while_suspended(hf, prompts, greedy):
    engine = small_engine(hf)
    engine.add_request(request(10, prompts[1], GENS[1]))
    engine.step()
    engine.suspend()
    before = state(engine)
    with pytest.raises(RuntimeError, match="generate_requests: the engine is suspended"):
        engine.generate_requests(greedy_requests(prompts, GENS))
    with pytest.raises(RuntimeError, match="generate: the engine is suspended"):
        engine.generate(prompts)
    assert state(engine) == before
    engine.resume()
    results = engine.generate_requests(greedy_requests(prompts, GENS))
    assert_greedy(results, greedy)
    # The request queued before the suspend is not dropped: the next run returns it.
    (other,) = engine.run()
    assert other.request_id == 10 and other.generated_tokens == greedy[1]


BAD_GENERATE = [
    pytest.param(dict(prompts="hello"), TypeError, r"prompts is a str", id="prompts_str"),
    pytest.param(dict(prompts=["hello"]), TypeError, r"prompts\[0\] is a str: give token ids",
                 id="prompt_str"),
    pytest.param(dict(prompts=[3, 4, 5]), TypeError,
                 r"prompts is a flat list of 3 numbers.*\[prompt\]", id="flat_list"),
    pytest.param(dict(prompts=[[3, 4], [5, VOCAB + 4]]), ValueError,
                 r"prompts\[1\]\[1\]=260 is outside the vocabulary \[0, 256\)", id="token_vocab"),
    pytest.param(dict(prompts=[[3, 4], [5, -2]]), ValueError,
                 r"prompts\[1\]\[1\]=-2 is outside the vocabulary", id="token_negative"),
    pytest.param(dict(prompts=[[3, 4], []]), ValueError, r"prompts\[1\] is empty",
                 id="empty_prompt"),
    pytest.param(dict(prompts=[[1.7, 2.2]]), ValueError,
                 r"prompts\[0\]\[0\]=1.7 is not a whole number", id="float_prompt"),
    pytest.param(dict(prompts=[np.array([1.5, 2.0])]), ValueError,
                 r"prompts\[0\]\[0\]=1.5 is not a whole number", id="numpy_float_prompt"),
    pytest.param(dict(prompts=[[True, False]]), TypeError,
                 r"prompts\[0\]\[0\]=True must be an int token id", id="bool_prompt"),
    pytest.param(dict(prompts=[[3, [4]]]), TypeError, r"prompts\[0\]\[1\]=\[4\]", id="nested"),
    pytest.param(dict(prompts=[[3, 4]], max_new_tokens=2.5), TypeError,
                 r"max_new_tokens=2.5 must be an int", id="max_new_float"),
    pytest.param(dict(prompts=[[3, 4]], max_new_tokens="abc"), TypeError,
                 r"max_new_tokens='abc' must be an int", id="max_new_str"),
    pytest.param(dict(prompts=[[3, 4]], max_new_tokens=0), ValueError,
                 r"max_new_tokens=0 must lie in \[1, inf\]", id="max_new_zero"),
    pytest.param(dict(prompts=[[3, 4]], termination_id=2 ** 70), ValueError,
                 r"termination_id=1180591620717411303424 must lie in", id="termination_2_70"),
    pytest.param(dict(prompts=[[3, 4], [5]], sampling_params=[SamplingParams(),
                                                              SamplingParams(seed="abc")]),
                 TypeError, r"sampling_params\[1\]\.seed='abc' must be an int", id="seed"),
    pytest.param(dict(prompts=[[3, 4]], sampling_params=SamplingParams(top_k=2 ** 40)),
                 ValueError, r"sampling_params\.top_k=1099511627776 must lie in", id="top_k"),
    pytest.param(dict(prompts=[[3, 4], [5]], arrival_steps=[0, -1]), ValueError,
                 r"arrival_steps\[1\]=-1 must lie in \[0, inf\]", id="arrival_negative"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_GENERATE)
def test_generate_refuses_bad_arguments_naming_the_prompt(hf, prompts, greedy, kwargs, error,
                                                          message):
    engine = small_engine(hf)
    engine.add_request(request(10, prompts[1], GENS[1]))
    engine.step()
    before = state(engine)
    with pytest.raises(error, match=message):
        engine.generate(**kwargs)
    assert state(engine) == before
    outputs = engine.generate(prompts, max_new_tokens=5, ignore_eos=True)
    assert outputs == [g[:5] for g in greedy]


def test_bad_containers_are_refused_naming_the_argument(hf, prompts, greedy):
    """Containers of the wrong kind: before, ``arrival_steps=0`` and ``requests=None`` stopped
    at ``'int' object is not iterable``, a dict of ``sampling_params`` was read as its keys, a
    dict prompt as its keys (in any order), a meta-device prompt at torch's copy error."""
    engine = small_engine(hf)
    engine.add_request(request(10, prompts[1], GENS[1]))
    engine.step()
    before = state(engine)
    for call, error, message in [
            (lambda: engine.generate([[3, 4]], arrival_steps=0), TypeError,
             r"arrival_steps must be a list of int \(one per request\), got int"),
            (lambda: engine.generate_requests(None), TypeError,
             r"requests must be a list of DynamicInferenceRequest .*got NoneType"),
            (lambda: engine.generate([[3, 4]], sampling_params={"top_k": 1}), TypeError,
             r"sampling_params must be a SamplingParams or a list of SamplingParams"),
            (lambda: engine.generate([[3, 4], [5]], sampling_params=[SamplingParams()]),
             ValueError, r"sampling_params has 1 entries for 2 prompts"),
            (lambda: engine.generate([torch.tensor([3, 4], device="meta")]), ValueError,
             r"prompts\[0\] is on the meta device"),
            (lambda: engine.add_request(DynamicInferenceRequest(
                request_id=50, prompt_tokens={5: 1, 3: 1})), TypeError,
             r"prompt_tokens must be token ids in order .*not a dict")]:
        with pytest.raises(error, match=message):
            call()
        assert state(engine) == before
    (other,) = engine.run()
    assert other.request_id == 10 and other.generated_tokens == greedy[1][:GENS[1]]


def test_a_request_beyond_the_kv_budget_names_the_budget(hf, prompts, greedy):
    """A request that alone needs more blocks than the active budget finishes at once with an
    error naming ``block_size_tokens`` and ``buffer_size_gb`` (before: only the block
    counts); the others give transformers' tokens."""
    engine = small_engine(hf, max_sequence_length=256)
    long = request(9, list(range(3, 153)), gen=4)
    results = engine.generate_requests(greedy_requests(prompts, GENS) + [long])
    assert results[-1].finish_reason == "error" and results[-1].generated_tokens == []
    assert ("prompt (150) + num_tokens_to_generate (4) needs 10 KV blocks of "
            "block_size_tokens=16, more than the active budget of 7 blocks (buffer_size_gb="
            in results[-1].error) and results[-1].error.endswith("raise buffer_size_gb")
    assert_greedy(results[:-1], greedy)


def test_generate_accepts_whole_floats_and_tensors(hf, prompts, greedy):
    engine = small_engine(hf)
    as_floats = [float(t) for t in prompts[0]]
    outputs = engine.generate([as_floats, torch.tensor(prompts[2]), np.array(prompts[3])],
                              max_new_tokens=5, ignore_eos=True)
    assert outputs == [greedy[0][:5], greedy[2][:5], greedy[3][:5]]


# ------------------------------------------------------------------ failing later, isolated
def test_a_request_the_context_refuses_finishes_with_an_error(hf, prompts, greedy, monkeypatch):
    """The context's ``add_request`` refuses request 2 when it is scheduled (it checks
    before it changes anything): request 2 finishes with the error, the others run on."""
    engine = small_engine(hf)
    real_add = engine.context.add_request

    def add(req, chunk_length=None):
        if req.request_id == 2:
            raise ValueError("request 2: refused by the test")
        real_add(req, chunk_length)

    monkeypatch.setattr(engine.context, "add_request", add)
    results = engine.generate_requests(greedy_requests(prompts, GENS))
    assert results[2].finish_reason == "error" and "refused by the test" in results[2].error
    assert results[2].generated_tokens == []
    assert_greedy([r for r in results if r.request_id != 2], greedy, ids=[0, 1, 3])
    assert engine.stats.errors == 1


def test_a_request_the_scheduler_cannot_place_finishes_with_an_error(hf, prompts, greedy,
                                                                      monkeypatch):
    """Should the scheduler ever be unable to add a waiting request even to an empty context
    (forced here for request 1: no case is known), that request finishes with an error naming
    the counts, and the others run on; before, ``step()`` raised for the whole engine."""
    engine = small_engine(hf)
    real_first_chunk = engine.scheduler._first_chunk

    def first_chunk(request):
        return None if request.request_id == 1 else real_first_chunk(request)

    monkeypatch.setattr(engine.scheduler, "_first_chunk", first_chunk)
    results = engine.generate_requests(greedy_requests(prompts, GENS))
    assert results[1].finish_reason == "error" and results[1].generated_tokens == []
    assert "cannot add the request even to an empty context (23 prompt tokens" in \
        results[1].error
    assert_greedy([r for r in results if r.request_id != 1], greedy, ids=[0, 2, 3])
    assert not engine.has_unfinished_requests()


class NaNLogits:
    """The model, with the logits of request ``bad_id`` replaced by NaN from ``from_step``
    on (every token row of it when all rows are computed)."""

    def __init__(self, model, bad_id: int, from_step: int):
        self.model, self.bad_id, self.from_step, self.steps = model, bad_id, from_step, 0

    def forward(self, ctx, last_token_only=False):
        output = self.model.forward(ctx, last_token_only=last_token_only)
        self.steps += 1
        P, T = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids()[P:T].tolist()
        if self.steps <= self.from_step or self.bad_id not in ids:
            return output
        row = ids.index(self.bad_id)
        output = output.clone()
        if last_token_only:
            output[row] = float("nan")
        else:
            cu = ctx.active_attn_metadata.cu_query_seq_lengths.tolist()
            output[0, cu[row]:cu[row + 1]] = float("nan")
        return output

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("bad_id, from_step", [(0, 2), (3, 0)], ids=["decoding", "chunked"])
def test_nan_logits_finish_that_request_with_an_error(hf, prompts, greedy, bad_id, from_step):
    """With ``validate=True`` the engine checks the logits (not the hidden states): the request
    whose logits hold NaN finishes with an error (request 3 while its 40-token prompt is
    chunked), the others give transformers' tokens, and nothing is left in the context."""
    engine = small_engine(hf, validate=True)
    engine.model = NaNLogits(engine.model, bad_id, from_step)
    results = engine.generate_requests(greedy_requests(prompts, GENS))
    bad = results[bad_id]
    assert bad.finish_reason == "error" and "NaN" in bad.error
    assert_greedy([r for r in results if r.request_id != bad_id], greedy,
                  ids=[i for i in range(len(prompts)) if i != bad_id])
    if bad_id == 3:
        assert engine.stats.chunked_prefills >= 1 and bad.generated_tokens == []
    ctx = engine.context
    assert not engine.has_unfinished_requests() and ctx.total_request_count == 0
    assert ctx.chunked_prefill_request_id == -1
    assert ctx.block_allocator.total_avail == ctx.block_allocator.total_count - 1


def test_sampling_never_indexes_minus_one_on_nan_logits():
    """Without ``validate`` NaN logits reach sampling: every row still gets a token id in
    range, and a tiny temperature does not turn finite logits into NaN."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    logits[1] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, seed=2),
              SamplingParams(temperature=1e-30, seed=3)]
    tokens = sample(logits, params, [0, 0, 0], np.random.default_rng(0))
    assert tokens.min() >= 0 and tokens.max() < 50
    assert int(tokens[2]) == int(logits[2].argmax())


def test_a_temperature_below_fp32_range_samples_the_top_token():
    """``temperature=1e-300`` rounds to 0 in fp32: the top logit was scaled to 0/0 and the
    request refused for "NaN logits"; it now draws the argmax, as 1e-30 does."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1e-300, seed=1), SamplingParams(temperature=1e-45,
                                                                         seed=2)]
    tokens, checked = sample_checked(logits, params, [0, 0], np.random.default_rng(0))
    assert tokens.tolist() == checked.tolist() == logits.argmax(dim=-1).tolist()


def seeded_requests(prompts, temperature=0.8):
    return [DynamicInferenceRequest(request_id=i, prompt_tokens=list(p),
                                    sampling_params=SamplingParams(
                                        temperature=temperature, seed=40 + i,
                                        num_tokens_to_generate=g))
            for i, (p, g) in enumerate(zip(prompts, GENS))]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("bad_id, from_step", [(0, 2), (3, 0)], ids=["decoding", "chunked"])
def test_sampling_refuses_nan_logits_without_validate(hf, prompts, bad_id, from_step,
                                                     async_scheduling):
    """Without ``validate``, NaN logits reach sampling (``temperature=0.8``): that request
    finishes with an error saying so (before, it got token 0 every step, silently), its
    tokens before the NaN kept; the others draw what they draw in a clean run."""
    clean = small_engine(hf, async_scheduling=async_scheduling).generate_requests(
        seeded_requests(prompts))
    engine = small_engine(hf, async_scheduling=async_scheduling)
    engine.model = NaNLogits(engine.model, bad_id, from_step)
    results = engine.generate_requests(seeded_requests(prompts))
    bad = results[bad_id]
    assert bad.finish_reason == "error" and "sampling refused the request" in bad.error
    assert "NaN" in bad.error and engine.stats.errors == 1
    # The forwards before the NaN gave their tokens (request 3's chunks give none).
    kept = 0 if bad_id == 3 else from_step
    assert bad.generated_tokens == clean[bad_id].generated_tokens[:kept]
    for other, reference in zip(results, clean):
        if other.request_id != bad_id:
            assert other.finish_reason == "length"
            assert other.generated_tokens == reference.generated_tokens, other.request_id
    ctx = engine.context
    assert not engine.has_unfinished_requests() and ctx.total_request_count == 0
    assert ctx.block_allocator.total_avail == ctx.block_allocator.total_count - 1


def test_vocab_size_as_a_context_keyword(hf, prompts, greedy):
    engine = small_engine(hf, vocab_size=VOCAB)
    assert engine.context.vocab_size == VOCAB
    assert_greedy(engine.generate_requests(greedy_requests(prompts, GENS)), greedy)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\]=256 is outside the vocabulary"):
        engine.generate([[VOCAB]])


# ------------------------------------------------------------------ raising callbacks
def test_a_raising_step_callback_loses_no_result(hf, prompts, greedy):
    """The callback raises once, on the first step where a request finishes: the error
    propagates after the step, the engine and the context agree, and the next step returns
    the finished results again."""
    seen = []
    raised = []

    def callback(step):
        seen.append([r.request_id for r in step.finished])
        if step.finished and not raised:
            raised.append(step.step)
            raise KeyError("callback failed")

    engine = small_engine(hf, step_callback=callback)
    for req in greedy_requests(prompts, GENS):
        engine.add_request(req)
    results = []
    with pytest.raises(KeyError, match="callback failed"):
        while engine.has_unfinished_requests():
            results += engine.step().finished
    lost = seen[-1]
    assert lost and not any(r.request_id in lost for r in results)
    ctx = engine.context
    running = set(ctx.host_request_ids()[:ctx.total_request_count].tolist())
    assert running <= set(engine.unfinished_request_ids()) and not running & set(lost)
    retry = engine.step()
    assert [r.request_id for r in retry.finished][:len(lost)] == lost
    assert_greedy(results + retry.finished + engine.run(), greedy)


class FlakyWriter:
    """A metrics writer that raises once: at the first update where the context holds fewer
    requests than at the previous one (a request finished)."""

    def __init__(self):
        self.previous, self.raised = 0, False

    def log(self, data):
        count = data["inference/total_request_count"]
        fewer, self.previous = count < self.previous, count
        if fewer and not self.raised:
            self.raised = True
            raise OSError("metrics backend unreachable")


def test_a_raising_metrics_writer_leaves_engine_and_context_agreeing(hf, prompts, greedy):
    writer = FlakyWriter()
    engine = small_engine(hf, metrics_writer=writer)
    for req in greedy_requests(prompts, GENS):
        engine.add_request(req)
    results = []
    with pytest.raises(OSError, match="metrics backend unreachable"):
        while engine.has_unfinished_requests():
            results += engine.step().finished
    ctx = engine.context
    assert ctx.metrics_writer is writer
    running = ctx.host_request_ids()[:ctx.total_request_count].tolist()
    # Every request the context holds is one the engine tracks, and every finished one left both.
    assert set(running) <= set(engine.unfinished_request_ids())
    finished_now = [r.request_id for r in engine.undelivered_results]
    tracked = set(engine.unfinished_request_ids())
    assert finished_now and not set(finished_now) & (set(running) | tracked)
    assert_greedy(results + engine.run(), greedy)


def test_generate_requests_keeps_collected_results_when_a_step_raises(hf, prompts, greedy):
    steps = []

    def callback(step):
        steps.append(step.step)
        if len(steps) == 12:  # after requests 0 and 1 have finished
            raise RuntimeError("stream closed")

    engine = small_engine(hf, step_callback=callback)
    with pytest.raises(RuntimeError, match="stream closed"):
        engine.generate_requests(greedy_requests(prompts, GENS))
    assert len(engine.undelivered_results) >= 2, "requests 0 and 1 had finished before the error"
    assert_greedy(engine.run(), greedy)


# ------------------------------------------------------------------ bounded history
def test_history_is_a_bounded_window(hf, prompts):
    engine = small_engine(hf, history_window=3)
    engine.generate_requests(greedy_requests(prompts, GENS))
    history = engine.stats.history
    assert engine.stats.forward_steps > 3 and len(history) == 3
    assert history[-1].step == engine.step_count - 1
    assert all(h.new_tokens == {} and h.finished == [] for h in history)
    off = small_engine(hf, history_window=0)
    off.generate_requests(greedy_requests(prompts[:1], GENS[:1]))
    assert len(off.stats.history) == 0
    assert small_engine(hf).stats.history.maxlen == DEFAULT_HISTORY_WINDOW
    with pytest.raises(ValueError, match=r"history_window=-1 must lie in \[0, inf\]"):
        small_engine(hf, history_window=-1)


def test_engine_arguments_are_checked(hf):
    engine = small_engine(hf)
    for kwargs, error, message in [
            (dict(seed=-1), ValueError, r"seed=-1 must lie in \[0, inf\]"),
            (dict(seed="abc"), TypeError, r"seed='abc' must be an int"),
            (dict(record_logits="yes"), TypeError, r"record_logits='yes' must be a bool"),
            (dict(step_callback=3), TypeError, r"step_callback=3 must be callable"),
            (dict(default_termination_id=1.5), TypeError,
             r"default_termination_id=1.5 must be an int")]:
        with pytest.raises(error, match=message):
            Engine(engine.model, engine.context, **kwargs)


def test_the_engine_parts_are_checked(hf):
    """Before, ``Engine(None, context)`` built an engine whose first step failed, and a
    context or a transformers model of the wrong kind stopped at an ``AttributeError``."""
    engine = small_engine(hf)
    with pytest.raises(TypeError, match=r"model=None must have a callable forward"):
        Engine(None, engine.context)
    with pytest.raises(TypeError, match=r"context must be a DynamicInferenceContext, got str"):
        Engine(engine.model, "context")
    with pytest.raises(TypeError, match=r"hf_model=NoneType must be a transformers causal LM"):
        Engine.from_transformers(None)


@pytest.mark.parametrize("options, message", [
    # Every step raised "logits has 256 vocabulary columns, vocab_size is 1000".
    (dict(vocab_size=1000), r"vocab_size=1000 \(the context's\) must be the model's "
                            r"vocabulary size, 256"),
    # The first step stopped at an IndexError: the context kept 4-token windows the Llama's
    # attention does not have.
    (dict(kv_layer_windows=[4, 4]), r"kv_layer_windows=\[4, 4\] differs from the model's "
                                    r"sliding windows \(none"),
])
def test_a_context_option_the_model_contradicts_is_refused(hf, options, message):
    with pytest.raises(ValueError, match=message):
        small_engine(hf, **options)


class TextVocabDrafter:
    """The drafter interface, but ``vocab_size`` a str (``int("abc")`` raised before)."""

    vocab_size = "abc"

    def propose(self, request_ids, histories, k):
        return np.full((len(request_ids), k), -1)

    def release(self, request_ids):
        pass


INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BAD_ENGINE_OPTIONS = [
    pytest.param(dict(attention_backend="flash"), ValueError,
                 r"attention_backend='flash' must be one of 'auto', 'torch', 'torch_static', "
                 r"'triton', 'flashinfer', 'flash_attn'", id="attention_backend_name"),
    pytest.param(dict(attention_backend="triton"), RuntimeError,
                 r"attention_backend='triton': .*cannot run: device is cpu", id="triton_on_cpu",
                 marks=pytest.mark.skipif(INTERPRETING,
                                          reason="under TRITON_INTERPRET=1 it runs on a CPU")),
    pytest.param(dict(attention_backend="flashinfer"), RuntimeError,
                 r"attention_backend='flashinfer': .*fp16/bf16, not torch.float32",
                 id="flashinfer_fp32"),
    pytest.param(dict(attention_backend="flash_attn"), RuntimeError,
                 r"attention_backend='flash_attn': .*fp16/bf16, not torch.float32",
                 id="flash_attn_fp32"),
    pytest.param(dict(rope="bogus"), ValueError, r"rope='bogus' must be one of", id="rope"),
    pytest.param(dict(prefix_caching_eviction_policy="fifo", enable_prefix_caching=True),
                 ValueError, r"prefix_caching_eviction_policy='fifo' must be one of",
                 id="eviction_policy"),
    pytest.param(dict(enable_prefix_caching="yes"), TypeError, r"enable_prefix_caching",
                 id="prefix_caching_flag"),
    pytest.param(dict(enable_chunked_prefill=None), TypeError,
                 r"enable_chunked_prefill=None must be a bool", id="chunked_prefill"),
    pytest.param(dict(cuda_graphs="no"), TypeError, r"cuda_graphs='no' must be a bool",
                 id="cuda_graphs"),
    pytest.param(dict(async_scheduling=1), TypeError, r"async_scheduling=1 must be a bool",
                 id="async_scheduling"),
    pytest.param(dict(record_logits="yes"), TypeError, r"record_logits='yes' must be a bool",
                 id="record_logits"),
    pytest.param(dict(seed=-1), ValueError, r"seed=-1 must lie in \[0, inf\]", id="seed"),
    pytest.param(dict(history_window=-1), ValueError,
                 r"history_window=-1 must lie in \[0, inf\]", id="history_window"),
    pytest.param(dict(step_callback=3), TypeError, r"step_callback=3 must be callable",
                 id="step_callback"),
    pytest.param(dict(num_speculative_tokens=2, async_scheduling=True, kv_offload_gb=0.001),
                 ValueError, r"enable_deferred_rewind\(\): deferred rewinds are not supported "
                 r"with KV offload .*async_scheduling=False", id="async_speculation_offload"),
    pytest.param(dict(num_speculative_tokens=2, drafter=TextVocabDrafter()), TypeError,
                 r"drafter.vocab_size='abc' must be an int or None", id="drafter_vocab"),
    pytest.param(dict(kernel_backend="nope"), ValueError,
                 r"'nope' is not a kernel backend; expected one of", id="kernel_backend"),
]


@pytest.mark.parametrize("options, error, message", BAD_ENGINE_OPTIONS)
def test_every_engine_option_is_checked_when_the_engine_is_built(hf, options, error, message):
    """A bad option raises from ``from_transformers`` itself, naming the option, the value and
    the choices (or why it cannot run here); before, ``attention_backend="flash"`` built an
    engine whose first ``generate`` failed deep inside the forward."""
    options = dict(dict(kernel_backend="torch"), **options)
    with pytest.raises(error, match=message):
        build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=24,
                     max_sequence_length=96, **options)


@pytest.mark.parametrize("options, message", [
    (dict(block_size_tokens=0), r"block_size_tokens=0 must be a positive integer"),
    (dict(block_size_tokens=-16), r"block_size_tokens=-16 must be a positive integer"),
    (dict(max_sequence_length=0), r"max_sequence_length=0 must be a positive integer"),
    (dict(buffer_size_gb=-1), r"buffer_size_gb=-1 must be a positive number"),
    (dict(max_requests=0), r"max_requests=0 must be a positive integer"),
    # These stopped in the engine's sizing before the context's check: an OverflowError,
    # "'<=' not supported between int and str", and a to() TypeError building the adapter.
    (dict(buffer_size_gb=float("inf")), r"buffer_size_gb=inf must be a positive number"),
    (dict(max_tokens="24"), r"max_tokens='24' must be a positive integer"),
    (dict(params_dtype="fp32"), r"params_dtype='fp32' must be a floating torch.dtype"),
    (dict(device="nope"), r"device='nope' is not a torch device"),
    (dict(kernel_backend="nope"), r"kernel_backend='nope' is not a kernel backend"),
])
def test_a_bad_context_size_is_the_contexts_error(hf, options, message):
    """The engine sizes ``max_requests`` through the context's sizing before building it; a
    bad size reaches the context's own check (``block_size_tokens=0`` used to stop at a
    ZeroDivisionError in that sizing)."""
    options = dict(dict(kernel_backend="torch"), **options)
    with pytest.raises(ValueError, match=message):
        Engine.from_transformers(hf, **options)


def test_numpy_speculative_tokens_are_an_int(hf):
    """``num_speculative_tokens=np.int64(2)`` was refused by the engine while the context
    takes it."""
    engine = small_engine(hf, num_speculative_tokens=np.int64(2))
    assert engine.context.num_speculative_tokens == 2


def test_max_tokens_below_the_request_rounder_sizes_the_requests(hf):
    """``max_tokens=3`` (below the rounder of 4) caps ``max_requests`` at 3; before, the
    engine asked for 4 rows and the context refused its own ``max_requests=4``."""
    engine = build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=3,
                          max_sequence_length=96, kernel_backend="torch")
    assert (engine.context.max_tokens, engine.context.max_requests) == (3, 3)


def test_an_adapter_whose_attention_cannot_run_is_refused_by_the_engine(hf):
    """``Engine(model, context)`` resolves the model's attention for the context at once."""
    from dynctx.models import LlamaAdapter

    context = small_engine(hf).context
    model = LlamaAdapter.from_transformers(hf, attention_backend="flashinfer")
    with pytest.raises(RuntimeError, match=r"attention_backend='flashinfer': .*fp16/bf16"):
        Engine(model, context)

