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
* ``StandInGraphRunner`` (any device, the CPU in CI): the same protocol with "replay" = the
  forward called on the same static inputs, its output copied into a static buffer per graph.
  Each replay checks that the output has the captured shape, which a CUDA graph relies on.

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

import os
import traceback
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

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
    """Runs the capture protocol without CUDA graphs (module docstring): a "replay" calls the
    forward on the static inputs and copies its output into the graph's static buffer."""

    kind = "stand-in"

    def _capture(self, dims: InferenceBatchDimensions, view: GraphStepContext) -> Any:
        with refuse_host_syncs(dims):
            output = self.model.forward(view, last_token_only=self.last_token_only)
        return SimpleNamespace(view=view, output=output.clone())

    def _replay(self, dims: InferenceBatchDimensions, graph: Any) -> torch.Tensor:
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
           "CudaGraphRunner", "GraphStepContext", "HostSyncDetector", "StandInGraphRunner",
           "forward_inputs", "graph_attention_backend", "host_sync_reason", "make_graph_runner",
           "refuse_host_syncs", "static_plan_values", "tensor_addresses"]
