"""Megatron-Core 0.19's ``megatron/`` package on a CPU: what its CUDA-only calls become.

``megatron019_on_cpu()`` is a re-entrant context manager that, while held:

* makes ``torch.cuda.current_device()`` return ``"cpu"`` (0.19 places its device tensors with
  it, as 0.16.1 did);
* replaces ``torch.cuda.Event``, ``torch.cuda.Stream``, ``torch.cuda.current_stream``,
  ``torch.cuda.default_stream`` and ``torch.cuda.stream`` with host equivalents
  (``CpuEvent``, ``CpuStream``): on a CPU every copy has finished when it returns, so an event
  is complete as soon as it is recorded and waiting on one returns at once;
* turns ``torch.cuda.synchronize`` and ``torch.cuda.nvtx.range_push`` / ``range_pop`` into
  no-ops (a CPU build of torch raises on each);
* holds a ``TorchFunctionMode`` (``CpuOnlyMode``) that drops ``pin_memory=True`` from tensor
  factories, makes ``Tensor.pin_memory()`` and ``Tensor.cuda()`` return the tensor itself, and
  maps a ``"cuda"`` device argument to ``"cpu"`` (0.19 keeps its bookkeeping in pinned host
  tensors, which a CPU build cannot allocate).

Nothing is patched at import time and everything is restored on the outermost exit. The
0.16.1 shim (``tests/megatron_oracle.py``'s ``megatron_on_cpu``) patches ``current_device`` and
nvtx only; 0.19 needs the rest because its context stages bookkeeping in pinned buffers and
records an event after each host-to-device transfer.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CpuEvent", "CpuStream", "CpuOnlyMode", "megatron019_on_cpu", "shim_active"]


class CpuEvent:
    """``torch.cuda.Event`` on a CPU: complete once recorded (host work is synchronous)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        return 0.0


class CpuStream:
    """``torch.cuda.Stream`` on a CPU: work submitted to it has run when the call returns."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> CpuEvent:
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_DEFAULT_STREAM = CpuStream()


def _stream_context(stream: Any = None):
    return contextlib.nullcontext(stream)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class CpuOnlyMode(TorchFunctionMode):
    """Drops pinned-memory requests and maps CUDA placements to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.pin_memory or func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


_lock = threading.RLock()
_depth = 0
_saved: Dict[str, Any] = {}
_mode: Dict[str, CpuOnlyMode] = {}

#: torch.cuda attribute -> its CPU replacement while the shim is held.
_CUDA_REPLACEMENTS: Dict[str, Any] = {
    "current_device": lambda: "cpu",
    "Event": CpuEvent,
    "Stream": CpuStream,
    "current_stream": lambda device=None: _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "stream": _stream_context,
    "synchronize": lambda device=None: None,
}
_NVTX_REPLACEMENTS: Dict[str, Any] = {
    "range_push": lambda *args, **kwargs: None,
    "range_pop": lambda *args, **kwargs: None,
}


@contextlib.contextmanager
def megatron019_on_cpu():
    """Hold the CPU shim for Megatron-Core 0.19 (re-entrant; restored on the outermost exit)."""
    global _depth
    with _lock:
        if _depth == 0:
            for name, value in _CUDA_REPLACEMENTS.items():
                _saved["cuda." + name] = getattr(torch.cuda, name)
                setattr(torch.cuda, name, value)
            for name, value in _NVTX_REPLACEMENTS.items():
                _saved["nvtx." + name] = getattr(torch.cuda.nvtx, name)
                setattr(torch.cuda.nvtx, name, value)
            mode = CpuOnlyMode()
            mode.__enter__()
            _mode["mode"] = mode
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _mode.pop("mode").__exit__(None, None, None)
                for key, value in list(_saved.items()):
                    module, name = key.split(".", 1)
                    setattr(torch.cuda if module == "cuda" else torch.cuda.nvtx, name, value)
                _saved.clear()


def shim_active() -> bool:
    """True while ``megatron019_on_cpu`` is held."""
    return _depth > 0
