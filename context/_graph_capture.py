"""CUDA graph capture dummies: the requests that give a step a graph's exact dimensions.

``add_dummy_requests_for_cudagraph_capture(graph)`` (and
``initialize_attention_state(construct_graph_dimensions=graph)``, which calls it) fills an
empty context as megatron-core 0.16.1 does before capturing ``graph``: ``decode_req_count``
one-token decode requests (ids ``0..D-1``), then ``prefill_req_count`` prefills sharing the
graph's prefill tokens (``dummy_request_plan``), every token id 0, every block the dummy block
(no block is allocated; positions and slots as for a fresh request). The step that follows
runs in ``graph``; ``reset()`` afterwards returns the context to empty.

``plan_dummy_requests`` makes one ``admission.AddPlan`` per dummy from the unchanged request
table, with every check; the context commits them with ``RequestTable.commit_add`` like any
add (the plans carry ``dummy_block`` and, for decode rows, ``decode``).
"""

from __future__ import annotations

from typing import List

import numpy as np

from .admission import AddPlan, metadata_values
from .batch_dimensions import InferenceBatchDimensions
from .cuda_graphs import dummy_request_plan
from .errors import ContextOverflowError, RequestOverflowError, TokenOverflowError
from .requests import DynamicInferenceRequest, SamplingParams


def plan_dummy_requests(table, graph_dimensions: InferenceBatchDimensions, *,
                        metadata_types: list) -> List[AddPlan]:
    """The add plans of ``graph_dimensions``'s dummies against the empty ``table``; change
    nothing.

    Raises ``TypeError`` for anything but an ``InferenceBatchDimensions``, ``RuntimeError``
    when the table holds requests, ``ValueError`` for dimensions no dummy set can give (a
    chunked-prefill graph, fewer prefill tokens than prefill requests), and the context's
    overflow errors when they exceed ``max_requests``, ``max_tokens`` or (hybrids) the free
    Mamba slots.
    """
    if not isinstance(graph_dimensions, InferenceBatchDimensions):
        raise TypeError(f"graph_dimensions must be an InferenceBatchDimensions, got "
                        f"{type(graph_dimensions).__name__}")
    if table.total:
        raise RuntimeError(
            f"add_dummy_requests_for_cudagraph_capture needs an empty context, it holds "
            f"{table.total} requests (call reset() first)")
    decode, prefill_lengths = dummy_request_plan(graph_dimensions)
    lengths = [1] * decode + prefill_lengths
    count, tokens = len(lengths), sum(lengths)
    if count > table.max_requests:
        raise RequestOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                              f"requests > max_requests ({table.max_requests})")
    if tokens > table.max_tokens:
        raise TokenOverflowError(count - 1, f"graph {graph_dimensions} needs {tokens} "
                                            f"tokens > max_tokens ({table.max_tokens})")
    if table.hybrid and table.slots.free_count < count:
        raise ContextOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                              "Mamba slots; No Mamba slots available")
    # One request (Megatron's dummy: one token to generate) gives the metadata values.
    sample = DynamicInferenceRequest(
        request_id=0, prompt_tokens=[0],
        sampling_params=SamplingParams(num_tokens_to_generate=1, termination_id=-1))
    metadata = metadata_values(sample, metadata_types)
    dummy, bs = table.allocator.dummy_block_idx, table.block_size
    plans, tokens_before = [], 0
    for row, length in enumerate(lengths):
        is_decode = row < decode
        plans.append(AddPlan(
            request_id=row, row=row, is_continuation=False, chunk=length, finished=0, gen=1,
            already=0, needed=-(-length // bs), tokens_before=tokens_before,
            # Prefill tokens go to the prompt buffer, which starts at the first prefill.
            prompt_offset=tokens_before - decode if not is_decode else 0,
            host_prompt=None if is_decode else np.zeros(length, dtype=np.int64),
            device_prompt=None, metadata=metadata, partial=False, dummy_block=dummy,
            decode=is_decode))
        tokens_before += length
    return plans
