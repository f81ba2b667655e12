"""CUDA graphs for the engine: capture the model's forward once per graph batch dimension of the
context's ladder, and replay it on the steps that run in that graph.

The context picks the graph of each step (``initialize_attention_state`` sets
``using_cuda_graph_this_step()`` and ``padded_batch_dimensions``, docs/SEMANTICS.md §6); this
module owns what runs in it. A graph is captured as megatron-core's engine does: on the empty
context, ``initialize_attention_state(construct_graph_dimensions=dims)`` adds the capture dummies,
the forward runs (warm-up, then capture), and ``reset()`` empties the context again. A replay
reads the step's inputs where the capture read them: the context's token arrays, attention
metadata, block-table view and KV cache live at one address from step to step
(``tests/context/test_static_addresses.py``), until a suspend frees them; after a resume the
graphs are captured again.

What the forward sees in a graph (``GraphStepContext``): everything the context publishes, except
the values a captured forward would otherwise bake in from the capture step.

* ``active_attn_metadata.max_seqlen_q``/``max_seqlen_k``: static bounds of the graph, the values
  upstream's graphed metadata reports (``graph_attention_maxima``: 1 for a decode-only graph,
  else ``max(2, token_count)``; ``max_sequence_length``), instead of the step's exact maxima.
* ``num_decode_requests``: the graph's decode count for a decode-only graph, else 0 (in a mixed
  graph, rows past the step's real decode requests may be real prefills).
* ``last_token_logits``: one row per request of the graph (padded rows repeat the last real
  token's row), so the output has the graph's shape; the runner returns the real rows.

Two runners share the capture protocol and the dimension choice:

* ``CudaGraphRunner`` (CUDA): ``torch.cuda.CUDAGraph`` per graph, warm-up on a side stream,
  capture into one memory pool shared by every graph, replay. The outputs are the graph's own
  buffers: valid until the next replay of any graph (the engine consumes them within the step).
* ``StandInGraphRunner`` (any device, the CPU in CI): the same protocol, with a replay that
  freezes what a CUDA graph freezes. At capture (after one warm-up forward) the forward runs
  under ``LaunchRecorder``, which writes down every launch it makes: each torch operation
  outside ``dynctx/kernels`` with its Python scalars, shapes, strides and dtypes, and for each
  tensor where its data comes from (the address of a tensor that existed before the forward,
  or the launch that made it); each call into ``dynctx/kernels`` (one kernel launch on CUDA)
  as one launch with its arguments, and under the interpreter every Triton grid it launches.
  A replay runs the forward again under ``LaunchRecorder(tape)``, which compares every launch
  with the capture's before it runs and raises ``GraphReplayMismatch`` at the first one that
  differs (naming the launch, the argument, both values and both ``file:line``): a CUDA graph
  would have replayed the captured launch, so its result would differ from eager. What passes
  the check is a replay that only changes tensor contents, and its output (copied into the
  graph's static buffer) is what the CUDA graph gives.

Both runners check before each replay (``check_addresses``) that every tensor of the capture is
still at its address, which a CUDA graph silently relies on, and run one forward per graph under
``HostSyncDetector`` before capturing it: a forward that reads device values back to the host,
indexes with a boolean mask or copies host data in is refused, naming each ``file:line`` (on a
CPU too, so CI catches what a GPU capture would refuse). Known refusals: the hybrid's Mamba plan
(models/nemotron_h.py) and the DeepSeek MoE routing (models/deepseek.py).

Steps whose padded dimensions are not a captured graph (``using_cuda_graph_this_step()`` false,
or a forward mode the graphs were not captured for) run eagerly.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dynctx.context import DynamicInferenceContext
from dynctx.context.batch_dimensions import InferenceBatchDimensions
from dynctx.context.graph_ladder import graph_attention_maxima
from dynctx.kernels.last_token_logits import last_token_logits as last_token_rows
from dynctx.models.paged_attention import flash_attn_available, resolve_attention_backend

# Eager runs on the side stream before a capture (lazy initialisation: cuBLAS workspaces,
# Triton compilation, rope tables, the attention object). Megatron warms up similarly.
CUDA_GRAPH_WARMUP_STEPS = 2
# Attention backends whose forward has no host sync or data-dependent shape once planned with
# static maxima; FlashInfer's plan reads lengths back (models/paged_attention.py).
# The attention backends whose plan and forward read nothing back: "torch" (grouped by length on
# the host) is not one of them, its padded form "torch_static" is.
GRAPH_SAFE_ATTENTION_BACKENDS = ("torch_static", "triton", "flash_attn")


# Torch functions that read device memory back to the host (a sync, which a capture refuses) or
# copy host data to the device inside the forward (a value baked into the graph).
HOST_SYNC_FUNCTIONS = frozenset((
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
    "is_nonzero", "tensor", "as_tensor", "from_numpy"))
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


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
                  if not f.filename.startswith(_TORCH_DIR) and f.filename != _THIS_FILE]
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
            elif caller is None and not code.co_filename.startswith(_TORCH_DIR) and \
                    code.co_filename != _THIS_FILE:
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


def graph_attention_backend(requested: str, device: torch.device, block_size: int,
                            dtype: torch.dtype) -> str:
    """The attention backend of an engine with CUDA graphs: ``requested`` unless it is
    ``"auto"`` and auto would pick one a graph cannot capture (the length-grouped torch version
    on a CPU); then flash-attn where it runs, else the padded torch version ``"torch_static"``.
    An explicit choice is kept (and refused at capture when it cannot be captured)."""
    if requested != "auto":
        return requested
    chosen = resolve_attention_backend("auto", device, block_size, dtype)
    if chosen in GRAPH_SAFE_ATTENTION_BACKENDS:
        return chosen
    half = dtype in (torch.float16, torch.bfloat16)
    return "flash_attn" if half and flash_attn_available(device, block_size) else "torch_static"


def static_plan_values(ctx: Any, dims: InferenceBatchDimensions) -> Tuple[int, int, int]:
    """``(max_seqlen_q, max_seqlen_k, num_decode_requests)`` of graph ``dims``: bounds that hold
    for every step the context puts in this graph, and depend on nothing else. The maxima are
    Megatron's graphed metadata values (``graph_attention_maxima``), with the key bound capped
    at what a block-table row can hold (the context sizes its rows by the blocks that can exist,
    which may be fewer than ``max_sequence_length`` needs)."""
    max_q, max_k = graph_attention_maxima(dims, int(ctx.max_sequence_length))
    max_k = min(max_k, int(ctx.max_kv_block_count) * int(ctx.block_size_tokens))
    return max_q, max_k, (dims.decode_req_count if dims.prefill_req_count == 0 else 0)


class GraphStepContext:
    """The context as a captured forward sees it (module docstring): attribute reads go to the
    context, but for the static plan values and the graph-shaped ``last_token_logits``."""

    def __init__(self, ctx: DynamicInferenceContext, dims: InferenceBatchDimensions):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "graph_dimensions", dims)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"GraphStepContext is read-only (setting {name!r}); change the "
                             "context itself")

    @property
    def active_attn_metadata(self) -> Optional[SimpleNamespace]:
        meta = self._ctx.active_attn_metadata
        if meta is None:
            return None
        max_q, max_k, _ = static_plan_values(self._ctx, self.graph_dimensions)
        fields = {k: v for k, v in vars(meta).items() if k != "state_data"}
        fields.update(max_seqlen_q=max_q, max_seqlen_k=max_k)
        static = SimpleNamespace(**fields)
        static.state_data = dict(fields)
        return static

    @property
    def num_decode_requests(self) -> int:
        return static_plan_values(self._ctx, self.graph_dimensions)[2]

    def last_token_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[graph requests, vocab]``: row ``i`` is the last token of request ``i``; rows past
        the step's real requests repeat the last real token's row (their query length is 0)."""
        ctx, dims = self._ctx, self.graph_dimensions
        meta = ctx.active_attn_metadata
        if meta is None:
            raise RuntimeError("last_token_logits outside a step: call "
                               "initialize_attention_state() first")
        rows = logits[0] if logits.dim() == 3 else logits
        if rows.shape[0] != dims.token_count:
            raise ValueError(f"logits has {rows.shape[0]} token rows, graph {dims} has "
                             f"{dims.token_count}")
        return last_token_rows(rows, meta.cu_query_seq_lengths, dims.req_count,
                               backend=ctx.kernel_backend)


