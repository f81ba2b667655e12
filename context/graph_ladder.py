"""CUDA graph batch dimensions: the ladder of captured shapes, and each step's choice.

Pure functions of the configuration and of one step's counts; nothing here reads a context.
They reproduce megatron-core 0.16.1 (``CUDAGraphBatchDimensionBuilder`` and
``DynamicInferenceContext.initialize_attention_state``), and the differential tests check them
against it (tests/context/test_cuda_graphs_megatron.py).

The ladder. ``num_cuda_graphs`` token counts are spread evenly up to a cap (rounded to multiples
of 8 and of the tensor-parallel size). Each becomes a decode-only graph ``(n, 0 P, n D)`` with
``n`` at most ``max_requests``; with ``use_cuda_graphs_for_non_decode_steps`` and a positive
``cuda_graph_mixed_prefill_count`` (``m``), each also becomes a mixed graph
``(n, m P, n - m D)`` and a prefill-only graph ``(n, max(m, ...) P, 0 D)``. Invalid shapes
are dropped, duplicates removed, and the list sorted by prefill tokens
(``token_count - decode_req_count``), then decode requests, both descending. The context builds
it with the cap ``cuda_graph_max_tokens = max_requests``, as Megatron's context does, so no
graph holds more tokens than ``max_requests``.

The step's choice. A graph fits a step when it has no fewer tokens, and, for a decode-only
step, is decode-only with no fewer decode slots; for a step with prefills, it has no fewer
prefill slots and no fewer request slots in all (``strict``, for hybrid models: no fewer
decode slots either); and its chunked-prefill flag equals the step's (every graph has it
False, so a step with an explicit chunked prefill runs eager). Among the graphs that fit, the
smallest in ``(token_count, prefill_req_count, decode_req_count)`` order wins. Without one
the step runs eager, padded to the token and request rounders.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

from .batch_dimensions import InferenceBatchDimensions

__all__ = [
    "CUDA_GRAPH_ROUNDER",
    "CUDAGraphLadder",
    "StepBatchDimensions",
    "cuda_graph_token_counts",
    "is_valid_graph_dimensions",
    "graph_fits_step",
    "build_cuda_graph_ladder",
    "context_cuda_graph_ladder",
    "match_cuda_graph",
    "eager_padded_dimensions",
    "select_step_dimensions",
    "attention_batch_dimensions",
    "graph_attention_maxima",
    "dummy_request_plan",
]

#: Token counts of the ladder are multiples of this (Megatron's ``CUDA_GRAPH_ROUNDER``).
CUDA_GRAPH_ROUNDER = 8


def _int_arg(name: str, value, *, minimum: Optional[int] = None) -> int:
    """``value`` as an int (numpy's integers too, as the context's other sizes), bools
    refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _round_up(value: int, rounder: int, tp_size: int) -> int:
    """``value`` rounded up to a multiple of ``rounder`` rounded up to a multiple of ``tp``."""
    step = math.ceil(rounder / tp_size) * tp_size
    return step * math.ceil(value / step)


def cuda_graph_token_counts(tp_size: int, num_cuda_graphs: int,
                            cuda_graph_max_tokens: int) -> List[int]:
    """Evenly spaced token counts up to ``cuda_graph_max_tokens``, descending.

    The step is ``cuda_graph_max_tokens / num_cuda_graphs`` truncated, rounded up to a multiple
    of ``CUDA_GRAPH_ROUNDER`` and then of ``tp_size``; the top is ``cuda_graph_max_tokens``
    rounded down to a multiple of ``tp_size``. Example: tp 2, 4 graphs, 1000 tokens gives
    ``[1000, 768, 512, 256]`` (Megatron's docstring says ``[1000, 752, 504, 256]``; its code
    gives ours).
    """
    tp_size = _int_arg("tp_size", tp_size, minimum=1)
    num_cuda_graphs = _int_arg("num_cuda_graphs", num_cuda_graphs, minimum=1)
    cuda_graph_max_tokens = _int_arg("cuda_graph_max_tokens", cuda_graph_max_tokens, minimum=1)
    if num_cuda_graphs > cuda_graph_max_tokens:
        # Megatron's step would be 0 and its range() would raise; the builder clamps first.
        raise ValueError(f"num_cuda_graphs={num_cuda_graphs} must be <= cuda_graph_max_tokens="
                         f"{cuda_graph_max_tokens} (at least one token per graph)")
    step = CUDA_GRAPH_ROUNDER * math.ceil(
        int(cuda_graph_max_tokens / num_cuda_graphs) / CUDA_GRAPH_ROUNDER)
    step = math.ceil(step / tp_size) * tp_size
    top = cuda_graph_max_tokens // tp_size * tp_size
    if num_cuda_graphs == 1:
        return [top]
    counts = list(range(step, top, step))
    if not counts or counts[-1] != top:
        counts.append(top)
    counts.reverse()
    return counts


