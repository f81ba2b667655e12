"""Speculative steps (Megatron-Core 0.19's ``num_speculative_tokens``), docs/SEMANTICS.md §19.

With ``num_speculative_tokens = k > 0`` a decode request forwards ``1 + k`` tokens a step: its
pending token and ``k`` draft tokens, at consecutive positions. The request takes its next
block early (when the last kept token's offset reaches ``block_size - 1 - k``), so the step's
``1 + k`` tokens always fit in the blocks it holds; after the forward pass the engine verifies
the drafts and ``rewind_kv_cache`` lowers the offsets by the rejected ones, releasing a block
that then holds nothing (0.19's ``mtp_utils_pytorch.rewind_kv_cache``). ``update_requests``
then advances every row by its ``1 + k`` query tokens, so a request gains ``1 + accepted``
tokens a step.

This module is the part's pure host work: the argument checks, the rewind plan, and the
logit rows a step's verification needs; ``RequestTable.commit_rewind`` and the device state
apply them. Nothing here touches the device. k = 0 never reaches it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from ._fields import FIELD_BLOCKS, FIELD_KV_OFFSET, FIELD_LAST_OFFSET
from .errors import SpeculativeConfigError, StepShapeError
from .inputs import check_token_ids, host_integers


def check_speculative_tokens(num_speculative_tokens, block_size_tokens: int) -> int:
    """``num_speculative_tokens`` as an int in ``[0, block_size_tokens)`` (0.19's assertion and
    message: a step's ``1 + k`` tokens must fit in two blocks)."""
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"num_speculative_tokens={k!r} must be an int")
    if k < 0:
        raise SpeculativeConfigError(f"num_speculative_tokens ({k}) must be >= 0")
    if k >= block_size_tokens:
        raise SpeculativeConfigError(f"num_speculative_tokens ({k}) must be < "
                                     f"block_size_tokens ({block_size_tokens})")
    return int(k)


def check_draft_tokens(new_speculative_tokens: Optional[torch.Tensor], k: int, active: int,
                       device: torch.device) -> Optional[torch.Tensor]:
    """``update_requests``' ``new_speculative_tokens``: None when ``k == 0``; else an integer
    tensor ``[k, active]`` on the context's device (0.19's layout: draft ``j`` of request
    ``i`` at ``[j, i]``). Raises before anything changes (``check_forwarded_drafts``: their
    ids, with ``validate``)."""
    if k == 0:
        if new_speculative_tokens is not None:
            raise ValueError("new_speculative_tokens was given, but the context has "
                             "num_speculative_tokens=0")
        return None
    if new_speculative_tokens is None:
        raise ValueError(f"new_speculative_tokens [num_speculative_tokens={k}, {active}] is "
                         "required: the next step forwards each decode request's drafts")
    tokens = new_speculative_tokens
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"new_speculative_tokens must be a torch.Tensor, got {type(tokens)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"new_speculative_tokens must be an integer tensor, got {tokens.dtype}")
    if tuple(tokens.shape) != (k, active):
        raise StepShapeError(f"new_speculative_tokens has shape {tuple(tokens.shape)}, expected "
                             f"[num_speculative_tokens={k}, active requests={active}]")
    if tokens.device != device:
        raise ValueError(f"new_speculative_tokens is on {tokens.device}, the context on {device}")
    return tokens


def check_forwarded_drafts(drafts: torch.Tensor, counts: Optional[np.ndarray],
                           vocab_size: Optional[int]) -> None:
    """``validate``: the drafts the next step forwards (row ``i``'s first ``counts[i]``, all
    ``k`` without counts) are token ids in ``[0, vocab_size)``; the rest are never read (one
    read of the tensor)."""
    if counts is not None:
        used = torch.arange(drafts.shape[0])[:, None] < torch.from_numpy(counts)[None, :]
        drafts = drafts[used.to(drafts.device)]
    check_token_ids("new_speculative_tokens", drafts, vocab_size)


def check_draft_counts(draft_counts, k: int, active: int) -> Optional[np.ndarray]:
    """``update_requests``' ``draft_counts``: None (every row forwards ``k`` drafts), or host
    integers ``[active]`` in ``[0, k]``: the drafts each row forwards next (a list, a numpy
    array or a CPU tensor; never read from a device, which would sync)."""
    if draft_counts is None:
        return None
    if k == 0:
        raise ValueError("draft_counts was given, but the context has num_speculative_tokens=0")
    if isinstance(draft_counts, torch.Tensor):
        if draft_counts.device.type != "cpu":
            raise ValueError(f"draft_counts must be on the host (a read from "
                             f"{draft_counts.device} would sync), got {draft_counts.device}")
        draft_counts = draft_counts.numpy()
    counts = np.asarray(draft_counts)
    if counts.dtype.kind not in "iu":
        raise TypeError(f"draft_counts must hold integers, got dtype {counts.dtype}")
    if counts.shape != (active,):
        raise StepShapeError(f"draft_counts has shape {tuple(counts.shape)}, expected "
                             f"[active requests={active}]")
    check_draft_range("draft_counts", counts, k)
    return counts.astype(np.int64)


def check_draft_range(name: str, counts: np.ndarray, k: int) -> None:
    """Each of ``counts`` (host integers) a number of drafts: in ``[0, k]`` (``ValueError``
    naming the first entry outside, as ``name[i]``)."""
    bad = np.flatnonzero((counts < 0) | (counts > k))
    if bad.size:
        raise ValueError(f"{name}[{int(bad[0])}]={int(counts[bad[0]])} must lie in "
                         f"[0, num_speculative_tokens={k}]")


