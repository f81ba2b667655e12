"""Review of async scheduling (engine/overlap.py): cases that broke it, or came closest,
each against the synchronous engine (``async_scheduling=False``)."""

from __future__ import annotations

from typing import Dict, List

from e2e_helpers import build_engine, case_engine_sizes, pressure_workload, tiny_llama
from test_async_scheduling import CASE, _events_of_async_run, outcome
from test_llama_engine import BASE_GENS, BASE_LENGTHS

from dynctx.context import DynamicInferenceRequest, SamplingParams


def _with_stop(requests, rid: int, token: int) -> List[DynamicInferenceRequest]:
    copies = []
    for request in requests:
        params = SamplingParams(**{**vars(request.sampling_params)})
        if request.request_id == rid:
            params.termination_id = token
        copies.append(DynamicInferenceRequest(request_id=request.request_id,
                                              prompt_tokens=list(request.prompt_tokens),
                                              sampling_params=params))
    return copies


def test_a_result_is_delivered_once_its_row_left_the_context_and_its_id_is_free():
    """A request that stops in the step whose update pauses it: its result comes with a step
    after which the context no longer holds it (as in the synchronous engine), so its id can be
    given to a new request at once; both engines then give the same outputs, and a drained
    engine has nothing left in the context."""
    hf = tiny_llama(seed=4)
    _, requests, arrivals = pressure_workload(hf, CASE, BASE_LENGTHS, BASE_GENS)
    at_pause, _ = _events_of_async_run(hf, requests, arrivals)
    rid, token = min(at_pause.items())
    stopping = _with_stop(requests, rid, token)

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