def forward_inputs(ctx: DynamicInferenceContext) -> Dict[str, torch.Tensor]:
    """Every tensor a step's forward reads from the context, by name (public API only): input and
    position ids, the per-token arrays, the attention metadata and block-table view, each
    attention layer's K/V cache, and for hybrids the Mamba metadata and states."""
    tensors: Dict[str, torch.Tensor] = {}
    input_ids, position_ids = ctx.current_input_and_position_ids()
    tensors["input_ids"], tensors["position_ids"] = input_ids, position_ids
    for name in ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                 "token_to_block_idx", "token_to_position_in_request",
                 "token_to_local_position_within_kv_block"):
        tensors[name] = getattr(ctx, name)
    meta = ctx.active_attn_metadata
    for name in ("query_lengths", "cu_query_seq_lengths", "cu_kv_seq_lengths", "kv_seq_lengths",
                 "block_table"):
        tensors[f"attn.{name}"] = getattr(meta, name)
    for index, kind in enumerate(ctx.layer_types):
        layer = index + 1
        if kind == "*":
            key, value = ctx.key_value_cache(layer)
            tensors[f"kv_cache.{layer}.key"] = key
            if value is not None:
                tensors[f"kv_cache.{layer}.value"] = value
        elif kind == "M":
            conv, ssm = ctx.mamba_states_cache(layer)
            tensors[f"mamba_states.{layer}.conv"] = conv
            tensors[f"mamba_states.{layer}.ssm"] = ssm
    mamba = getattr(ctx, "mamba_metadata", None)
    if ctx.is_hybrid_model and mamba is not None:
        for name, value in vars(mamba).items():
            if isinstance(value, torch.Tensor):
                tensors[f"mamba.{name}"] = value
    return tensors


