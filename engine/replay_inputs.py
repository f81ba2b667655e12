"""What a graph replay reads: the context as a captured forward sees it, and where its inputs live.

* ``GraphStepContext``: everything the context publishes, except the values a captured forward
  would otherwise bake in from the capture step (``static_plan_values``):
  ``active_attn_metadata.max_seqlen_q``/``max_seqlen_k`` are static bounds of the graph, the
  values upstream's graphed metadata reports (``graph_attention_maxima``: 1 for a decode-only
  graph, else ``max(2, token_count)``; ``max_sequence_length``), instead of the step's exact
  maxima; ``num_decode_requests`` is the graph's decode count for a decode-only graph, else 0 (in
  a mixed graph, rows past the step's real decode requests may be real prefills);
  ``last_token_logits`` gives one row per request of the graph (padded rows repeat the last real
  token's row), so the output has the graph's shape.
* ``forward_inputs`` / ``tensor_addresses``: every tensor the forward reads from the context and
  its address, which the runners check before each replay (a CUDA graph silently relies on it).
* ``graph_attention_backend``: the attention backend an engine with graphs runs, one whose plan
  and forward read nothing back (``GRAPH_SAFE_ATTENTION_BACKENDS``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, Optional, Tuple

import torch

from dynctx.context import DynamicInferenceContext
from dynctx.context.batch_dimensions import InferenceBatchDimensions
from dynctx.context.graph_ladder import graph_attention_maxima
from dynctx.kernels.last_token_logits import last_token_logits as last_token_rows
from dynctx.models.paged_attention import flash_attn_available, resolve_attention_backend

# The attention backends whose plan and forward read nothing back once planned with static
# maxima: FlashInfer's plan reads lengths back (models/paged_attention.py), and "torch" groups by
# length on the host, where its padded form "torch_static" does not.
GRAPH_SAFE_ATTENTION_BACKENDS = ("torch_static", "triton", "flash_attn")


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
    # A speculative decode request forwards 1 + k tokens (docs/SEMANTICS.md §19).
    per_decode = 1 + int(getattr(ctx, "num_speculative_tokens", 0) or 0)
    max_q, max_k = graph_attention_maxima(dims, int(ctx.max_sequence_length), per_decode)
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
        the step's real requests repeat the last real token's row (their query length is 0).
        With speculative steps, the context's ``speculative_required_logit_indices`` rows."""
        ctx, dims = self._ctx, self.graph_dimensions
        meta = ctx.active_attn_metadata
        if meta is None:
            raise RuntimeError("last_token_logits outside a step: call "
                               "initialize_attention_state() first")
        rows = logits[0] if logits.dim() == 3 else logits
        if rows.shape[0] != dims.token_count:
            raise ValueError(f"logits has {rows.shape[0]} token rows, graph {dims} has "
                             f"{dims.token_count}")
        if getattr(ctx, "num_speculative_tokens", 0):
            # Speculative steps: every decode token's row, then each prefill's last, padded to
            # the graph (the context's index, refreshed in place each step: §19).
            return rows.index_select(0, ctx.speculative_required_logit_indices())
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


__all__ = ["GRAPH_SAFE_ATTENTION_BACKENDS", "GraphStepContext", "forward_inputs",
           "graph_attention_backend", "static_plan_values", "tensor_addresses"]
