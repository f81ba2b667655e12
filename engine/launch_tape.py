"""The launch tape of a stand-in graph replay: what a CUDA graph freezes, written down and checked.

``StandInGraphRunner`` (``engine/graphs.py``) replays a graph without CUDA. At capture (after
one warm-up forward) the forward runs under ``LaunchRecorder``, which writes down every launch it
makes: each torch operation outside ``dynctx/kernels`` with its Python scalars, shapes, strides
and dtypes, and for each tensor where its data comes from (the address of a tensor that existed
before the forward, or the launch that made it); each call into ``dynctx/kernels`` (one kernel
launch on CUDA) as one launch with its arguments, and under the interpreter every Triton grid it
launches. A replay runs the forward again under ``LaunchRecorder(tape)``, which compares every
launch with the capture's before it runs and raises ``GraphReplayMismatch`` at the first one that
differs (naming the launch, the argument, both values and both ``file:line``): a CUDA graph would
have replayed the captured launch, so its result would differ from eager. What passes the check
is a replay that only changes tensor contents.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .sync_guard import MACHINERY_FILES, TORCH_DIR

# The modules whose functions stand for kernel launches: on CUDA a call into one is one
# compiled Triton launch, so ``LaunchRecorder`` freezes its arguments, not its torch reference's
# operations (which may read data back, as a kernel reading device memory does not).
_KERNELS_PACKAGE = "dynctx.kernels."


def _triton_grid_code() -> Optional[Any]:
    """The code of the Triton interpreter's launch (``GridExecutor.__call__``), whose frame holds
    a launch's kernel, grid and arguments; None without Triton."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        return None
    return GridExecutor.__call__.__code__


