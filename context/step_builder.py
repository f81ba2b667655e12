"""The step builder: one step's description, built once for ``initialize_attention_state``.

``StepBuilder.build`` reads the request table, decides the real and padded dimensions, writes the
attention (and Mamba) host metadata into the arena's host sections, and returns a frozen
``Step`` that every later call of the step (the kernels' launch, rope, KV append, logits) reads
instead of recomputing or passing twenty arguments.

The builder also keeps the step ``update_requests`` prepares for the next
``initialize_attention_state`` (``prepare``, ``take``) with the signature of what it read (the
counts, the limits, and the active rows' query lengths, output lengths, KV offsets and block
counts as one bytes object): the step takes it while the signature holds and builds anew
otherwise. ``decode_facts`` says what the current step knows of a decode update.

``limits`` below is ``(max_requests, max_tokens, tensor-parallel size, token rounder, request
rounder)``: what a build reads from the context besides the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from ._fields import FIELD_BLOCKS, FIELD_KV_OFFSET, FIELD_MAMBA_SLOT, FIELD_QUERY
from .batch_dimensions import InferenceBatchDimensions
from .graph_ladder import CUDAGraphLadder, select_step_dimensions

TOKEN_ROUNDER = 64
REQUEST_ROUNDER = 4


def rounded(value: int, rounder: int, tp_size: Optional[int]) -> int:
    """``value`` rounded up to a multiple of ``rounder`` that ``tp_size`` also divides."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 <= value < math.inf:
        raise ValueError(f"value={value!r} must be a finite number >= 0")
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(
            tp_size, (int, np.integer)) or tp_size < 1):
        raise ValueError(f"tp_size={tp_size!r} must be None or an int >= 1")
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
    # Speculative steps: the first ``drafted`` decode rows forward their pending token and
    # drafts, which the device writes into the prompt buffer (then every decode row is fed);
    # ``decode_tokens`` the decode rows' tokens (``1 + k`` each, or their own counts: then
    # ``ragged``, the rows' tokens are scattered to their offsets).
    drafted: int = 0
    decode_tokens: int = 0
    ragged: bool = False

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
    ``graph_ladder.select_step_dimensions``, which the same counts always give the same
    answer); and keeps the step prepared for the next ``initialize_attention_state``.
    """

    _MAX_REMEMBERED = 4096

    def __init__(self, max_request_rows: int, ladder: CUDAGraphLadder,
                 tokens_per_decode: int = 1):
        self.ladder = ladder
        # ``1 + num_speculative_tokens``: a decode row's tokens (graph_ladder's padding).
        self.tokens_per_decode = tokens_per_decode
        self.row_numbers = np.arange(max_request_rows + 1, dtype=np.int32)
        # The bytes of int32 ones (a decode step's query lengths) and of the row numbers (their
        # sums), compared in one memcmp each.
        self.one_bytes = np.ones(max_request_rows, dtype=np.int32).tobytes()
        self.row_number_bytes = self.row_numbers.tobytes()
        self._choices: dict = {}
        # (signature, Step, block count sum or None) prepared by update_requests for the next
        # step, and the signature and block count sum of the current step when they are known.
        self.prepared: Optional[tuple] = None
        self.signature: Optional[tuple] = None
        self.blocks: Optional[int] = None

    # ------------------------------------------------------------------ prepared steps
    @staticmethod
    def signature_of(table, limits: tuple) -> tuple:
        """Everything ``build`` reads on a model without Mamba layers: the counts, the limits,
        and the active rows' fields ``FIELD_QUERY`` to ``FIELD_BLOCKS`` (query lengths, output
        lengths, KV offsets, block counts) as one bytes object; the block counts are there for
        the decode update, which takes their sum from the update that prepared the step."""
        paused, total = table.paused, table.total
        return (paused, total, table.active_tokens, table.num_prefill, table.fed_decode,
                table.continuation_added, limits,
                table.rows[FIELD_QUERY:FIELD_BLOCKS + 1, paused:total].tobytes())

    @staticmethod
    def rows_unchanged(table, signature: tuple) -> bool:
        """Whether the active rows and their fields ``FIELD_QUERY`` to ``FIELD_BLOCKS`` are
        those of ``signature`` (``signature_of``'s first two and last entries)."""
        paused, total = table.paused, table.total
        return (signature[0] == paused and signature[1] == total and signature[-1]
                == table.rows[FIELD_QUERY:FIELD_BLOCKS + 1, paused:total].tobytes())

    def take(self, table, arena: dict, limits: tuple, *, seq_idx: Optional[np.ndarray],
             zero_count: int, device_prompts) -> "Step":
        """The step of ``initialize_attention_state``: the prepared one while its signature
        holds (and nothing is staged that a build consumes), else built now."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None and not zero_count and not device_prompts and \
                prepared[0] == self.signature_of(table, limits):
            self.signature, step, self.blocks = prepared
            return step
        self.signature = self.blocks = None
        return self.build(table, arena, limits, seq_idx=seq_idx, zero_count=zero_count)

    def prepare(self, table, arena: dict, limits: tuple, max_kv_offset: Optional[int] = None,
                active_blocks: Optional[int] = None) -> None:
        """Build the next step at the end of ``update_requests``, while the host's bookkeeping
        is at hand; ``take`` hands it out while its signature still holds (an ``add_request``
        in between changes the counts, a write by hand the rows). Models with Mamba layers
        build at the step (their step also reads the slots and consumes the staged zeroing).
        ``max_kv_offset``, ``active_blocks``: the active rows' largest KV offset and the sum
        of their block counts, when the update knows them."""
        if table.hybrid or not table.active:
            self.prepared = None
            return
        self.prepared = (self.signature_of(table, limits),
                         self.build(table, arena, limits, seq_idx=None, zero_count=0,
                                    max_kv_offset=max_kv_offset), active_blocks)

    def decode_facts(self, step: Optional["Step"], table) -> tuple:
        """``(max_seqlen_k, block count sum)`` of ``step`` (the current one) for a decode update
        while the rows are as it read them: every row holds one token, so the next KV offsets'
        maximum is ``max_seqlen_k``; the sum is known when the update that prepared the step
        knew it. ``(None, None)`` otherwise."""
        signature = self.signature
        if step is not None and step.one_token_rows and signature is not None and \
                self.rows_unchanged(table, signature):
            return step.max_seqlen_k, self.blocks
        return None, None

    # ------------------------------------------------------------------ building

    def choose(self, active: int, prefill: int, decode: int, chunked: bool, *, strict: bool,
               max_requests: int, max_tokens: int, tp: int, token_rounder: int,
               request_rounder: int, tokens_per_decode: Optional[int] = None,
               graphs: bool = True):
        """``select_step_dimensions`` of the step's counts, remembered (``tokens_per_decode``:
        the decode rows' tokens, the builder's by default; ``graphs`` False: eager)."""
        per_decode = self.tokens_per_decode if tokens_per_decode is None else tokens_per_decode
        key = (active, prefill, decode, chunked, strict, max_requests, max_tokens, tp,
               token_rounder, request_rounder, per_decode, graphs)
        choice = self._choices.get(key)
        if choice is None:
            real = InferenceBatchDimensions(active, prefill, decode, chunked)
            choice = select_step_dimensions(
                real, self.ladder if graphs else (), strict=strict, max_requests=max_requests,
                max_tokens=max_tokens, tp_size=tp, token_rounder=token_rounder,
                request_rounder=request_rounder, tokens_per_decode=per_decode)
            if len(self._choices) >= self._MAX_REMEMBERED:
                self._choices.clear()
            self._choices[key] = choice
        return choice

    def build(self, table, arena: dict, limits: tuple, *, seq_idx: Optional[np.ndarray],
              zero_count: int, max_kv_offset: Optional[int] = None) -> "Step":
        """Describe the step of ``table``'s active rows and write its host metadata into
        ``arena`` (the arena's host sections) and ``seq_idx`` (hybrids). The padded dimensions
        are the CUDA graph of the ladder that fits the step (strict matching on hybrids), else
        the eager padding capped at ``max_tokens`` (``graph_ladder.select_step_dimensions``).
        ``max_kv_offset``: given by a decode update that just committed (every active row holds
        one token, nothing is paused or added): the largest KV offset of the active rows, which
        the step's ``max_seqlen_k`` is one more than."""
        max_requests, max_tokens, tp, token_rounder, request_rounder = limits
        paused, total = table.paused, table.total
        requests = total - paused
        tokens, prefill = table.active_tokens, table.num_prefill
        decode = requests - prefill
        # A continuation chunk of a hybrid starts from its saved Mamba state (docs/SEMANTICS.md
        # §0.3); the context knows it added one, whatever the engine's explicit flag says.
        chunked = table.hybrid and table.continuation_added
        rows = table.rows
        per_decode, graphs, decode_tokens = self.tokens_per_decode, True, decode
        strict = table.hybrid
        if per_decode > 1 and decode:
            # Speculative: 1 + k tokens a decode row (0.19), or each row's own count
            # (update_requests' draft_counts): a plain decode step (padded as one) when no row
            # has drafts, a ragged one (padded as 1 + k a row) otherwise; a model without
            # Mamba layers replays the speculative graphs for both, a hybrid runs them eager.
            decode_queries = rows[FIELD_QUERY, paused:paused + decode]
            decode_tokens = int(decode_queries.sum())
            if decode_tokens != decode * per_decode:
                graphs = not table.hybrid
                per_decode = 1 if decode_tokens == decode else per_decode
            # A drafted decode row needs its 1 + d logit rows: a graph's prefill slot, which
            # gives one row per request, may not take it (strict matching).
            strict = strict or decode_tokens > decode
        choice = self._choices.get((tokens, prefill, decode, chunked, strict, max_requests,
                                    max_tokens, tp, token_rounder, request_rounder, per_decode,
                                    graphs))
        if choice is None:
            choice = self.choose(tokens, prefill, decode, chunked, strict=strict,
                                 max_requests=max_requests, max_tokens=max_tokens, tp=tp,
                                 token_rounder=token_rounder, request_rounder=request_rounder,
                                 tokens_per_decode=per_decode, graphs=graphs)
        padded = choice.padded_batch_dimensions
        padded_requests = padded.req_count

        # Attention metadata, on the host: padded rows get q = kv = 0, cu values carry over.
        max_seqlen_k = None
        queries = rows[FIELD_QUERY, paused:total]
        query_lengths, kv_lengths = arena["attn_query_lengths"], arena["attn_kv_lengths"]
        cu_q, cu_kv = arena["attn_cu_query"], arena["attn_cu_kv"]
        ones = self.one_bytes[:4 * requests]
        if max_kv_offset is not None or (prefill == 0 and tokens == requests
                                         and queries.tobytes() == ones):
            # A decode step (every row one token, the common case): the query lengths are
            # ones and their sums the row numbers, most often already there from the step
            # before (compared as bytes, rewritten only where they differ).
            if query_lengths[:requests].tobytes() != ones:
                query_lengths[:requests] = 1
            if cu_q[:requests + 1].tobytes() != self.row_number_bytes[:4 * (requests + 1)]:
                cu_q[:requests + 1] = self.row_numbers[:requests + 1]
            kv = np.add(rows[FIELD_KV_OFFSET, paused:total], 1, out=kv_lengths[:requests])
            max_seqlen_q = 1
            if max_kv_offset is not None and requests:
                max_seqlen_k = max_kv_offset + 1
        else:
            query_lengths[:requests] = queries
            kv = np.add(rows[FIELD_KV_OFFSET, paused:total], queries, out=kv_lengths[:requests])
            cu_q[0] = 0
            np.add.accumulate(queries, out=cu_q[1:requests + 1])
            if tokens != cu_q[requests]:
                raise RuntimeError(f"internal: active_token_count={tokens} but the query "
                                   f"lengths sum to {cu_q[requests]}")
            max_seqlen_q = int(np.maximum.reduce(queries)) if requests else 1
        cu_kv[0] = 0
        np.add.accumulate(kv, out=cu_kv[1:requests + 1])
        if padded_requests > requests:
            query_lengths[requests:padded_requests] = 0
            kv_lengths[requests:padded_requests] = 0
            cu_q[requests + 1:padded_requests + 1] = cu_q[requests]
            cu_kv[requests + 1:padded_requests + 1] = cu_kv[requests]
        mamba = None
        if table.hybrid:
            mamba = _mamba_host(table, arena, seq_idx, paused, requests, decode, prefill, chunked,
                                padded, cu_q, zero_count)
        fed_decode, drafted = table.fed_decode, 0
        if self.tokens_per_decode > 1:
            # Speculative: the device writes the drafted rows' tokens into the prompt buffer
            # (DeviceState.begin_step), so that the kernel feeds every decode row from it (the
            # prompts are staged after them), a plain step's one token a row too.
            fed_decode, drafted = decode, decode - table.fed_decode
        return Step(paused=paused, total=total, active_tokens=tokens, prefill=prefill,
                    decode=decode, batch_dimensions=choice.batch_dimensions, padded=padded,
                    using_cuda_graph=choice.using_cuda_graph_this_step,
                    max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=(max_seqlen_k if max_seqlen_k is not None
                                  else int(np.maximum.reduce(kv)) if requests else 1),
                    mamba=mamba, fed_decode=fed_decode, one_token_rows=max_seqlen_q == 1
                    and prefill == 0 and tokens == requests, drafted=drafted,
                    decode_tokens=decode_tokens,
                    ragged=decode_tokens not in (decode, decode * self.tokens_per_decode))


def _mamba_host(table, arena: dict, seq_idx: np.ndarray, paused: int, requests: int,
                decode: int, prefill: int, chunked: bool, padded: InferenceBatchDimensions,
                cu_q: np.ndarray, zero_count: int) -> MambaStep:
    """Mamba slot indices and varlen offsets of the step, on the host (docs/SEMANTICS.md §7)."""
    slots = table.rows[FIELD_MAMBA_SLOT, paused:paused + requests]
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
                     chunked_tokens=int(cu_q[requests] - cu_q[decode + regular]) if chunked else 0,
                     zero_count=zero_count)
