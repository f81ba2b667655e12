"""The finish rule (engine/sampling.py ``finish_reason``), as a unit and end to end.

A request stops when it samples its termination id, else when its generated tokens reach its
budget: the stop token wins when it is also the last budgeted token, 0 is a real termination id
(-1 and None mean none), each request has its own id, and ``ignore_eos`` runs to the budget.
End to end, a tiny Llama is relabelled (vocabulary ids 0 and ``t`` swapped in the embedding and
the LM head, which changes nothing but the names of two tokens) so that its greedy generation
samples token 0 at a known step, and the engine must stop where transformers' ``generate`` with
``eos_token_id=0`` stops."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import build_engine, hf_greedy, make_prompts, tiny_llama

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine.sampling import finish_reason


@pytest.mark.parametrize("termination, token, generated, budget, expected", [
    pytest.param(0, 0, 1, 5, "stop", id="id-0-is-a-real-eos"),
    pytest.param(0, 0, 5, 5, "stop", id="id-0-on-the-last-budgeted-token"),
    pytest.param(7, 7, 5, 5, "stop", id="stop-token-is-the-last-budgeted-token"),
    pytest.param(7, 7, 1, 1, "stop", id="budget-of-one"),
    pytest.param(7, 3, 5, 5, "length", id="budget-reached"),
    pytest.param(7, 3, 6, 5, "length", id="past-the-budget"),
    pytest.param(7, 3, 4, 5, None, id="running"),
    pytest.param(7, 0, 4, 5, None, id="token-0-is-not-id-7"),
    pytest.param(None, 0, 1, 5, None, id="no-id"),
    pytest.param(-1, 0, 1, 5, None, id="minus-one-is-no-id"),
    pytest.param(None, 0, 5, 5, "length", id="no-id-budget"),
])
def test_finish_reason(termination, token, generated, budget, expected):
    params = SamplingParams(num_tokens_to_generate=budget, termination_id=termination)
    assert finish_reason(params, token, generated) == expected


# ---------------------------------------------------------------- end to end
def relabelled_llama(eos_step: int):
    """``(hf, prompts)``: a tiny Llama whose greedy continuation of ``prompts[0]`` samples token
    0 as its ``eos_step``-th token (0-based) and never before; the other prompts are free of 0."""
    hf = tiny_llama(seed=3, max_positions=128)
    prompts = make_prompts([6, 9, 4], hf.config.vocab_size, seed=5)
    greedy = hf_greedy(hf, prompts[0], eos_step + 1)
    target = greedy[eos_step]
    assert target != 0 and target not in greedy[:eos_step] and target not in prompts[0]
    with torch.no_grad():   # swap the names of tokens 0 and target
        for weight in (hf.model.embed_tokens.weight, hf.lm_head.weight):
            weight[[0, target]] = weight[[target, 0]].clone()
    swap = {0: target, target: 0}
    prompts = [[swap.get(t, t) for t in prompt] for prompt in prompts]
    assert hf_greedy(hf, prompts[0], eos_step + 1)[eos_step] == 0
    assert 0 not in hf_greedy(hf, prompts[0], eos_step)
    hf.config.eos_token_id = hf.generation_config.eos_token_id = 0
    return hf, prompts


def engine_for(hf, **kwargs):
    return build_engine(hf, block_size=16, blocks=12, paused_blocks=2, max_tokens=32,
                        max_requests=4, kernel_backend="torch", **kwargs)


def request(rid, prompt, budget, termination):
    return DynamicInferenceRequest(
        request_id=rid, prompt_tokens=list(prompt),
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=budget,
                                       termination_id=termination))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_eos_of_0_stops_where_transformers_stops(async_scheduling):
    eos_step = 3
    hf, prompts = relabelled_llama(eos_step)
    engine = engine_for(hf, async_scheduling=async_scheduling)
    # generate() takes the model's EOS (0) by default, as transformers' generate does.
    outputs = engine.generate(prompts, max_new_tokens=8)
    for prompt, output in zip(prompts, outputs):
        assert output == hf_greedy(hf, prompt, 8, eos=0)
    assert outputs[0][-1] == 0 and len(outputs[0]) == eos_step + 1
    # ignore_eos: every prompt runs to its budget, through the 0.
    outputs = engine.generate(prompts, max_new_tokens=8, ignore_eos=True)
    assert outputs == [hf_greedy(hf, prompt, 8) for prompt in prompts]
    assert outputs[0][eos_step] == 0 and len(outputs[0]) == 8


def test_the_stop_token_on_the_last_budgeted_token_and_per_request_ids():
    eos_step = 3
    hf, prompts = relabelled_llama(eos_step)
    others = [hf_greedy(hf, prompt, 6) for prompt in prompts]
    own = others[1][2]   # request 1 stops at its own id, its third token
    assert own not in others[1][:2]
    requests = [
        request(0, prompts[0], eos_step + 1, 0),   # 0 is its last budgeted token: "stop"
        request(1, prompts[1], 6, own),            # its own termination id
        request(2, prompts[2], 6, None),           # no id: the 0 others stop at does not stop it
        request(3, prompts[0], 8, -1),             # -1: no id either
    ]
    results = {r.request_id: r for r in engine_for(hf).generate_requests(requests)}
    assert (results[0].finish_reason, results[0].generated_tokens) == \
        ("stop", others[0][:eos_step] + [0])
    assert (results[1].finish_reason, results[1].generated_tokens) == ("stop", others[1][:3])
    assert (results[2].finish_reason, results[2].generated_tokens) == ("length", others[2])
    assert (results[3].finish_reason, results[3].generated_tokens) == \
        ("length", hf_greedy(hf, prompts[0], 8))
