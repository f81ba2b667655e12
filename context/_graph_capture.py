"""CUDA graph capture dummies: the requests that give a step a graph's exact dimensions.

``add_dummy_requests_for_cudagraph_capture(graph)`` (and
``initialize_attention_state(construct_graph_dimensions=graph)``, which calls it) fills an
empty context as megatron-core 0.16.1 does before capturing ``graph``: ``decode_req_count``
one-token decode requests (ids ``0..D-1``), then ``prefill_req_count`` prefills sharing the
graph's prefill tokens (``dummy_request_plan``), every token id 0, every block the dummy block
(no block is allocated; positions and slots as for a fresh request). The step that follows
runs in ``graph``; ``reset()`` afterwards returns the context to empty.
"""

from __future__ import annotations

import numpy as np

from ._fields import (
    FIELD_BLOCKS,
    FIELD_IDS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_OUTPUT,
    FIELD_QUERY,
)
from .batch_dimensions import InferenceBatchDimensions
from .cuda_graphs import dummy_request_plan
from .errors import ContextOverflowError, RequestOverflowError, TokenOverflowError
from .requests import DynamicInferenceRequest, SamplingParams


class GraphCaptureMixin:
    """``add_dummy_requests_for_cudagraph_capture`` for ``DynamicInferenceContext``."""

    def add_dummy_requests_for_cudagraph_capture(
            self, graph_dimensions: InferenceBatchDimensions) -> None:
        """Fill the empty context with the requests of ``graph_dimensions`` (module docstring).

        Raises ``RuntimeError`` when the context holds requests, ``ValueError`` for dimensions
        no dummy set can give (a chunked-prefill graph, fewer prefill tokens than prefill
        requests), and the context's overflow errors when they exceed ``max_requests``,
        ``max_tokens`` or (hybrids) the free Mamba slots.
        """
        self._check_allocated()
        if not isinstance(graph_dimensions, InferenceBatchDimensions):
            raise TypeError(f"graph_dimensions must be an InferenceBatchDimensions, got "
                            f"{type(graph_dimensions).__name__}")
        if self.total_request_count:
            raise RuntimeError(
                f"add_dummy_requests_for_cudagraph_capture needs an empty context, it holds "
                f"{self.total_request_count} requests (call reset() first)")
        decode, prefill_lengths = dummy_request_plan(graph_dimensions)
        lengths = [1] * decode + prefill_lengths
        count, tokens = len(lengths), sum(lengths)
        if count > self.max_requests:
            raise RequestOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                                  f"requests > max_requests ({self.max_requests})")
        if tokens > self.max_tokens:
            raise TokenOverflowError(count - 1, f"graph {graph_dimensions} needs {tokens} "
                                                f"tokens > max_tokens ({self.max_tokens})")
        if self.is_hybrid_model and self._mamba_slots.free_count < count:
            raise ContextOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                                  "Mamba slots; No Mamba slots available")
        # One request (Megatron's dummy: one token to generate) gives the metadata values.
        sample = DynamicInferenceRequest(
            request_id=0, prompt_tokens=[0],
            sampling_params=SamplingParams(num_tokens_to_generate=1, termination_id=-1))
        metadata = self._metadata_values(sample)

        # From here on nothing raises.
        bs, dummy = self.block_size_tokens, self.block_allocator.dummy_block_idx
        rows = np.arange(count)
        length = np.asarray(lengths, dtype=np.int64)
        h = self._h_req
        h[:, :count] = 0
        h[FIELD_IDS, :count] = rows
        h[FIELD_QUERY, :count] = length
        h[FIELD_OUTPUT, :count] = length + 1
        h[FIELD_KV_OFFSET, :count] = 0
        blocks = -(-length // bs)
        h[FIELD_BLOCKS, :count] = blocks
        h[FIELD_LAST_BLOCK, :count] = dummy
        h[FIELD_LAST_OFFSET, :count] = (length - 1) % bs
        h[FIELD_MAMBA_SLOT, :count] = -1
        width = int(blocks.max()) if count else 0
        self._h_bt[:count] = -1
        self._h_bt[:count, :width] = np.where(np.arange(width) < blocks[:, None], dummy, -1)
        for (label, _, _), value in zip(self.request_metadata_types, metadata):
            self._arena.host[f"meta:{label}"][:count] = value
        if self.is_hybrid_model:
            for row in range(count):
                slot = self._mamba_slots.allocate()
                h[FIELD_MAMBA_SLOT, row] = slot
                self._arena.host["mamba_zero_slots"][self._mamba_zero_count] = slot
                self._mamba_zero_count += 1
        # Decode rows read their token from the step's sampled tokens, prefills from the
        # prompt buffer, which then starts at the first prefill.
        self._next_tokens[self._current][:decode].zero_()
        self._h_prompt[:tokens - decode] = 0
        self._live_ids.update(range(count))
        self._bt_dirty_from = 0
        self._arena.dirty = True
        self.total_request_count = count
        self.active_token_count = tokens
        self.num_prefill_requests = graph_dimensions.prefill_req_count