def is_valid_graph_dimensions(dims: InferenceBatchDimensions, max_requests: int,
                              max_sequence_length: int, tokens_per_decode: int = 1) -> bool:
    """Megatron's ``InferenceBatchDimensions.is_valid``: the shape fits the request budget,
    its counts are non-negative, every request has its tokens (``tokens_per_decode`` a decode
    request: ``1 + num_speculative_tokens``, as 0.19 counts them), no prefill is longer than
    ``max_sequence_length``, and a chunked-prefill flag comes with a prefill."""
    requests = dims.prefill_req_count + dims.decode_req_count
    decode_tokens = dims.decode_req_count * tokens_per_decode
    return not (
        requests > max_requests
        or dims.prefill_req_count < 0 or dims.decode_req_count < 0
        or dims.token_count < dims.prefill_req_count + decode_tokens
        or dims.token_count > dims.prefill_req_count * max_sequence_length + decode_tokens
        or (dims.prefill_req_count == 0 and dims.has_explicit_chunked_prefill_req)
    )


def graph_fits_step(graph: InferenceBatchDimensions, step: InferenceBatchDimensions, *,
                    strict: bool = False) -> bool:
    """Megatron's ``is_applicable_for_batch_dim``: can ``graph`` run ``step`` (padded)?

    Without ``strict`` a graph's prefill slots may take decode requests; with it (hybrid
    models, whose decode and prefill Mamba paths differ) they may not.
    """
    if graph.has_explicit_chunked_prefill_req != step.has_explicit_chunked_prefill_req:
        return False
    if graph.token_count < step.token_count:
        return False
    if step.prefill_req_count == 0:
        return graph.prefill_req_count == 0 and graph.decode_req_count >= step.decode_req_count
    if graph.prefill_req_count < step.prefill_req_count:
        return False
    if strict:
        return graph.decode_req_count >= step.decode_req_count
    return graph.req_count >= step.req_count


@dataclass(frozen=True)
class CUDAGraphLadder:
    """The graph shapes of a configuration, as Megatron's context names them.

    ``cuda_graph_batch_dimensions_list``: sorted by prefill tokens, then decode requests, both
    descending (empty without ``num_cuda_graphs``). ``cuda_graph_token_counts``: the distinct
    token counts of that list, descending, or None when it is empty.
    """

    cuda_graph_batch_dimensions_list: Tuple[InferenceBatchDimensions, ...]
    cuda_graph_token_counts: Optional[Tuple[int, ...]]
    # The graphs in ascending order (the first that fits is the smallest), and the choices
    # already made (by ``match`` and ``select_step_dimensions``): a step's counts repeat from
    # step to step, so choosing is a dict lookup.
    _ascending: Tuple[InferenceBatchDimensions, ...] = field(
        init=False, repr=False, compare=False)
    _choices: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        ascending = tuple(sorted(self.cuda_graph_batch_dimensions_list))
        object.__setattr__(self, "_ascending", ascending)
        object.__setattr__(self, "_choices", {})

    def __len__(self) -> int:
        return len(self.cuda_graph_batch_dimensions_list)

    def __iter__(self):
        return iter(self.cuda_graph_batch_dimensions_list)

    def match(self, step: InferenceBatchDimensions, *,
              strict: bool = False) -> Optional[InferenceBatchDimensions]:
        """``match_cuda_graph(step, self, strict=strict)``, remembered per step."""
        key = (step, strict)
        try:
            return self._choices[key]
        except KeyError:
            pass
        best = None
        for graph in self._ascending:
            if graph_fits_step(graph, step, strict=strict):
                best = graph
                break
        if len(self._choices) >= _MAX_REMEMBERED_CHOICES:
            self._choices.clear()
        self._choices[key] = best
        return best