def tensor_addresses(tensors: Dict[str, torch.Tensor]) -> Dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in tensors.items()}


class _GraphRunner:
    """Capture protocol, dimension choice and replay counts shared by both runners.

    Args:
        model: the adapter (``forward(ctx, last_token_only=...)``).
        context: the engine's context; its ladder ``cuda_graph_batch_dimensions_list`` names
            the graphs.
        last_token_only: the forward mode captured (the engine's mode for steps without
            prompt log probs); steps in the other mode run eagerly.
        check_addresses: before each replay, check that every tensor the forward reads from
            the context is where the capture read it (``forward_inputs``; about one
            ``data_ptr()`` per tensor and layer on the host), and raise ``RuntimeError`` naming
            the tensors that moved.
    """

    kind = "abstract"

    def __init__(self, model: Any, context: DynamicInferenceContext, *, last_token_only: bool,
                 check_addresses: bool = True):
        self.model = model
        self.context = context
        self.last_token_only = bool(last_token_only)
        self.check_addresses = bool(check_addresses)
        self.graphs: Dict[InferenceBatchDimensions, Any] = {}
        self.replays: Counter = Counter()
        self.eager_steps = 0
        self.captures = 0

    @property
    def graph_dimensions(self) -> List[InferenceBatchDimensions]:
        return list(self.context.cuda_graph_batch_dimensions_list)

    def capture_all(self) -> None:
        """Capture every graph of the ladder, largest first (as megatron-core's engine). The
        context must be empty; it is empty again afterwards."""
        ctx = self.context
        if ctx.total_request_count:
            raise RuntimeError(f"capturing CUDA graphs needs an empty context; it holds "
                               f"{ctx.total_request_count} requests")
        self.release()
        try:
            for dims in sorted(self.graph_dimensions, reverse=True):
                ctx.initialize_attention_state(construct_graph_dimensions=dims)
                try:
                    if ctx.padded_batch_dimensions != dims or not ctx.using_cuda_graph_this_step():
                        raise RuntimeError(
                            f"internal: the capture dummies of graph {dims} gave the step "
                            f"{ctx.padded_batch_dimensions} (graph: "
                            f"{ctx.using_cuda_graph_this_step()})")
                    graph = self._capture(dims, GraphStepContext(ctx, dims))
                    graph.addresses = tensor_addresses(forward_inputs(ctx))
                    self.graphs[dims] = graph
                    self.captures += 1
                finally:
                    ctx.reset()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Forget every graph (before a suspend frees the tensors they read)."""
        self.graphs.clear()

    def graph_for_step(self, last_token_only: bool) -> Optional[InferenceBatchDimensions]:
        """The captured graph this step replays, or None (eager)."""
        ctx = self.context
        if last_token_only != self.last_token_only or not ctx.using_cuda_graph_this_step():
            return None
        dims = ctx.padded_batch_dimensions
        return dims if dims in self.graphs else None

    def run(self, last_token_only: bool) -> torch.Tensor:
        """The step's forward output: replayed when the step is in a captured graph (rows of the
        real requests only, for last-token logits), else the eager forward's."""
        dims = self.graph_for_step(last_token_only)
        if dims is None:
            self.eager_steps += 1
            return self.model.forward(self.context, last_token_only=last_token_only)
        graph = self.graphs[dims]
        if self.check_addresses:
            self._check_addresses(dims, graph.addresses)
        output = self._replay(dims, graph)
        self.replays[dims] += 1
        if self.last_token_only:
            return output[:self.context.get_active_request_count()]
        return output

    def _check_addresses(self, dims: InferenceBatchDimensions, captured: Dict[str, int]) -> None:
        now = tensor_addresses(forward_inputs(self.context))
        moved = {name: (now.get(name), captured.get(name))
                 for name in sorted(set(now) | set(captured))
                 if now.get(name) != captured.get(name)}
        if moved:
            raise RuntimeError(f"graph {dims}: inputs of the forward moved since the capture, "
                               f"a replay would read stale memory: {moved} "
                               "(name: (address now, address at capture))")

    def _capture(self, dims: InferenceBatchDimensions, view: GraphStepContext) -> Any:
        raise NotImplementedError

    def _replay(self, dims: InferenceBatchDimensions, graph: Any) -> torch.Tensor:
        raise NotImplementedError