_GRID_CALL_CODE = _triton_grid_code()
_SCALARS = (bool, int, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


class GraphReplayMismatch(RuntimeError):
    """A stand-in replay launched something other than its capture did: a CUDA graph would
    have replayed the captured launch, so on a GPU the step would not compute what eager does."""


@dataclasses.dataclass
class Launch:
    """One launch of a recorded forward (``LaunchRecorder``).

    ``kind`` is ``"op"`` (a torch operation outside ``dynctx.kernels``) or ``"kernel"`` (a call
    into ``dynctx.kernels``); ``signature`` holds ``(argument, value)`` pairs of everything a
    CUDA graph bakes in; ``grids`` the Triton launches of a kernel call under the interpreter
    (kernel name, grid, arguments); ``where`` the caller's ``file:line (function)``."""

    kind: str
    name: Any
    signature: tuple
    caller: Optional[Tuple[str, int, str]]
    grids: list = dataclasses.field(default_factory=list)

    @property
    def where(self) -> str:
        if self.caller is None:
            return "?"
        filename, line, function = self.caller
        return f"{os.path.relpath(filename)}:{line} ({function})"

    def __str__(self) -> str:
        return f"{self.kind} {self.name} at {self.where}"


def _caller_of(frame: Any) -> Optional[Tuple[str, int, str]]:
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _labelled(launch: Launch) -> Dict[str, Any]:
    """A launch's signature by argument name (``argument i`` for an operation's positional
    arguments), for the mismatch message."""
    if launch.kind == "kernel":
        return dict(launch.signature)
    named = {}
    for index, value in enumerate(launch.signature):
        if isinstance(value, tuple) and value and value[0] == "keywords":
            named.update(value[1:])
        else:
            named[f"argument {index}"] = value
    return named


def _describe(value: Any) -> str:
    """A signature value as the mismatch message shows it."""
    if isinstance(value, tuple) and value and value[0] == "tensor":
        _, dtype, device, shape, stride, offset, origin = value
        where = {"at": f"at {origin[1]:#x}", "made": f"made by launch {origin[1]}"}.get(
            origin[0], origin[0])
        return (f"tensor {str(dtype).replace('torch.', '')} {list(shape)} strides {list(stride)} "
                f"offset {offset} {where}")
    if isinstance(value, tuple) and value and value[0] == "float":
        return repr(float.fromhex(value[1]))
    return repr(value)


def _storage_address(tensor: torch.Tensor) -> Optional[int]:
    """The address of ``tensor``'s storage (where its offset 0 lies), None when it has no
    elements (or no storage)."""
    if tensor.numel() == 0:
        return None
    try:
        return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()
    except (RuntimeError, NotImplementedError):
        return None


class LaunchRecorder(TorchDispatchMode):
    """Writes down, or checks against a tape, every launch of the forward it encloses: what a
    CUDA graph bakes in at capture and replays unchanged (the module docstring).

    * A torch operation outside ``dynctx.kernels``: its name, every Python scalar, dtype, shape,
      stride and storage offset of its arguments, and for each tensor argument where its data
      lives: the address of a tensor that existed before the forward (the context's buffers, the
      weights), or the index of the launch that made it (an intermediate: its address is the
      graph pool's on CUDA, any on a CPU).
    * A call into ``dynctx.kernels`` (one kernel launch on CUDA): the function and its arguments
      (the same details), once; the torch operations inside (the reference, which may read data
      back, as a kernel reading device memory does not) are part of it. Under the Triton
      interpreter each Triton launch inside adds its kernel, grid and arguments.

    ``LaunchRecorder()`` records into ``launches``. ``LaunchRecorder(tape)`` checks each launch
    against ``tape`` as it comes (an operation or a kernel call before it runs, the Triton
    launches of a kernel call once it is done) and raises ``GraphReplayMismatch`` at the first
    difference, and when the forward ends with fewer launches than ``tape``. ``label`` names the
    graph in the message.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ to keep dynamo out of it, at a cost on every
        # operation; nothing here is compiled.
        return False

    def __init__(self, tape: Optional[List[Launch]] = None, *, label: str = "the forward"):
        super().__init__()
        self.tape = tape
        self.label = label
        self.launches: List[Launch] = []
        # Storage address -> index of the launch that last wrote it, for the storages the
        # forward made; the addresses of the storages that existed before it.
        self._made: Dict[int, int] = {}
        self._external: set = set()
        self._kernel_frame = None
        self._grid_frames: List[Any] = []
        self._top = None

    def __enter__(self):
        self._top = sys._getframe(1)
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, tb):
        super().__exit__(exc_type, exc_value, tb)
        self._top = None
        ok = exc_type is None
        self._close_kernel(check=ok)
        if ok and self.tape is not None and len(self.launches) != len(self.tape):
            missing = self.tape[len(self.launches)]
            raise GraphReplayMismatch(
                f"{self.label}: the replay made {len(self.launches)} launches, the capture "
                f"{len(self.tape)}; the first one missing: {missing}. A CUDA graph replays "
                "every captured launch")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kernel, grid, caller = self._locate()
        if kernel is None:
            self._close_kernel()
            index = len(self.launches)
            signature = tuple(self._signature(a) for a in args)
            if kwargs:
                signature += (("keywords",) + tuple((name, self._signature(v))
                                                    for name, v in kwargs.items()),)
            self._add(Launch("op", func, signature, _caller_of(caller)))
        else:
            if kernel is not self._kernel_frame:
                self._close_kernel()
                self._open_kernel(kernel)
            if grid is not None and all(seen is not grid for seen in self._grid_frames):
                self._grid_frames.append(grid)
                self.launches[-1].grids.append(self._grid_signature(grid))
            index = len(self.launches) - 1
        out = func(*args, **kwargs)
        self._wrote(out, index)
        return out

    def _locate(self) -> Tuple[Any, Any, Any]:
        """``(outermost dynctx.kernels frame, innermost Triton launch frame, innermost caller
        frame outside torch and this file)`` of the operation being dispatched."""
        kernel = grid = caller = None
        frame, top = sys._getframe(2), self._top
        while frame is not None and frame is not top:
            code = frame.f_code
            if code is _GRID_CALL_CODE:
                grid = grid or frame
            elif frame.f_globals.get("__name__", "").startswith(_KERNELS_PACKAGE):
                kernel = frame
            elif caller is None and not code.co_filename.startswith(TORCH_DIR) and \
                    code.co_filename not in MACHINERY_FILES:
                caller = frame
            frame = frame.f_back
        return kernel, grid, caller

    def _open_kernel(self, frame: Any) -> None:
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount
        count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
        local = frame.f_locals
        signature = tuple((name, self._signature(local.get(name)))
                          for name in code.co_varnames[:count])
        name = f"{frame.f_globals.get('__name__')}.{code.co_name}"
        self._kernel_frame, self._grid_frames = frame, []
        self._add(Launch("kernel", name, signature, _caller_of(frame.f_back)))

    def _close_kernel(self, check: bool = True) -> None:
        if self._kernel_frame is None:
            return
        self._kernel_frame, self._grid_frames = None, []
        index = len(self.launches) - 1
        if check and self.tape is not None:
            captured, now = self.tape[index], self.launches[index]
            if captured.grids != now.grids:
                self._mismatch(index, "its Triton launches",
                               f"{len(captured.grids)} launches {captured.grids}",
                               f"{len(now.grids)} launches {now.grids}")

    def _grid_signature(self, frame: Any) -> tuple:
        local = frame.f_locals
        executor = local.get("self")
        grid = getattr(executor, "grid", None)
        return (getattr(getattr(executor, "fn", None), "__name__", "?"),
                self._signature(grid) if not callable(grid) else ("callable",),
                self._signature(local.get("args_dev")), self._signature(local.get("kwargs")))

    def _add(self, launch: Launch) -> None:
        index = len(self.launches)
        self.launches.append(launch)
        if self.tape is None:
            return
        if index >= len(self.tape):
            raise GraphReplayMismatch(
                f"{self.label}: the replay makes more launches than the capture's "
                f"{len(self.tape)}: {launch}. A CUDA graph replays the captured launches only")
        captured = self.tape[index]
        if captured.kind != launch.kind or captured.name != launch.name:
            self._mismatch(index, "what it launches", f"{captured.kind} {captured.name}",
                           f"{launch.kind} {launch.name}")
        if captured.signature != launch.signature:
            before, after = _labelled(captured), _labelled(launch)
            for name in list(before) + [n for n in after if n not in before]:
                if before.get(name) != after.get(name):
                    self._mismatch(index, name, _describe(before.get(name)),
                                   _describe(after.get(name)))

    def _mismatch(self, index: int, what: str, captured: str, now: str) -> None:
        launch, at_capture = self.launches[index], self.tape[index]
        raise GraphReplayMismatch(
            f"{self.label}: launch {index} ({launch}) differs from the capture's "
            f"({at_capture}) in {what}: captured {captured}, now {now}. A CUDA graph "
            "replays the captured launch with the captured values, so on a GPU this step would "
            "not compute what eager does: read that value from the graph's dimensions "
            "(GraphStepContext), not from the live step")

    def _signature(self, value: Any, depth: int = 0) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor_signature(value)
        if isinstance(value, float):
            return ("float", value.hex())
        if value is None or isinstance(value, _SCALARS):
            return value
        if isinstance(value, (tuple, list)):
            return (type(value).__name__,) + tuple(self._signature(v, depth) for v in value)
        if isinstance(value, dict):
            return ("dict",) + tuple((str(k), self._signature(v, depth))
                                     for k, v in value.items())
        if type(value).__name__ == "TensorWrapper" and hasattr(value, "base"):  # Triton's
            return ("wrapped", str(value.dtype), self._signature(value.base, depth))
        if depth < 2 and dataclasses.is_dataclass(value) and not isinstance(value, type):
            return (type(value).__qualname__,) + tuple(
                (f.name, self._signature(getattr(value, f.name), depth + 1))
                for f in dataclasses.fields(value))
        if depth < 2 and isinstance(value, SimpleNamespace):
            return ("namespace", self._signature(vars(value), depth + 1))
        if hasattr(value, "dtype") and hasattr(value, "shape"):  # numpy arrays
            return ("array", str(value.dtype), tuple(value.shape))
        return ("object", type(value).__qualname__)

    def _tensor_signature(self, tensor: torch.Tensor) -> tuple:
        address = _storage_address(tensor)
        if address is None:
            origin: tuple = ("empty",)
        elif address in self._made:
            origin = ("made", self._made[address])
        else:
            self._external.add(address)
            origin = ("at", address)
        return ("tensor", tensor.dtype, tensor.device, tensor.shape, tensor.stride(),
                tensor.storage_offset(), origin)

    def _wrote(self, out: Any, index: int) -> None:
        if isinstance(out, torch.Tensor):
            address = _storage_address(out)
            if address is not None and address not in self._external:
                self._made[address] = index
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._wrote(item, index)


__all__ = ["GraphReplayMismatch", "Launch", "LaunchRecorder"]
