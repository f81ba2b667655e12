"""A rewind of any number of a request's last tokens, across the steps that cached them
(docs/SEMANTICS.md §19, "Token rewind").

``rewind_kv_cache`` drops the rejected drafts of the step in flight; ``rewind_tokens`` drops a
row's last ``n`` tokens whatever step cached them: the step in flight's own tokens first, then
those of earlier steps, across as many blocks as they fill. A draft model kept in step with the
target's requests (``engine/draft_model.py``) needs it: its context forwards ``k`` drafts over
``k`` steps of its own, and once the target has verified them the rejected ones go, several
steps back. The same place in the step as ``rewind_kv_cache`` (between the forward pass and
``update_requests``, whose advance by the query then follows), the same arithmetic (offsets
lowered, a block that then holds nothing released, in row order), and the same rules: every
check first, the host authoritative (the device takes the rows at the update's arena copy and
the block-table rows the host rewrote, as after ``rewind_kv_cache``: no launch of its own), a
published or shared prefix-cache block never released nor rewritten. It works with any
``num_speculative_tokens``, 0 included.
"""

from __future__ import annotations

import numpy as np
import torch

from . import speculative as spec
from ._fields import FIELD_BLOCKS, FIELD_IDS, FIELD_KV_OFFSET, FIELD_QUERY
from .errors import StepShapeError
from .inputs import host_integers


def host_counts(rewind_counts, active: int) -> np.ndarray:
    """``rewind_counts`` as host int64 ``[active]`` (a tensor, read once when on a device; a
    numpy array; a list)."""
    counts = host_integers(rewind_counts, "rewind_counts")
    if counts.shape != (active,):
        raise StepShapeError(f"rewind_counts has shape {tuple(counts.shape)}, expected "
                             f"[active requests={active}]")
    return counts.astype(np.int64)


def plan_token_rewind(table, rows: np.ndarray, counts: np.ndarray) -> spec.RewindPlan:
    """The rewind of ``table``'s active ``rows`` (ascending) by ``counts`` tokens each (every
    count >= 1, at most the row's tokens less one, checked by the caller): each row keeps its
    first ``kv offset + query - count`` tokens; the blocks past them are released, row by row
    in column order. Refuses (``ValueError``, nothing changed) a row whose rewind reaches a
    block the prefix cache published or that another row shares: that block would be
    rewritten or released. Changes nothing."""
    fields, bs = table.rows, table.block_size
    kept = fields[FIELD_KV_OFFSET, rows].astype(np.int64) + fields[FIELD_QUERY, rows] - counts
    held = fields[FIELD_BLOCKS, rows].astype(np.int64)
    blocks = (kept - 1) // bs + 1
    if (blocks > held).any():
        row = int(rows[np.flatnonzero(blocks > held)[0]])
        raise RuntimeError(f"row {row} holds fewer blocks than its tokens need (written by "
                           "hand?); nothing was changed")
    # Every block from the one the next token writes into (index kept // bs) on.
    first = kept // bs
    width = int((held - first).max())
    columns = first[:, None] + np.arange(width)[None, :]
    touched = columns < held[:, None]
    ids = table.block_table[rows[:, None], np.where(touched, columns, 0)]
    allocator = table.allocator
    blocks_touched = ids[touched]
    shared = (allocator.cached[blocks_touched] | (allocator.ref_counts[blocks_touched] > 1))
    if shared.any():
        where = np.flatnonzero(touched.any(axis=1))
        owner = np.repeat(rows[where], touched[where].sum(axis=1))[np.flatnonzero(shared)[0]]
        raise ValueError(f"rewind_tokens: request {int(fields[FIELD_IDS, owner])} would rewind "
                         f"into block {int(blocks_touched[shared][0])}, which the prefix cache "
                         "published or another request shares (a shared block is never "
                         "rewritten nor released); nothing was changed")
    dropped_mask = columns >= blocks[:, None]
    dropped_mask &= touched
    dropped = np.repeat(rows, dropped_mask.sum(axis=1))
    released = ids[dropped_mask].astype(np.int64)
    if ((released < 0) | (released == allocator.dummy_block_idx)).any():
        raise RuntimeError(f"rows {sorted(set(dropped.tolist()))} would release blocks "
                           f"{released.tolist()}, which they do not own (written by hand?); "
                           "nothing was changed")
    last_blocks = table.block_table[rows, blocks - 1].astype(np.int64)
    kv = fields[FIELD_KV_OFFSET, rows].astype(np.int64) - counts
    return spec.RewindPlan(rows, kv, (kept - 1) % bs, blocks, last_blocks, dropped, released,
                           columns[dropped_mask])


def rewind_tokens(forward, rewind_counts) -> torch.Tensor:
    """``rewind_tokens``: each active row ``i`` drops its last ``rewind_counts[i]`` tokens
    (integers ``[active]``; in ``[0, kv offset + query - 1]``: the step's tokens and earlier
    ones, at least one token kept; 0 for the chunked prefill in flight), between the forward
    pass and ``update_requests``. Returns the blocks released (int64 CPU). Every check runs
    first (``StepShapeError``, ``TypeError``, ``ValueError``; ``RuntimeError`` outside a
    step). Refused on a hybrid (its Mamba states hold no earlier steps), with KV groups (a
    window's blocks go once it passes them) and with deferred rewinds (the host's offsets are
    ahead of the device's)."""
    forward.require("rewind_tokens")
    table, device = forward.table, forward.device
    if forward.mamba is not None:
        raise ValueError("rewind_tokens() on a hybrid: its Mamba states cannot go back to an "
                         "earlier step's token (rewind_kv_cache() restores the step's own)")
    if forward.kv_groups is not None:
        raise ValueError("rewind_tokens() with KV groups: a window's blocks are released once "
                         "it passes them, so earlier tokens cannot come back")
    if device.deferred_rewind:
        raise ValueError("rewind_tokens() after defer_kv_rewind(): the host's offsets are ahead "
                         "of the device's until settled")
    counts = host_counts(rewind_counts, table.active)
    paused = table.paused
    tokens = (table.rows[FIELD_KV_OFFSET, paused:table.total].astype(np.int64)
              + table.rows[FIELD_QUERY, paused:table.total])
    bad = np.flatnonzero((counts < 0) | (counts >= tokens))
    if bad.size:
        row = int(bad[0])
        raise ValueError(f"rewind_counts[{row}]={int(counts[row])} must lie in [0, "
                         f"{int(tokens[row]) - 1}] (request "
                         f"{int(table.rows[FIELD_IDS, paused + row])} holds {int(tokens[row])} "
                         "tokens, at least one stays)")
    if table.chunked_id != -1:
        chunked = np.flatnonzero(table.rows[FIELD_IDS, paused:table.total] == table.chunked_id)
        if chunked.size and counts[chunked[0]]:
            raise ValueError(f"rewind_counts[{int(chunked[0])}]={int(counts[chunked[0]])}: "
                             f"request {table.chunked_id} is the chunked prefill in flight (its "
                             "next chunk continues where this one ends); it must be 0")
    moved = np.flatnonzero(counts)
    if not moved.size:
        return torch.empty(0, dtype=torch.int64)
    plan = plan_token_rewind(table, paused + moved, counts[moved])
    table.commit_rewind(plan)
    if plan.dropped.size:
        device.host_table_written = True
    device.arena.dirty = True
    forward.steps.prepared = None
    return torch.from_numpy(plan.released)