def check_accepted_counts(accepted_counts, drafts: np.ndarray, active: int,
                          k: int) -> np.ndarray:
    """``rewind_kv_cache``'s ``accepted_counts`` as host int64 ``[decode rows]``: for each of
    the decode requests that forwarded drafts (``drafts``, host ints, each row's count: ``k``,
    or its own) the drafts accepted, in ``[0, drafts]``; entries of prefill rows are ignored
    (0.19 ignores them too)."""
    host = host_integers(accepted_counts, "accepted_counts")
    if host.shape != (active,):
        raise StepShapeError(f"accepted_counts has shape {tuple(host.shape)}, expected "
                             f"[active requests={active}]")
    decode = host[:drafts.size].astype(np.int64)
    bad = np.flatnonzero((decode < 0) | (decode > drafts))
    if bad.size:
        row = int(bad[0])
        bound = f"num_speculative_tokens={k}" if drafts[row] == k else \
            f"{int(drafts[row])}, the drafts it forwarded"
        raise ValueError(f"accepted_counts[{row}]={int(decode[row])} must lie in [0, {bound}] "
                         "(a decode request's accepted drafts)")
    return decode


class RewindPlan(NamedTuple):
    """What ``rewind_kv_cache`` changes, decided before anything changes: ``rows`` (absolute
    rows rewound, ascending), their new ``FIELD_KV_OFFSET``, ``FIELD_LAST_OFFSET``,
    ``FIELD_BLOCKS``, ``FIELD_LAST_BLOCK``; ``dropped``: the rows (a subset of ``rows``) whose
    last block now holds nothing, and ``released``: those blocks, in row order. ``columns``:
    each released block's column in its row (``dropped`` then names a row once per block: a
    rewind of several blocks, ``token_rewind``); None: the row's new block count, one block a
    row."""

    rows: np.ndarray
    kv_offsets: np.ndarray
    last_offsets: np.ndarray
    block_counts: np.ndarray
    last_blocks: np.ndarray
    dropped: np.ndarray
    released: np.ndarray
    columns: Optional[np.ndarray] = None


def plan_rewind(table, rows: np.ndarray, rewind: np.ndarray) -> RewindPlan:
    """The rewind of ``table``'s rows ``rows`` (ascending decode rows of the step, which
    forwarded their pending token and drafts), ``rewind`` tokens each (their rejected drafts);
    changes nothing (0.19's ``rewind_kv_cache``, vectorised: offsets lowered, a block that now
    holds nothing dropped)."""
    fields = table.rows
    rewind = rewind.astype(np.int64)
    kv = fields[FIELD_KV_OFFSET, rows].astype(np.int64) - rewind
    diff = fields[FIELD_LAST_OFFSET, rows].astype(np.int64) - rewind
    crossed = diff < 0
    counts = fields[FIELD_BLOCKS, rows].astype(np.int64) - crossed
    if (counts < 1).any():
        row = int(rows[np.flatnonzero(counts < 1)[0]])
        raise RuntimeError(f"row {row} would rewind past its first block (its offsets were "
                           "written by hand?); nothing was changed")
    dropped = rows[crossed]
    released = table.block_table[dropped, counts[crossed]].astype(np.int64)
    if ((released < 0) | (released == table.allocator.dummy_block_idx)).any():
        raise RuntimeError(f"rows {dropped.tolist()} would release blocks {released.tolist()}, "
                           "which they do not own (written by hand?); nothing was changed")
    last_blocks = table.block_table[rows, counts - 1].astype(np.int64)
    return RewindPlan(rows, kv, diff % table.block_size, counts, last_blocks, dropped, released)


def logit_rows(decode: int, prefill: int, k: int, cu_query: np.ndarray, out: np.ndarray,
               active_tokens: int, padded_tokens: int, count: int) -> None:
    """Write ``speculative_required_logit_indices`` into ``out[:count]``: every token of the
    ``decode`` decode rows (``1 + k`` each, first; a dummy decode row, its prompt), then
    each prefill's last token (from the
    step's cumulative query lengths), then, under a CUDA graph's larger ``count``, padding
    token rows (``active_tokens`` on, capped at the last padded token)."""
    drafted = int(cu_query[decode])
    out[:drafted] = np.arange(drafted)
    out[drafted:drafted + prefill] = cu_query[decode + 1:decode + prefill + 1] - 1
    real = drafted + prefill
    if count > real:
        out[real:count] = np.minimum(np.arange(active_tokens, active_tokens + count - real),
                                     max(padded_tokens - 1, 0))


def num_logit_rows(step, k: int) -> int:
    """0.19's ``num_last_token_logits``: ``1 + k`` rows per decode request (its own tokens, with
    draft counts) plus one per prefill, counted on the padded dimensions under a CUDA graph."""
    dims = step.padded if step.using_cuda_graph else step.batch_dimensions
    if k == 0:
        return dims.req_count if step.using_cuda_graph else step.active
    if not step.using_cuda_graph:
        # Each decode row's own tokens (1 + k, or its draft count's: §19).
        return step.decode_tokens + dims.prefill_req_count
    return dims.decode_req_count * (1 + k) + dims.prefill_req_count