class StandInGraphRunner(_GraphRunner):
    """Runs the capture protocol without CUDA graphs, freezing what a capture freezes (module
    docstring): the capture records the forward's launches (``LaunchRecorder``) after one
    warm-up forward that refuses host syncs; a replay runs the forward on the static inputs
    under a check of every launch against that tape (``GraphReplayMismatch`` at the first
    difference) and copies its output into the graph's static buffer."""

    kind = "stand-in"

    def _capture(self, dims: InferenceBatchDimensions, view: GraphStepContext) -> Any:
        # The warm-up does the lazy initialisation (rope tables, the attention object) that the
        # CUDA runner's warm-up does, so that the recorded forward is the steady one.
        with refuse_host_syncs(dims):
            self.model.forward(view, last_token_only=self.last_token_only)
        recorder = LaunchRecorder(label=f"graph {dims}")
        with recorder:
            output = self.model.forward(view, last_token_only=self.last_token_only)
        return SimpleNamespace(view=view, output=output.clone(), tape=recorder.launches)

    def _replay(self, dims: InferenceBatchDimensions, graph: Any) -> torch.Tensor:
        with LaunchRecorder(graph.tape, label=f"graph {dims}"):
            output = self.model.forward(graph.view, last_token_only=self.last_token_only)
        if output.shape != graph.output.shape or output.dtype != graph.output.dtype:
            raise RuntimeError(f"graph {dims}: the forward gave {tuple(output.shape)} "
                               f"{output.dtype}, the capture {tuple(graph.output.shape)} "
                               f"{graph.output.dtype}")
        graph.output.copy_(output)
        return graph.output


