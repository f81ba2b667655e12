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
graphs are captured again. The forward runs on ``GraphStepContext`` (``engine/replay_inputs.py``):
the context with the values a capture would bake in replaced by the graph's static ones.

Two runners share the capture protocol and the dimension choice (``GraphRunner``):

* ``CudaGraphRunner`` (CUDA): ``torch.cuda.CUDAGraph`` per graph, warm-up on a side stream,
  capture into one memory pool shared by every graph, replay. The outputs are the graph's own
  buffers: valid until the next replay of any graph (the engine consumes them within the step).
* ``StandInGraphRunner`` (any device, the CPU in CI): the same protocol, with a replay that
  freezes what a CUDA graph freezes: the capture writes down every launch of the forward and a
  replay checks each against it (``LaunchRecorder``, ``engine/launch_tape.py``); the output,
  copied into the graph's static buffer, is what the CUDA graph gives.

Both runners check before each replay (``check_addresses``) that every tensor of the capture is
still at its address, and run one forward per graph under ``refuse_host_syncs``
(``engine/sync_guard.py``) before capturing it. Steps whose padded dimensions are not a captured
graph (``using_cuda_graph_this_step()`` false, or a forward mode the graphs were not captured for)
run eagerly.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch

from dynctx.context import DynamicInferenceContext
from dynctx.context.batch_dimensions import InferenceBatchDimensions

from .launch_tape import LaunchRecorder
from .replay_inputs import (
    GRAPH_SAFE_ATTENTION_BACKENDS,
    GraphStepContext,
    forward_inputs,
    tensor_addresses,
)
from .sync_guard import refuse_host_syncs

# Eager runs on the side stream before a capture (lazy initialisation: cuBLAS workspaces,
# Triton compilation, rope tables, the attention object). Megatron warms up similarly.
CUDA_GRAPH_WARMUP_STEPS = 2


class GraphRunner:
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
            # A speculative step's decode requests have 1 + their drafts rows each
            # (docs/SEMANTICS.md §19).
            ctx = self.context
            rows = ctx.get_active_request_count()
            if getattr(ctx, "num_speculative_tokens", 0):
                paused, decode = ctx.paused_request_count, ctx.num_decode_requests
                rows += int(ctx.host_query_lengths()[paused:paused + decode].sum()) - decode
            return output[:rows]
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


class StandInGraphRunner(GraphRunner):
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


class CudaGraphRunner(GraphRunner):
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
                      last_token_only: bool) -> Optional[GraphRunner]:
    """The runner for ``context``'s device (``CudaGraphRunner`` on CUDA, else the stand-in), or
    None when the context has no graph ladder (``num_cuda_graphs`` unset)."""
    if not context.cuda_graph_batch_dimensions_list:
        return None
    cls = CudaGraphRunner if context.device.type == "cuda" else StandInGraphRunner
    return cls(model, context, last_token_only=last_token_only)


__all__ = ["CUDA_GRAPH_WARMUP_STEPS", "CudaGraphRunner", "GraphRunner", "StandInGraphRunner",
           "make_graph_runner"]
