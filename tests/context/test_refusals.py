"""Refusals that name what to change (issue 19 §5, issue 26 §3): a chunked prefill id the
context cannot be chunking, an active budget smaller than one request needs, a buffer larger
than the device. Each is refused when it is asked for, with the argument, the value and the
limit, and changes nothing."""

import pytest
import torch
from helpers import BLOCK, GIB, add, context_args, make_ctx, request, step

from dynctx.context import DynamicInferenceContext, sizing
from dynctx.context.device_state import DeviceState


def test_chunked_prefill_request_id_takes_only_the_ids_the_context_may_chunk():
    ctx = make_ctx()
    with pytest.raises(ValueError, match=r"chunked_prefill_request_id=999 .* holds no active "
                                         r"request .* set it to -1$"):
        ctx.chunked_prefill_request_id = 999
    add(ctx, request(1, 3))
    add(ctx, request(7, 20), chunk_length=8)
    with pytest.raises(ValueError, match=r"chunked_prefill_request_id=999 .* holds 2 active "
                                         r"requests, the last active row holding request 7 .* "
                                         r"set it to -1 or 7"):
        ctx.chunked_prefill_request_id = 999
    with pytest.raises(ValueError, match="chunked_prefill_request_id=1 "):
        ctx.chunked_prefill_request_id = 1          # in the context, but not the last row
    with pytest.raises(TypeError, match="must be an int"):
        ctx.chunked_prefill_request_id = "7"
    assert ctx.chunked_prefill_request_id == -1     # nothing was kept
    ctx.chunked_prefill_request_id = 7
    ctx.initialize_attention_state()
    ctx.update_requests(torch.tensor([True, True]), torch.tensor([4, 5]))
    assert ctx.chunked_prefill_request_id == 7      # the chunked row stays the last one
    ctx.chunked_prefill_request_id = -1


def _run_until_stuck(ctx, steps=40):
    """One 11-token request generating 40 tokens, stepped until the update refuses."""
    add(ctx, request(1, 11, gen=40))
    for _ in range(steps):
        step(ctx)


@pytest.mark.parametrize("buffer_blocks, paused_blocks, lower_paused", [
    (16, 10, True),     # 5 active blocks; a paused budget 8 smaller would leave 13
    (6, 2, False),      # 3 active blocks; the paused budget cannot give 10
    (24, None, True),   # half the buffer: 11 active blocks; or a paused budget of 10
    (6, None, False),   # 2 active blocks; no paused budget leaves 13 in 6 blocks
])
def test_no_request_can_run_names_the_argument_and_how_much(buffer_blocks, paused_blocks,
                                                             lower_paused):
    """A request of 51 tokens (13 blocks of 4) in an active budget that holds fewer: the
    update names the argument to change and the value, and the advised contexts run it."""
    sizes = dict(max_requests=4, max_tokens=64, max_sequence_length=52,
                 buffer_size_gb=buffer_blocks * BLOCK / GIB,
                 paused_buffer_size_gb=(None if paused_blocks is None
                                        else paused_blocks * BLOCK / GIB))
    with pytest.warns(UserWarning, match="no request can run"):  # the constructor foresees it
        ctx = DynamicInferenceContext(**context_args(**sizes))
    with pytest.raises(RuntimeError, match=r"no request can run: .*: request 1 needs \d+ blocks "
                                           r"of the active budget .*, 13 to reach its 51 tokens: "
                                           r"raise buffer_size_gb to at least ") as caught:
        _run_until_stuck(ctx)
    message = str(caught.value)
    advised = float(message.split("buffer_size_gb to at least ")[1].split()[0])
    _run_until_stuck(make_ctx(**dict(sizes, buffer_size_gb=advised)))  # the advice is enough
    paused_advice = ("paused_buffer_size_gb to at most " if paused_blocks is not None
                     else "or pass paused_buffer_size_gb=")
    assert (paused_advice in message) == lower_paused, message
    if lower_paused:
        paused = float(message.split(paused_advice)[1].split()[0].rstrip(";"))
        _run_until_stuck(make_ctx(**dict(sizes, paused_buffer_size_gb=paused)))


def test_a_buffer_the_device_cannot_hold_is_refused_before_anything_is_allocated(monkeypatch):
    allocated = []
    real_allocate = DeviceState.allocate
    monkeypatch.setattr(DeviceState, "allocate",
                        lambda self: allocated.append(self) or real_allocate(self))
    monkeypatch.setattr(sizing, "available_bytes", lambda device: 1024 ** 2)
    with pytest.raises(ValueError, match=r"the context needs 4(\.\d+)? MiB on cpu \(KV blocks, "
                                         r"\d+ of .*buffer_size_gb=0\.00390625.*; bookkeeping "
                                         r".*\), but cpu has 1 MiB available"):
        make_ctx(buffer_size_gb=4 / 1024, paused_buffer_size_gb=None)
    assert allocated == []
    make_ctx(buffer_size_gb=0.5 / 1024)             # what fits is built


def test_buffer_size_gb_1000_names_itself_and_the_memory_the_machine_has():
    have = sizing.available_bytes(torch.device("cpu"))
    if have is None or have >= 1000 * GIB:
        pytest.skip(f"this machine has {have} bytes available: 1000 GiB would fit")
    with pytest.raises(ValueError, match=r"buffer_size_gb=1000\b.*but cpu has .* available"):
        DynamicInferenceContext(params_dtype=torch.float16, num_layers=4, kv_channels=64,
                                num_attention_heads=4, max_sequence_length=256,
                                buffer_size_gb=1000, max_requests=64, unified_memory_level=0,
                                device="cpu")
