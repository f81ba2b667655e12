"""Request-table cases that bench/mutation.py's survivors showed untested (CONTRIBUTING.md
"Mutation testing"): each added request's sampling metadata lands in its row of
``request_metadata`` (Megatron-Core's per-request metadata tensors), and moves with the row; a
hybrid's prefix hit restores the Mamba snapshot it resumes from, the first one (index 0)
included."""

from __future__ import annotations

import pytest
import torch
from helpers import add, make_ctx, step

from dynctx.context import (
    DynamicInferenceRequest,
    MambaInferenceStateConfig,
    SamplingParams,
    admission,
)

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


def test_dummy_requests_hold_their_sampling_metadata_in_their_rows():
    """``add_dummy_requests_parallel`` writes each dummy's metadata into its row, after the
    rows already there."""
    ctx = make_ctx()
    add(ctx, req(1))
    ctx.add_dummy_requests_parallel([req(2, length=3), req(3, length=2)])
    assert ctx.host_request_ids()[:3].tolist() == [1, 2, 3]
    check_rows(ctx)


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports ``cuda:0``: a prompt already on the context's device."""

    @property
    def device(self):
        return torch.device("cuda", 0)


@pytest.fixture
def device_prompts(monkeypatch):
    """A CPU context that takes ``_OnDevice`` prompts as its own (``admission.same_device``
    stands in for a context on ``cuda:0``): they take the device-prompt path, copied into the
    step's input ids on the device (``DeviceState.begin_step``) instead of through the host
    prompt buffer."""
    monkeypatch.setattr(admission, "same_device", lambda a, b: True)


def on_device(rid, length):
    prompt = torch.arange(10 * rid, 10 * rid + length).as_subclass(_OnDevice)
    assert prompt.device.type == "cuda"
    return DynamicInferenceRequest(request_id=rid, prompt_tokens=prompt,
                                   sampling_params=SamplingParams(num_tokens_to_generate=4))


def test_device_prompts_reach_the_input_ids_at_their_offsets(device_prompts):
    """Host and device prompts mixed, the last one chunked: every prompt token lands at its
    offset of ``token_to_input_ids``."""
    ctx = make_ctx()
    add(ctx, req(1, length=3))            # host: 100, 101, 102
    add(ctx, on_device(2, 4))             # device: 20..23
    add(ctx, on_device(3, 5), 2)          # device, first chunk: 30, 31
    ctx.initialize_attention_state()
    assert ctx.token_to_input_ids[:9].tolist() == [100, 101, 102, 20, 21, 22, 23, 30, 31]


def test_dummy_device_prompts_reach_the_input_ids_at_their_offsets(device_prompts):
    ctx = make_ctx()
    ctx.add_dummy_requests_parallel([req(1, length=2), on_device(2, 3), on_device(3, 2)])
    ctx.initialize_attention_state()
    assert ctx.token_to_input_ids[:7].tolist() == [100, 101, 20, 21, 22, 30, 31]


def test_dummy_rows_end_on_the_dummy_block_and_their_ids_are_taken():
    """Each dummy row's last block is the dummy block (its every block is), and its id is live:
    a request with that id is refused until the dummies are gone."""
    ctx = make_ctx()
    add(ctx, req(1))
    ctx.add_dummy_requests_parallel([req(2, length=3), req(3, length=6)])
    dummy = ctx.block_allocator.dummy_block_idx
    assert ctx.request_last_kv_block_id[1:3].tolist() == [dummy, dummy]
    assert ctx.request_last_kv_block_id[0].item() != dummy
    with pytest.raises(ValueError, match="already in the context"):
        ctx.add_request(req(3))


@pytest.mark.parametrize("rid", [0, 1, 7])
def test_a_step_without_the_next_chunk_is_refused_whatever_the_request_id(rid):
    """The chunked prefill request's placeholder token is never forwarded, also for the ids 0
    and 1 (the check compares the id with -1)."""
    ctx = make_ctx(max_tokens=16)
    long = DynamicInferenceRequest(request_id=rid, prompt_tokens=torch.arange(100, 120),
                                   sampling_params=SamplingParams(num_tokens_to_generate=4))
    add(ctx, long, chunk_length=8)
    ctx.chunked_prefill_request_id = rid
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True]), torch.tensor([55]))
    with pytest.raises(RuntimeError, match="needs its next chunk"):
        ctx.initialize_attention_state()


def test_a_hybrid_hit_restores_snapshot_0():
    per_request = 4 * (6 * 4 + 2 * 3 * 5)
    ctx = make_ctx(num_layers=2, enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                   mamba_inference_state_config=MambaInferenceStateConfig(
                       ("M", "*"), (6, 4), (2, 3, 5)),
                   prefix_caching_mamba_gb=per_request / 1024 ** 3)
    prompt = torch.arange(100, 113)
    first = DynamicInferenceRequest(request_id=1, prompt_tokens=prompt[:8],
                                    sampling_params=SamplingParams(num_tokens_to_generate=4))
    add(ctx, first)
    ctx.initialize_attention_state()
    conv, ssm = ctx.mamba_states_cache(1)
    slot = int(ctx.mamba_metadata.request_to_mamba_state_idx[0])
    conv[slot].fill_(3.0)                # "the forward": the state after 8 tokens
    ssm[slot].fill_(4.0)
    ctx.update_requests(torch.tensor([False]), torch.tensor([7]))
    assert list(ctx.prefix_cache.mamba.index.values()) == [0]
    conv.fill_(9.0)                      # whatever the slots hold now
    ssm.fill_(9.0)
    add(ctx, DynamicInferenceRequest(request_id=2, prompt_tokens=prompt,
                                     sampling_params=SamplingParams(num_tokens_to_generate=4)))
    assert int(ctx.request_kv_length_offsets[0]) == 8   # it resumes after the 2 blocks
    ctx.initialize_attention_state()
    slot = int(ctx.mamba_metadata.request_to_mamba_state_idx[0])
    assert bool((conv[slot] == 3.0).all()) and bool((ssm[slot] == 4.0).all())
