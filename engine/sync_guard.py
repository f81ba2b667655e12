"""Refusing host syncs in a forward that is about to be captured in a CUDA graph.

Before each capture, both graph runners (``engine/graphs.py``) run the forward once under
``refuse_host_syncs``: a forward that reads device values back to the host, indexes with a
boolean mask or copies host data in is refused, naming each ``file:line``, on a CPU too, so CI
catches what a GPU capture would refuse. Known refusals: the hybrid's Mamba plan
(models/nemotron_h.py) and the DeepSeek MoE routing (models/deepseek.py).
"""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from typing import Any, List, Optional

import torch
from torch.overrides import TorchFunctionMode

from dynctx.context.batch_dimensions import InferenceBatchDimensions

TORCH_DIR = os.path.dirname(torch.__file__)
_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__))
# The files of the graph machinery: the runners, this guard, the launch tape and the view of the
# context a captured forward reads. Their frames are never named as the caller of an operation
# (the caller is the model line that asked for it).
MACHINERY_FILES = frozenset(os.path.join(_ENGINE_DIR, name) for name in (
    "graphs.py", "sync_guard.py", "launch_tape.py", "replay_inputs.py"))

# Torch functions that read device memory back to the host (a sync, which a capture refuses) or
# copy host data to the device inside the forward (a value baked into the graph).
HOST_SYNC_FUNCTIONS = frozenset((
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
    "is_nonzero", "tensor", "as_tensor", "from_numpy"))


def _has_bool_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    if isinstance(value, (tuple, list)):
        return any(_has_bool_tensor(v) for v in value)
    return False


def host_sync_reason(name: str, args: tuple, kwargs: dict) -> Optional[str]:
    """Why the torch function ``name`` called with ``args`` cannot run inside a CUDA graph
    capture (a host sync, a data-dependent shape, host data copied in), or None."""
    if name in HOST_SYNC_FUNCTIONS:
        return f"{name}()"
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and \
            _has_bool_tensor(args[1:2]):
        return f"{name} with a boolean mask (data-dependent shape)"
    if name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else
                                                  kwargs.get("repeats"), torch.Tensor) \
            and kwargs.get("output_size") is None:
        return "repeat_interleave with tensor repeats and no output_size"
    if name == "where" and len(args) == 1 and not kwargs:
        return "where(condition) (nonzero)"
    return None


class HostSyncDetector(TorchFunctionMode):
    """Records every torch call that would stop a CUDA graph capture (``host_sync_reason``),
    with the caller's ``file:line``, while the model's forward runs. Calls made inside a
    kernel's torch reference (``dynctx/kernels``, ``*_ref``) or the Triton interpreter are not
    counted: on CUDA the compiled kernels run instead."""

    def __init__(self):
        super().__init__()
        self.found: List[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reason = host_sync_reason(name, args, kwargs)
        if reason is not None:
            where = self._caller()
            if where is not None:
                self.found.append(f"{where}: {reason}")
        return func(*args, **kwargs)

    @staticmethod
    def _caller() -> Optional[str]:
        frames = [f for f in traceback.extract_stack()[:-2]
                  if not f.filename.startswith(TORCH_DIR) and f.filename not in MACHINERY_FILES]
        for frame in frames:
            path = frame.filename.replace(os.sep, "/")
            if "/triton/" in path or ("/kernels/" in path and frame.name.endswith("_ref")):
                return None
        if not frames:
            return None
        frame = frames[-1]
        return f"{os.path.relpath(frame.filename)}:{frame.lineno} ({frame.name})"


@contextmanager
def refuse_host_syncs(dims: InferenceBatchDimensions):
    """Run the enclosed forward under ``HostSyncDetector``; raise ``RuntimeError`` listing
    every call found (file:line and why), since a capture of graph ``dims`` would fail or bake
    one step's values into every replay."""
    detector = HostSyncDetector()
    with detector:
        yield detector
    if detector.found:
        found = sorted(set(detector.found))
        raise RuntimeError(f"the forward of graph {dims} cannot be captured in a CUDA graph: "
                           + "; ".join(found) + " (build the engine with cuda_graphs=False)")



__all__ = ["HOST_SYNC_FUNCTIONS", "MACHINERY_FILES", "TORCH_DIR", "HostSyncDetector",
           "host_sync_reason", "refuse_host_syncs"]