class CudaGraphRunner(_GraphRunner):
    """``torch.cuda.CUDAGraph`` capture and replay (module docstring). Unverified on hardware in
    CI: the CPU runs ``StandInGraphRunner`` through the same protocol."""

    kind = "cuda"

    def __init__(self, model: Any, context: DynamicInferenceContext, *, last_token_only: bool,
                 check_addresses: bool = True, warmup_steps: int = CUDA_GRAPH_WARMUP_STEPS):
        if context.device.type != "cuda":
            raise ValueError(f"CudaGraphRunner needs a CUDA context, the context is on "
                             f"{context.device}")
        if context.is_hybrid_model:
            # models/nemotron_h.py plans its Mamba sequences on host counts and lists
            # (mamba_plan): a capture would bake one step's groups into every replay.
            raise NotImplementedError(
                "CUDA graphs of a hybrid (Mamba) model: its forward plans the Mamba sequences "
                "on the host from the step's counts, which a graph cannot replay; build the "
                "engine with cuda_graphs=False")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 1 (lazy initialisation "
                             "must happen before the capture)")
        super().__init__(model, context, last_token_only=last_token_only,
                         check_addresses=check_addresses)
        self.warmup_steps = warmup_steps
        self._pool = None

    def release(self) -> None:
        super().release()
        self._pool = None

    def _capture(self, dims: InferenceBatchDimensions, view: GraphStepContext) -> Any:
        device = self.context.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            with refuse_host_syncs(dims):
                self.model.forward(view, last_token_only=self.last_token_only)
            for _ in range(self.warmup_steps - 1):
                self.model.forward(view, last_token_only=self.last_token_only)
        torch.cuda.current_stream(device).wait_stream(side)
        backend = getattr(self.model, "attention_backend", None)
        if backend is not None and backend not in GRAPH_SAFE_ATTENTION_BACKENDS:
            raise RuntimeError(
                f"attention backend {backend!r} cannot be captured in a CUDA graph (its plan "
                f"reads lengths back to the host); build the engine with attention_backend in "
                f"{GRAPH_SAFE_ATTENTION_BACKENDS}, or without num_cuda_graphs")
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                output = self.model.forward(view, last_token_only=self.last_token_only)
        except RuntimeError as error:
            raise RuntimeError(f"capturing the forward of graph {dims} failed (a host sync or "
                               f"a data-dependent shape in the forward?): {error}") from error
        return SimpleNamespace(graph=graph, output=output)

    def _replay(self, dims: InferenceBatchDimensions, graph: Any) -> torch.Tensor:
        graph.graph.replay()
        return graph.output


def make_graph_runner(model: Any, context: DynamicInferenceContext, *,
                      last_token_only: bool) -> Optional[_GraphRunner]:
    """The runner for ``context``'s device (``CudaGraphRunner`` on CUDA, else the stand-in), or
    None when the context has no graph ladder (``num_cuda_graphs`` unset)."""
    if not context.cuda_graph_batch_dimensions_list:
        return None
    cls = CudaGraphRunner if context.device.type == "cuda" else StandInGraphRunner
    return cls(model, context, last_token_only=last_token_only)


__all__ = ["CUDA_GRAPH_WARMUP_STEPS", "GRAPH_SAFE_ATTENTION_BACKENDS", "HOST_SYNC_FUNCTIONS",
           "CudaGraphRunner", "GraphReplayMismatch", "GraphStepContext", "HostSyncDetector",
           "Launch", "LaunchRecorder", "StandInGraphRunner",
           "forward_inputs", "graph_attention_backend", "host_sync_reason", "make_graph_runner",
           "refuse_host_syncs", "static_plan_values", "tensor_addresses"]
