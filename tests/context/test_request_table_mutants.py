"""Request-table cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md
"Mutation testing"): each added request's sampling metadata lands in its row of
``request_metadata`` (Megatron-Core's per-request metadata tensors), and moves with the row."""

from __future__ import annotations

import torch
from helpers import add, make_ctx, step

from dynctx.context import DynamicInferenceRequest, SamplingParams

PARAMS = {1: dict(temperature=0.5, top_k=3, top_p=0.25, termination_id=7),
          2: dict(temperature=1.5, top_k=0, top_p=0.0, termination_id=None,
                  return_log_probs=True),
          3: dict(temperature=0.0, top_k=1, top_p=0.75, termination_id=0, top_n_logprobs=2)}


def req(rid, length=5):
    return DynamicInferenceRequest(
        request_id=rid, prompt_tokens=torch.arange(100, 100 + length),
        sampling_params=SamplingParams(num_tokens_to_generate=8, **PARAMS[rid]))


def expected(rid, label):
    value = getattr(req(rid).sampling_params, label)
    return -1 if label == "termination_id" and value is None else value


def check_rows(ctx):
    metadata = ctx.request_metadata
    T = ctx.total_request_count
    for row, rid in enumerate(ctx.host_request_ids()[:T].tolist()):
        for label, values in metadata.items():
            assert values[row].item() == torch.tensor(expected(rid, label),
                                                      dtype=values.dtype).item(), (rid, label)


def test_added_requests_hold_their_sampling_metadata_in_their_rows():
    ctx = make_ctx()
    for rid in PARAMS:
        add(ctx, req(rid))
    assert set(ctx.request_metadata) >= {"temperature", "top_k", "top_p", "termination_id"}
    check_rows(ctx)
    step(ctx, finished_ids=(1,))     # the last row moves into the first
    assert ctx.host_request_ids()[:2].tolist() == [3, 2]
    check_rows(ctx)