#: Bound on the choices a ladder remembers (a long run sees few distinct step shapes).
_MAX_REMEMBERED_CHOICES = 4096


def build_cuda_graph_ladder(*, num_cuda_graphs: Optional[int], max_requests: int,
                            max_tokens: int, max_sequence_length: int, tp_size: int = 1,
                            use_cuda_graphs_for_non_decode_steps: bool = True,
                            cuda_graph_mixed_prefill_count: Optional[int] = 16,
                            cuda_graph_max_tokens: Optional[int] = None,
                            tokens_per_decode: int = 1) -> CUDAGraphLadder:
    """Megatron's ``CUDAGraphBatchDimensionBuilder.generate_cuda_graph_batch_dimensions_list``.

    ``tokens_per_decode``: a decode request's tokens in a step, ``1 + num_speculative_tokens``
    (0.19's builder): decode graphs hold ``n // tokens_per_decode`` requests of that many tokens
    each (up to ``max_requests * tokens_per_decode`` tokens), a mixed graph's decode slots are
    what its tokens leave after the prefills, and the sort counts prefill tokens as
    ``token_count - decode_req_count * tokens_per_decode``. 1 is megatron-core 0.16.1's ladder.

    ``cuda_graph_max_tokens`` outside ``(0, max_tokens]`` (or None) becomes ``max_tokens``;
    ``num_cuda_graphs`` is clamped to ``[1, cuda_graph_max_tokens]`` (Megatron's clamping: 0
    or a negative count asks for one graph). ``cuda_graph_mixed_prefill_count`` None or
    ``<= 0``, or ``use_cuda_graphs_for_non_decode_steps=False``, gives decode-only graphs.
    """
    tp_size = _int_arg("tp_size", tp_size, minimum=1)
    per_decode = _int_arg("tokens_per_decode", tokens_per_decode, minimum=1)
    max_requests = _int_arg("max_requests", max_requests, minimum=1)
    max_tokens = _int_arg("max_tokens", max_tokens, minimum=1)
    max_sequence_length = _int_arg("max_sequence_length", max_sequence_length, minimum=1)
    # Checked with or without graphs: a wrong kind of value is wrong either way.
    if cuda_graph_mixed_prefill_count is not None:
        cuda_graph_mixed_prefill_count = _int_arg("cuda_graph_mixed_prefill_count",
                                                  cuda_graph_mixed_prefill_count)
    if cuda_graph_max_tokens is not None:
        cuda_graph_max_tokens = _int_arg("cuda_graph_max_tokens", cuda_graph_max_tokens)
    if num_cuda_graphs is None:
        return CUDAGraphLadder((), None)
    num_cuda_graphs = _int_arg("num_cuda_graphs", num_cuda_graphs)
    if cuda_graph_max_tokens is None or not 0 < cuda_graph_max_tokens <= max_tokens:
        cuda_graph_max_tokens = max_tokens
    num_cuda_graphs = min(max(num_cuda_graphs, 1), cuda_graph_max_tokens)
    prefill_counts = cuda_graph_token_counts(tp_size, num_cuda_graphs, cuda_graph_max_tokens)
    # Decode graphs need no more tokens than their requests' tokens, per_decode each.
    decode_cap = min(cuda_graph_max_tokens, max_requests * per_decode)
    if num_cuda_graphs > decode_cap:
        # Megatron raises here too (a zero step in range()); its context, which caps the
        # graphs at max_requests tokens, never gets here.
        raise ValueError(
            f"num_cuda_graphs={num_cuda_graphs} (after clamping to cuda_graph_max_tokens="
            f"{cuda_graph_max_tokens}) is more than the decode graphs' token cap "
            f"min(cuda_graph_max_tokens, max_requests={max_requests} * tokens_per_decode="
            f"{per_decode}) = {decode_cap}: ask for "
            f"at most {decode_cap} graphs")
    decode_counts = cuda_graph_token_counts(tp_size, num_cuda_graphs, decode_cap)

    shapes: List[InferenceBatchDimensions] = []

    def add_if_valid(token_count: int, prefill_req_count: int, decode_req_count: int) -> None:
        dims = InferenceBatchDimensions(token_count, prefill_req_count, decode_req_count)
        if is_valid_graph_dimensions(dims, max_requests, max_sequence_length, per_decode):
            shapes.append(dims)

    mixed = cuda_graph_mixed_prefill_count
    if mixed is not None and mixed > 0 and use_cuda_graphs_for_non_decode_steps:
        prefills = min(mixed, max_requests)
        for size in prefill_counts:
            add_if_valid(size, prefills,
                         min((size - prefills) // per_decode, max_requests - prefills))
            # Enough prefills that none is longer than max_sequence_length - 1 (one decode
            # token of each dummy prefill request goes to building it).
            fewest = max(mixed, math.ceil(size / max(1, max_sequence_length - 1)))
            if fewest < max_requests:
                add_if_valid(size, max(fewest, min(max_requests, size)), 0)
    for size in decode_counts:
        decode = min(size // per_decode, max_requests)
        # 0.19 keeps a speculative decode graph's tokens a multiple of the TP size.
        tokens = decode * per_decode
        if per_decode > 1:
            tokens = tokens // tp_size * tp_size
        add_if_valid(tokens, 0, decode)

    # Megatron dedups through a set; shapes are distinct per sort key in practice, and a tie
    # keeps the set's iteration order, which hashing the same fields reproduces.
    unique = list(set(shapes))
    unique.sort(key=lambda d: (d.token_count - d.decode_req_count * per_decode,
                               d.decode_req_count),
                reverse=True)
    if not unique:
        return CUDAGraphLadder((), None)
    tokens = tuple(sorted({d.token_count for d in unique}, reverse=True))
    return CUDAGraphLadder(tuple(unique), tokens)


def context_cuda_graph_ladder(*, num_cuda_graphs: Optional[int], max_requests: int,
                              max_tokens: int, max_sequence_length: int, tp_size: int = 1,
                              use_cuda_graphs_for_non_decode_steps: bool = True,
                              cuda_graph_mixed_prefill_count: Optional[int] = 16,
                              tokens_per_decode: int = 1) -> CUDAGraphLadder:
    """The ladder Megatron's context builds in its constructor: capped at ``max_requests *
    tokens_per_decode`` tokens (its deprecated ``cuda_graph_max_tokens`` argument is
    ignored; ``tokens_per_decode``: 0.19's decode bound, ``1 + num_speculative_tokens``)."""
    return build_cuda_graph_ladder(
        num_cuda_graphs=num_cuda_graphs, max_requests=max_requests, max_tokens=max_tokens,
        max_sequence_length=max_sequence_length, tp_size=tp_size,
        use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
        cuda_graph_mixed_prefill_count=cuda_graph_mixed_prefill_count,
        cuda_graph_max_tokens=min(max_tokens, max_requests * tokens_per_decode),
        tokens_per_decode=tokens_per_decode)


def match_cuda_graph(step: InferenceBatchDimensions,
                     graphs: Union[CUDAGraphLadder, Sequence[InferenceBatchDimensions]], *,
                     strict: bool = False) -> Optional[InferenceBatchDimensions]:
    """The graph a step runs in (Megatron's ``match_graph_config``, one expert-parallel rank):
    the smallest ``(token_count, prefill_req_count, decode_req_count)`` among those that fit,
    or None (eager). A ``CUDAGraphLadder`` answers from its memory of earlier steps."""
    if isinstance(graphs, CUDAGraphLadder):
        return graphs.match(step, strict=strict)
    best = None
    for graph in graphs:
        if graph_fits_step(graph, step, strict=strict) and (best is None or graph < best):
            best = graph
    return best


def eager_padded_dimensions(step: InferenceBatchDimensions, *, max_requests: int,
                            max_tokens: int, tp_size: int = 1, token_rounder: int = 64,
                            request_rounder: int = 4,
                            tokens_per_decode: int = 1) -> InferenceBatchDimensions:
    """A step's padded dimensions when it runs eager.

    Speculative decode-only steps (``tokens_per_decode > 1``, 0.19): decode slots rounded up
    to ``request_rounder`` and capped at ``max_requests``, ``tokens_per_decode`` tokens each
    (never below the step's tokens, at most ``max_tokens``).

    Decode-only: tokens rounded up to ``token_rounder``, capped at ``max_requests`` (never
    below the step's tokens: dummy decode rows of ``add_dummy_requests_parallel`` may carry
    several) and at ``max_tokens``, all of them decode slots. With prefills: tokens rounded up
    and capped at ``max_tokens``, requests rounded up to ``request_rounder`` and capped at
    ``max_requests``, the extra request slots counted as prefills. Megatron does not cap the
    prefill step's tokens and can pad past its token buffer (docs/SEMANTICS.md §8); this is the
    one place where the two differ.
    """
    if step.prefill_req_count == 0 and tokens_per_decode > 1:
        slots = min(max_requests, _round_up(step.decode_req_count, request_rounder, tp_size))
        tokens = min(max_tokens, max(step.token_count, slots * tokens_per_decode))
        return InferenceBatchDimensions(tokens, 0, slots, False)
    tokens = _round_up(step.token_count, token_rounder, tp_size)
    if step.prefill_req_count == 0:
        tokens = min(max_tokens, max(step.token_count, min(max_requests, tokens)))
        return InferenceBatchDimensions(tokens, 0, tokens, False)
    requests = min(max_requests, _round_up(step.req_count, request_rounder, tp_size))
    return InferenceBatchDimensions(min(max_tokens, tokens), requests - step.decode_req_count,
                                    step.decode_req_count, step.has_explicit_chunked_prefill_req)


class StepBatchDimensions(NamedTuple):
    """One step's choice, under Megatron's names.

    ``attn_batch_dimensions``: the real counts as the attention metadata sees them; in a graph
    with fewer decode slots than the step has decode requests, the extra decode requests are
    counted as prefills (Megatron's ``attn_dimensions``).
    """

    batch_dimensions: InferenceBatchDimensions
    padded_batch_dimensions: InferenceBatchDimensions
    using_cuda_graph_this_step: bool
    attn_batch_dimensions: InferenceBatchDimensions

    @property
    def padded_active_token_count(self) -> int:
        return self.padded_batch_dimensions.token_count

    @property
    def padded_active_request_count(self) -> int:
        return self.padded_batch_dimensions.req_count


def attention_batch_dimensions(step: InferenceBatchDimensions,
                               graph: Optional[InferenceBatchDimensions]
                               ) -> InferenceBatchDimensions:
    """Megatron's ``attn_dimensions``: ``step``, except in a graph with fewer decode slots than
    the step has decode requests, where the surplus decode requests count as prefills."""
    if graph is None or step.decode_req_count <= graph.decode_req_count:
        return step
    return InferenceBatchDimensions(step.token_count, step.req_count - graph.decode_req_count,
                                    graph.decode_req_count, False)


def select_step_dimensions(step: InferenceBatchDimensions,
                           graphs: Union[CUDAGraphLadder, Sequence[InferenceBatchDimensions]],
                           *, strict: bool, max_requests: int, max_tokens: int, tp_size: int = 1,
                           token_rounder: int = 64, request_rounder: int = 4,
                           tokens_per_decode: int = 1) -> StepBatchDimensions:
    """Megatron's per-step choice in ``initialize_attention_state``: the matching graph's
    dimensions, or the eager padding (``eager_padded_dimensions``) when none fits.

    ``strict``: the context is a hybrid (Mamba) model. A ``CUDAGraphLadder`` remembers the
    choice for the step's counts, so a repeated step costs a dict lookup.
    ``tokens_per_decode``: ``1 + num_speculative_tokens`` (``eager_padded_dimensions``).
    """
    memo = graphs._choices if isinstance(graphs, CUDAGraphLadder) else None
    if memo is not None:
        key = (step, strict, max_requests, max_tokens, tp_size, token_rounder, request_rounder,
               tokens_per_decode)
        choice = memo.get(key)
        if choice is not None:
            return choice
    graph = match_cuda_graph(step, graphs, strict=strict)
    if graph is None:
        padded = eager_padded_dimensions(step, max_requests=max_requests, max_tokens=max_tokens,
                                         tp_size=tp_size, token_rounder=token_rounder,
                                         request_rounder=request_rounder,
                                         tokens_per_decode=tokens_per_decode)
    else:
        padded = graph
    choice = StepBatchDimensions(step, padded, graph is not None,
                                 attention_batch_dimensions(step, graph))
    if memo is not None:
        if len(memo) >= _MAX_REMEMBERED_CHOICES:
            memo.clear()
        memo[key] = choice
    return choice


def graph_attention_maxima(padded: InferenceBatchDimensions, max_sequence_length: int,
                           tokens_per_decode: int = 1) -> Tuple[int, int]:
    """``(max_seqlen_q, max_seqlen_k)`` as Megatron's graphed attention metadata reports them
    for a step in graph ``padded``: static per graph, so a captured forward can bake them in.
    ``max_seqlen_q`` is ``tokens_per_decode`` (``1 + num_speculative_tokens``) for a
    decode-only graph, else ``max(2, token_count)`` (the prefill
    kernel is always the one launched); ``max_seqlen_k`` is ``max_sequence_length``. An eager
    step reports the real maxima instead."""
    max_q = tokens_per_decode if padded.prefill_req_count == 0 else max(2, padded.token_count)
    return max_q, max_sequence_length


def dummy_request_plan(graph: InferenceBatchDimensions,
                       tokens_per_decode: int = 1) -> Tuple[int, List[int]]:
    """The requests Megatron's ``add_dummy_requests_for_cudagraph_capture`` adds to capture
    ``graph``: ``decode_req_count`` decode requests of ``tokens_per_decode`` tokens each (ids
    ``0..D-1``; one token, or 0.19's ``1 + num_speculative_tokens``), then
    ``prefill_req_count`` prefills (ids ``D..``) sharing the graph's prefill tokens
    (``token_count - decode_req_count * tokens_per_decode``), the remainder one each to the
    first ones.

    Returns ``(decode request count, prefill lengths)``.
    """
    if graph.has_explicit_chunked_prefill_req:
        raise ValueError(f"graph {graph} has an explicit chunked prefill: no graph is captured "
                         "for one")
    for name in ("token_count", "prefill_req_count", "decode_req_count"):
        value = getattr(graph, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"graph {graph}: {name}={value!r} must be an int")
    if graph.prefill_req_count < 0 or graph.decode_req_count < 0:
        raise ValueError(f"graph {graph} has a negative request count")
    prefill_tokens = graph.token_count - graph.decode_req_count * tokens_per_decode
    if graph.prefill_req_count == 0:
        if prefill_tokens != 0:
            raise ValueError(f"graph {graph}: a decode-only graph needs token_count == "
                             f"decode_req_count * {tokens_per_decode}, got {graph.token_count} "
                             f"tokens for {graph.decode_req_count} decode requests")
        return graph.decode_req_count, []
    each, rest = divmod(prefill_tokens, graph.prefill_req_count)
    if each <= 0:
        raise ValueError(f"graph {graph}: {prefill_tokens} prefill tokens for "
                         f"{graph.prefill_req_count} prefill requests (each needs at least one)")
    return graph.decode_req_count, [each + (1 if i < rest else 0)
                                    for i in range(graph.prefill_req_count)]
