"""First contact with the context: constructor refusals and warnings that say what to do,
calls out of order, and the request inputs that used to be accepted silently."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, context_args, make_ctx, request
from triton_marks import needs_triton

from dynctx.context import DynamicInferenceContext, DynamicInferenceRequest, SamplingParams, sizing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_device_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device is available"):
        make_ctx(device="cuda")


def test_buffer_smaller_than_two_blocks_warns_with_the_reason():
    with pytest.warns(UserWarning, match=r"holds 1 block.*at least 2.*dummy block"):
        ctx = make_ctx(buffer_size_gb=1.5 * BLOCK / GIB, paused_buffer_size_gb=None,
                       max_sequence_length=4, max_requests=1, max_tokens=8)
    assert ctx.block_allocator.total_count >= 2


@pytest.mark.parametrize("windows", [None, [None, 6]], ids=["one_group", "kv_groups"])
def test_sizing_warning_names_the_line_that_built_the_context(windows):
    """However deep in dynctx the sizing is done (KV groups size inside their own module), the
    warning points at the caller's line, not into dynctx."""
    extra = {} if windows is None else dict(kv_layer_windows=windows)
    with pytest.warns(UserWarning, match="max_sequence_length=1099511627776 needs") as caught:
        DynamicInferenceContext(**context_args(max_sequence_length=2 ** 40, **extra))
    (record,) = [r for r in caught if "max_sequence_length=1099511627776" in str(r.message)]
    assert record.filename == __file__


def test_max_tokens_below_derived_max_requests_says_how_to_set_it():
    with pytest.raises(ValueError, match=r"max_tokens=8 must be >= max_requests=\d+.*derived from "
                                         r"buffer_size_gb.*pass max_requests"):
        make_ctx(max_requests=None, max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens=4") as info:
        make_ctx(max_requests=8, max_tokens=4)
    assert "derived" not in str(info.value)  # an explicit max_requests is not "derived"


def test_huge_max_sequence_length_sizes_the_table_by_the_buffer():
    """A table row never needs more columns than the buffer has blocks (no MemoryError), and
    the active budget that cannot hold one full-length request is named."""
    with pytest.warns(UserWarning, match="max_sequence_length=1099511627776 needs"):
        ctx = DynamicInferenceContext(**context_args(max_sequence_length=2 ** 40))
    assert ctx.max_kv_block_count == ctx.block_allocator.total_count - 1
    assert ctx.block_table_host.nbytes < 64 * 1024
    add(ctx, request(1, 5))
    ctx.initialize_attention_state()


def test_block_table_over_the_limit_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"block table of max_requests=8192 x \d+ blocks.*lower "
                                         "max_requests or max_sequence_length"):
        make_ctx(buffer_size_gb=1024 * 1024 * BLOCK / GIB, paused_buffer_size_gb=0,
                 max_sequence_length=2 ** 20, max_requests=8192, max_tokens=8192)


def test_level1_warning_is_said_once_with_what_to_do(monkeypatch):
    monkeypatch.setattr(sizing, "_level1_warned", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sizing._warn_level1_once(1024)
        sizing._warn_level1_once(1024)
    assert len(seen) == 1
    text = str(seen[0].message)
    assert "unified_memory_level=0" in text and "paused_buffer_size_gb" in text
    assert "once per process" in text


def test_calls_before_initialize_attention_state_raise():
    ctx = make_ctx()
    with pytest.raises(RuntimeError, match="initialize_attention_state"):
        ctx.current_input_and_position_ids()
    add(ctx, request(1, 3))
    with pytest.raises(RuntimeError, match="initialize_attention_state"):
        ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([5]))
    ctx.initialize_attention_state()
    ids, _ = ctx.current_input_and_position_ids()
    assert ids[0, :3].tolist() == [101, 102, 103]
    ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([5]))
    with pytest.raises(RuntimeError, match="initialize_attention_state"):
        ctx.update_requests(torch.ones(1, dtype=torch.bool), torch.tensor([6]))  # twice


@pytest.mark.parametrize("prompt", [
    pytest.param([1.0, 2.0], id="float-list"),
    pytest.param(np.array([1.0, 2.0]), id="numpy-float"),
    pytest.param(np.array([1, 2], dtype=np.int16), id="numpy-int16"),
    pytest.param((1, 2), id="tuple"),
    pytest.param(torch.tensor([1.0, 2.0]), id="tensor-float"),
])
def test_whole_number_prompts_are_accepted(prompt):
    r = DynamicInferenceRequest(request_id=1, prompt_tokens=prompt)
    assert r.prompt_tokens.tolist() == [1, 2] and not r.prompt_tokens.is_floating_point()


@pytest.mark.parametrize("prompt,match", [
    pytest.param([1.7, 2.2], "1.7 is not a whole number", id="float-list"),
    pytest.param(np.array([1.0, 2.5]), "2.5 is not a whole number", id="numpy-float"),
    pytest.param([1.0, float("nan")], "nan", id="nan"),
    pytest.param(torch.tensor([1.0, 2.5]), r"float32.*whole numbers.*2\.5", id="tensor-float"),
])
def test_fractional_prompts_are_refused_naming_the_value(prompt, match):
    with pytest.raises(ValueError, match=f"prompt_tokens.*{match}"):
        DynamicInferenceRequest(request_id=1, prompt_tokens=prompt)


@pytest.mark.parametrize("prompt,match", [
    pytest.param([True, False], "bool", id="bool-list"),
    pytest.param(np.array([True]), "bool", id="numpy-bool"),
    pytest.param(torch.tensor([True]), "bool", id="tensor-bool"),
    pytest.param(torch.tensor([1.0, 0.5]), "0.5 is not a whole number", id="tensor-float"),
    pytest.param("abc", "tokenize", id="string"),
])
def test_other_prompts_are_refused_naming_the_argument(prompt, match):
    with pytest.raises(TypeError, match=f"prompt_tokens.*{match}"):
        DynamicInferenceRequest(request_id=1, prompt_tokens=prompt)


@pytest.mark.parametrize("gen", [2.5, "abc", True])
def test_num_tokens_to_generate_must_be_whole(gen):
    with pytest.raises(TypeError, match=f"num_tokens_to_generate={gen!r}"):
        SamplingParams(num_tokens_to_generate=gen)
    assert SamplingParams(num_tokens_to_generate=3.0).num_tokens_to_generate == 3.0


@pytest.mark.parametrize("backend", [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=[
        pytest.mark.interpreter,
        needs_triton]),
])
def test_strided_and_offset_new_tokens_reach_the_next_step(backend):
    """``sampled[:, 0]`` (a strided view) and an offset view are read by value."""
    ctx = make_ctx(kernel_backend=backend)
    for rid in (1, 2, 3):
        add(ctx, request(rid, 2))
    ctx.initialize_attention_state()
    sampled = torch.tensor([[4, 99], [5, 98], [6, 97]])
    ctx.update_requests(torch.ones(3, dtype=torch.bool), sampled[:, 0])
    ctx.initialize_attention_state()
    assert ctx.current_input_and_position_ids()[0][0, :3].tolist() == [4, 5, 6]
    ctx.update_requests(torch.ones(3, dtype=torch.bool), torch.arange(10)[6:9])
    ctx.initialize_attention_state()
    assert ctx.current_input_and_position_ids()[0][0, :3].tolist() == [6, 7, 8]
