"""The Megatron-Core 0.19 CPU shim (``mcore019_shim.py``) on its own, without Megatron: what it
replaces while held, and that it restores everything (also after an error and when nested)."""

from __future__ import annotations

import pytest
import torch
from mcore019_shim import CpuEvent, CpuStream, megatron019_on_cpu, shim_active

PATCHED = ("current_device", "Event", "Stream", "current_stream", "default_stream", "stream",
           "synchronize")


def _originals():
    return ({name: getattr(torch.cuda, name) for name in PATCHED},
            (torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop))


def test_pinned_tensors_events_and_streams_work_on_a_cpu():
    with megatron019_on_cpu():
        assert shim_active()
        assert torch.cuda.current_device() == "cpu"
        pinned = torch.full((3,), -1, dtype=torch.int32, device="cpu", pin_memory=True)
        assert pinned.tolist() == [-1, -1, -1] and not pinned.is_pinned()
        assert torch.empty_like(pinned, pin_memory=True).shape == (3,)
        assert torch.zeros(2).pin_memory().device.type == "cpu"
        on_device = torch.zeros(2, device="cuda")
        assert on_device.device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert on_device.cuda() is on_device
        assert on_device.to("cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        event = torch.cuda.Event()
        assert isinstance(event, CpuEvent) and event.query()
        event.record(torch.cuda.current_stream())
        event.synchronize()
        assert event.recorded
        stream = torch.cuda.Stream()
        assert isinstance(stream, CpuStream)
        with torch.cuda.stream(stream):
            stream.wait_event(event)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.range_pop()
    assert not shim_active()


def test_everything_is_restored_after_an_error_and_when_nested():
    before = _originals()
    with pytest.raises(RuntimeError, match="inside"):
        with megatron019_on_cpu():
            with megatron019_on_cpu():
                assert torch.cuda.Event is CpuEvent
            assert torch.cuda.Event is CpuEvent  # the outer hold is still on
            raise RuntimeError("inside")
    assert _originals() == before
    assert not shim_active()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            torch.empty(2, pin_memory=True)  # the torch function mode is gone too


def test_values_are_untouched():
    with megatron019_on_cpu():
        x = torch.arange(6, dtype=torch.int64).reshape(2, 3)
        y = torch.empty_like(x, pin_memory=True)
        y.copy_(x, non_blocking=True)
        assert torch.equal(y, x)
        assert torch.equal(x.to("cuda", torch.float32), x.float())
