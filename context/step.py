"""One step's description, built once by ``initialize_attention_state``.

``StepBuilder.build`` reads the request table, decides the real and padded dimensions, writes the
attention (and Mamba) host metadata into the arena's host sections, and returns a frozen
``Step`` that every later call of the step (the kernels' launch, rope, KV append, logits) reads
instead of recomputing or passing twenty arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from ._fields import FIELD_KV_OFFSET, FIELD_MAMBA_SLOT, FIELD_QUERY
from .batch_dimensions import InferenceBatchDimensions
from .cuda_graphs import CUDAGraphLadder, select_step_dimensions

TOKEN_ROUNDER = 64
REQUEST_ROUNDER = 4


def rounded(value: int, rounder: int, tp_size: Optional[int]) -> int:
    """``value`` rounded up to a multiple of ``rounder`` that ``tp_size`` also divides."""
    tp = 1 if tp_size is None else int(tp_size)
    step = math.ceil(rounder / tp) * tp
    return step * math.ceil(value / step)


@dataclass(frozen=True)
class MambaStep:
    """The Mamba side of a step (docs/SEMANTICS.md §7): decode rows, regular prefills, then the
    continuation chunk, which runs separately from its saved state."""

    decode: int
    regular: int
    chunked: bool
    padded_decode: int
    padded_prefill: int
    regular_tokens: int
    chunked_tokens: int
    zero_count: int


class Step(NamedTuple):
    """Counts and dimensions of one forward pass (rows ``[paused, total)`` are active).

    Immutable, as a frozen dataclass, but a tuple: built once per step, in a fraction of the
    time a frozen dataclass takes (one ``object.__setattr__`` per field)."""

    paused: int
    total: int
    active_tokens: int
    prefill: int
    decode: int
    batch_dimensions: InferenceBatchDimensions
    padded: InferenceBatchDimensions
    using_cuda_graph: bool     # ``padded`` is one of the context's CUDA graphs
    max_seqlen_q: int
    max_seqlen_k: int
    mamba: Optional[MambaStep]
    fed_decode: int = 0        # dummy decode rows fed from the prompt buffer (after the decodes)
    one_token_rows: bool = False  # every active row holds one token (a decode step)

    @property
    def active(self) -> int:
        return self.total - self.paused

    @property
    def padded_tokens(self) -> int:
        return self.padded.token_count

    @property
    def padded_requests(self) -> int:
        return self.padded.req_count

    @property
    def fed_from_pending(self) -> int:
        """Decode rows that take their pending token (the rest read the prompt buffer)."""
        return self.decode - self.fed_decode

    @property
    def prompt_tokens(self) -> int:
        return self.active_tokens - self.fed_from_pending


class StepBuilder:
    """Builds each step's ``Step`` (``build``) with the constants of one context made once: the
    row numbers ``0..max_requests`` (a decode step's ``cu_query_lengths``) and the dimension
    choice of each step shape seen (a plain-tuple memo in front of
    ``cuda_graphs.select_step_dimensions``, which the same counts always give the same answer).
    """

    _MAX_REMEMBERED = 4096

    def __init__(self, max_request_rows: int, ladder: CUDAGraphLadder):
        self.ladder = ladder
        self.row_numbers = np.arange(max_request_rows + 1, dtype=np.int32)
        # The bytes of int32 ones (a decode step's query lengths) and of the row numbers (their
        # sums), compared in one memcmp each.
        self.one_bytes = np.ones(max_request_rows, dtype=np.int32).tobytes()
        self.row_number_bytes = self.row_numbers.tobytes()
        self._choices: dict = {}

    def choose(self, active: int, prefill: int, decode: int, chunked: bool, *, strict: bool,
               max_requests: int, max_tokens: int, tp: int, token_rounder: int,
               request_rounder: int):
        """``select_step_dimensions`` of the step's counts, remembered."""
        key = (active, prefill, decode, chunked, strict, max_requests, max_tokens, tp,
               token_rounder, request_rounder)
        choice = self._choices.get(key)
        if choice is None:
            real = InferenceBatchDimensions(active, prefill, decode, chunked)
            choice = select_step_dimensions(
                real, self.ladder, strict=strict, max_requests=max_requests,
                max_tokens=max_tokens, tp_size=tp, token_rounder=token_rounder,
                request_rounder=request_rounder)
            if len(self._choices) >= self._MAX_REMEMBERED:
                self._choices.clear()
            self._choices[key] = choice
        return choice

    def build(self, table, arena: dict, *, max_tokens: int, max_requests: int, tp: int,
              seq_idx: Optional[np.ndarray], zero_count: int,
              token_rounder: int = TOKEN_ROUNDER, request_rounder: int = REQUEST_ROUNDER,
              max_kv_offset: Optional[int] = None) -> Step:
        """Describe the step of ``table``'s active rows and write its host metadata into
        ``arena`` (the arena's host sections) and ``seq_idx`` (hybrids). The padded dimensions
        are the CUDA graph of the ladder that fits the step (strict matching on hybrids), else
        the eager padding capped at ``max_tokens`` (``cuda_graphs.select_step_dimensions``).
        ``max_kv_offset``: given by a decode update that just committed (every active row holds
        one token, nothing is paused or added): the largest KV offset of the active rows, which
        the step's ``max_seqlen_k`` is one more than."""
        P, T = table.paused, table.total
        A = T - P
        active, prefill = table.active_tokens, table.num_prefill
        decode = A - prefill
        # A continuation chunk of a hybrid starts from its saved Mamba state (docs/SEMANTICS.md
        # §0.3); the context knows it added one, whatever the engine's explicit flag says.
        chunked = table.hybrid and table.continuation_added
        choice = self._choices.get((active, prefill, decode, chunked, table.hybrid, max_requests,
                                    max_tokens, tp, token_rounder, request_rounder))
        if choice is None:
            choice = self.choose(active, prefill, decode, chunked, strict=table.hybrid,
                                 max_requests=max_requests, max_tokens=max_tokens, tp=tp,
                                 token_rounder=token_rounder, request_rounder=request_rounder)
        padded = choice.padded_batch_dimensions
        padded_requests = padded.req_count

        # Attention metadata, on the host: padded rows get q = kv = 0, cu values carry over.
        max_seqlen_k = None
        rows = table.rows
        q = rows[FIELD_QUERY, P:T]
        query_lengths, kv_lengths = arena["attn_query_lengths"], arena["attn_kv_lengths"]
        cu_q, cu_kv = arena["attn_cu_query"], arena["attn_cu_kv"]
        if max_kv_offset is not None or (prefill == 0 and active == A
                                         and q.tobytes() == self.one_bytes[:4 * A]):
            # A decode step (every row one token, the common case): the query lengths are
            # ones and their sums the row numbers, most often already there from the step
            # before (compared as bytes, rewritten only where they differ).
            if query_lengths[:A].tobytes() != self.one_bytes[:4 * A]:
                query_lengths[:A] = 1
            if cu_q[:A + 1].tobytes() != self.row_number_bytes[:4 * (A + 1)]:
                cu_q[:A + 1] = self.row_numbers[:A + 1]
            kv = np.add(rows[FIELD_KV_OFFSET, P:T], 1, out=kv_lengths[:A])
            max_seqlen_q = 1
            if max_kv_offset is not None and A:
                max_seqlen_k = max_kv_offset + 1
        else:
            query_lengths[:A] = q
            kv = np.add(rows[FIELD_KV_OFFSET, P:T], q, out=kv_lengths[:A])
            cu_q[0] = 0
            np.add.accumulate(q, out=cu_q[1:A + 1])
            if active != cu_q[A]:
                raise RuntimeError(f"internal: active_token_count={active} but the query "
                                   f"lengths sum to {cu_q[A]}")
            max_seqlen_q = int(np.maximum.reduce(q)) if A else 1
        cu_kv[0] = 0
        np.add.accumulate(kv, out=cu_kv[1:A + 1])
        if padded_requests > A:
            query_lengths[A:padded_requests] = 0
            kv_lengths[A:padded_requests] = 0
            cu_q[A + 1:padded_requests + 1] = cu_q[A]
            cu_kv[A + 1:padded_requests + 1] = cu_kv[A]
        mamba = None
        if table.hybrid:
            mamba = _mamba_host(table, arena, seq_idx, P, A, decode, prefill, chunked, padded,
                                cu_q, zero_count)
        return Step(paused=P, total=T, active_tokens=active, prefill=prefill, decode=decode,
                    batch_dimensions=choice.batch_dimensions, padded=padded,
                    using_cuda_graph=choice.using_cuda_graph_this_step,
                    max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=(max_seqlen_k if max_seqlen_k is not None
                                  else int(np.maximum.reduce(kv)) if A else 1),
                    mamba=mamba, fed_decode=table.fed_decode, one_token_rows=max_seqlen_q == 1
                    and prefill == 0 and active == A)


def _mamba_host(table, arena: dict, seq_idx: np.ndarray, P: int, A: int, decode: int,
                prefill: int, chunked: bool, padded: InferenceBatchDimensions, cu_q: np.ndarray,
                zero_count: int) -> MambaStep:
    """Mamba slot indices and varlen offsets of the step, on the host (docs/SEMANTICS.md §7)."""
    slots = table.rows[FIELD_MAMBA_SLOT, P:P + A]
    regular = prefill - 1 if chunked else prefill
    padded_decode, padded_prefill = padded.decode_req_count, padded.prefill_req_count
    arena["mamba_decode_slots"][:decode] = slots[:decode]
    arena["mamba_decode_slots"][decode:padded_decode] = -1
    arena["mamba_prefill_slots"][:regular] = slots[decode:decode + regular]
    arena["mamba_prefill_slots"][regular:padded_prefill] = -1
    arena["mamba_chunked_slot"][0] = slots[decode + regular] if chunked else -1
    cu = arena["mamba_cu_seqlens"]
    cu[:regular + 1] = cu_q[decode:decode + regular + 1] - cu_q[decode]
    cu[regular + 1:padded_prefill + 1] = cu[regular]
    # seq_idx: which regular prefill each prefill token belongs to; -1 elsewhere.
    regular_tokens = int(cu[regular])
    lengths = np.diff(cu[:regular + 1])
    seq_idx[:regular_tokens] = np.repeat(np.arange(regular, dtype=np.int32), lengths)
    seq_idx[regular_tokens:padded.token_count] = -1
    return MambaStep(decode=decode, regular=regular, chunked=chunked,
                     padded_decode=padded_decode, padded_prefill=padded_prefill,
                     regular_tokens=regular_tokens,
                     chunked_tokens=int(cu_q[A] - cu_q[decode + regular]) if chunked else 0,
                     zero_count=zero_count)
