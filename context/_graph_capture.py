"""CUDA graph capture dummies: the requests that give a step a graph's exact dimensions.

``add_dummy_requests_for_cudagraph_capture(graph)`` (and
``initialize_attention_state(construct_graph_dimensions=graph)``, which calls it) fills an
empty context as megatron-core 0.16.1 does before capturing ``graph``: ``decode_req_count``
one-token requests (ids ``0..D-1``) added with ``add_dummy_requests_parallel(...,
count_as_prefill=False)``, then ``prefill_req_count`` prefills sharing the graph's prefill
tokens (``cuda_graphs.dummy_request_plan``) added with ``add_dummy_requests_parallel``; every
token id 0, every block the dummy block (no block is allocated). The step that follows runs in
``graph``; ``reset()`` afterwards returns the context to empty.

``capture_requests`` builds both lists from the unchanged request table after checking the
whole graph at once, so that neither of the two adds can fail half-way. ``DummyRequestsMixin``
holds both methods of the facade: one path (``admission.plan_dummies``, then
``RequestTable.commit_dummies``) adds every dummy row.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .admission import plan_dummies
from .batch_dimensions import InferenceBatchDimensions
from .cuda_graphs import dummy_request_plan
from .errors import (
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TokenOverflowError,
)
from .requests import DynamicInferenceRequest, SamplingParams


def capture_requests(table, graph_dimensions: InferenceBatchDimensions, *,
                     max_tokens: int, max_sequence_length: int
                     ) -> Tuple[List[DynamicInferenceRequest], List[DynamicInferenceRequest]]:
    """``(decode requests, prefill requests)`` of ``graph_dimensions``'s dummies for the empty
    ``table``; changes nothing.

    Raises ``TypeError`` for anything but an ``InferenceBatchDimensions``, ``RuntimeError``
    when the table holds requests, ``ValueError`` for dimensions no dummy set can give (a
    chunked-prefill graph, fewer prefill tokens than prefill requests), and the context's
    overflow errors when they exceed ``max_requests``, ``max_tokens``, ``max_sequence_length``
    or (hybrids) the free Mamba slots.
    """
    if not isinstance(graph_dimensions, InferenceBatchDimensions):
        raise TypeError(f"graph_dimensions must be an InferenceBatchDimensions, got "
                        f"{type(graph_dimensions).__name__}")
    if table.total:
        raise RuntimeError(
            f"add_dummy_requests_for_cudagraph_capture needs an empty context, it holds "
            f"{table.total} requests (call reset() first)")
    decode, prefill_lengths = dummy_request_plan(graph_dimensions)
    count, tokens = decode + len(prefill_lengths), decode + sum(prefill_lengths)
    if count > table.request_limit:
        raise RequestOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                              f"requests > max_requests ({table.request_limit})")
    if tokens > max_tokens:
        raise TokenOverflowError(count - 1, f"graph {graph_dimensions} needs {tokens} "
                                            f"tokens > max_tokens ({max_tokens})")
    if prefill_lengths and prefill_lengths[0] > max_sequence_length:
        raise MaxSequenceLengthOverflowError(
            decode, f"graph {graph_dimensions} needs a {prefill_lengths[0]}-token prefill > "
            f"max_sequence_length ({max_sequence_length})")
    if table.hybrid and table.slots.free_count < count:
        raise ContextOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                              "Mamba slots; No Mamba slots available")
    # Megatron's dummies: prompts of token 0, one token to generate, no termination id.
    params = SamplingParams(num_tokens_to_generate=1, termination_id=-1)
    zeros = torch.zeros(max([1] + prefill_lengths), dtype=torch.int64)
    decode_requests = [DynamicInferenceRequest(request_id=i, prompt_tokens=zeros[:1],
                                               sampling_params=params) for i in range(decode)]
    prefill_requests = [DynamicInferenceRequest(request_id=decode + i,
                                                prompt_tokens=zeros[:length],
                                                sampling_params=params)
                        for i, length in enumerate(prefill_lengths)]
    return decode_requests, prefill_requests


class DummyRequestsMixin:
    """``add_dummy_requests_parallel`` and ``add_dummy_requests_for_cudagraph_capture``."""

    def add_dummy_requests_parallel(self, requests: Sequence[DynamicInferenceRequest], *,
                                    count_as_prefill: bool = True) -> None:
        """Add whole-prompt requests whose every block is the dummy block (no KV block is
        allocated: ``block_allocator.total_avail`` is unchanged; their K/V writes land in the
        dummy block), as Megatron-Core does for CUDA-graph warm-up and capture.

        ``count_as_prefill=False`` counts them as decode rows (they must come before any
        prefill of the step); their tokens are still their prompts. On a hybrid model each gets
        a Mamba slot whose states are zeroed now. Every check runs first (the request and token
        limits, ids not in the context, free Mamba slots): an error changes nothing. Finishing
        such a request releases nothing but its row and slot.
        """
        self._check_allocated()
        plan = plan_dummies(self._table, requests, count_as_prefill,
                            max_sequence_length=self.max_sequence_length,
                            metadata_types=self.request_metadata_types, device=self.device,
                            vocab_size=self.vocab_size, max_tokens=self.max_tokens)
        if plan.ids.size == 0:
            return
        slots = self._table.commit_dummies(plan)
        if slots.size:
            index = torch.from_numpy(slots).to(self.device)
            self.mamba_conv_states.index_fill_(1, index, 0)
            self.mamba_ssm_states.index_fill_(1, index, 0)
        self._device.arena.dirty = True
        self._step = None

    def add_dummy_requests_for_cudagraph_capture(
            self, graph_dimensions: InferenceBatchDimensions) -> None:
        """Fill the empty context with the requests of ``graph_dimensions`` as megatron-core
        0.16.1 does before a capture: its decode dummies, then its prefill dummies, through
        ``add_dummy_requests_parallel`` (``capture_requests``: the whole graph is checked before
        anything changes); ``reset()`` after the captured step empties the context again."""
        self._check_allocated()
        decode, prefill = capture_requests(self._table, graph_dimensions,
                                           max_tokens=self.max_tokens,
                                           max_sequence_length=self.max_sequence_length)
        self.add_dummy_requests_parallel(decode, count_as_prefill=False)
        self.add_dummy_requests_parallel(prefill)
