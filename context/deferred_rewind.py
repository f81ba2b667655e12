"""A rewind of rejected drafts applied on the device first and on the host one step later: what
async scheduling needs, whose host does not read a step's accepted counts before the next step
is laid out (docs/SEMANTICS.md §19, "Deferred rewind").

Between step ``n``'s forward pass and its update, ``defer`` records each decode row's rejected
drafts on the device, from the device's accepted counts (nothing is read back); the host keeps
the step's tokens as if every draft were accepted, so step ``n + 1`` is laid out one lag ahead.
The lags move with the rows (``DraftRows``), and when a row's next step begins the device
lowers its KV offset and lengths by its lag and restores a hybrid's Mamba state
(``DraftRows.apply_lags``, one ``speculative_rewind`` launch), so positions, slots and
attention lengths are the true ones. Once the host has read the counts, ``settle`` applies the
same rewind to the host rows of requests whose lag the device applied in the step in flight
(0.19's ``rewind_kv_cache`` arithmetic: offsets lowered, a block that now holds nothing
released). The blocks a row holds cover its optimistic tokens, which are never fewer than its
true ones, so every token of a step lies in a block the row holds.
"""

from __future__ import annotations

import numpy as np
import torch

from . import speculative as spec
from ._fields import FIELD_IDS, FIELD_QUERY
from .errors import StepShapeError
from .inputs import host_integers


def defer(forward, accepted_counts: torch.Tensor) -> None:
    """``defer_kv_rewind``: ``accepted_counts`` (integer ``[active]`` on the context's device;
    a decode row's accepted drafts, prefill rows ignored) become the rows' lags on the device;
    the host is not changed. Once per step, between the forward pass and ``update_requests``
    (``rewind_kv_cache`` or this)."""
    forward.require("defer_kv_rewind")
    table, device = forward.table, forward.device
    if not forward.speculative:
        raise RuntimeError("defer_kv_rewind() needs num_speculative_tokens > 0")
    if forward.rewound:
        raise RuntimeError("defer_kv_rewind() after a rewind in this step")
    check_supported(forward, "defer_kv_rewind()")
    if not isinstance(accepted_counts, torch.Tensor):
        raise TypeError(f"accepted_counts must be a torch.Tensor, got {type(accepted_counts)}")
    if accepted_counts.dtype.is_floating_point or accepted_counts.dtype.is_complex or \
            accepted_counts.dtype == torch.bool:
        raise TypeError(f"accepted_counts must be an integer tensor, got {accepted_counts.dtype}")
    if tuple(accepted_counts.shape) != (table.active,):
        raise StepShapeError(f"accepted_counts has shape {tuple(accepted_counts.shape)}, "
                             f"expected [active requests={table.active}]")
    if accepted_counts.device != forward.where:
        raise ValueError(f"accepted_counts is on {accepted_counts.device}, the context on "
                         f"{forward.where}")
    step = forward.step
    if forward.validate:   # one read of the counts (the rejected drafts become device lags)
        drafts = table.rows[FIELD_QUERY, table.paused:table.paused + step.drafted] - 1
        spec.check_accepted_counts(accepted_counts, drafts.astype(np.int64), table.active,
                                   forward.speculative)
    if forward.mamba is not None and step.ragged:
        queries = table.rows[FIELD_QUERY, table.paused:table.paused + step.drafted]
        if ((queries > 1) & (queries < 1 + forward.speculative)).any():
            raise ValueError("defer_kv_rewind() on a hybrid needs each decode row to forward "
                             f"all k={forward.speculative} drafts or none (its Mamba state is "
                             "restored counting its accepted drafts from k); use "
                             "rewind_kv_cache()")
    device.defer_rewinds()
    device.spec.record_lags(accepted_counts, forward.attention.query_lengths, step.drafted,
                            table.active)
    forward.rewound = True


def check_supported(forward, what: str) -> None:
    """Deferred rewinds are refused with KV groups and KV offload, which read the host's KV
    offsets as the true ones (``ValueError`` naming the option and the ways out)."""
    options = [name for name, on in (
        ("KV groups (kv_layer_windows with kv_groups=True)", forward.kv_groups is not None),
        ("KV offload (kv_offload_gb > 0 or kv_cache_management_mode='offload')",
         forward.table.offload is not None)) if on]
    if options:
        raise ValueError(f"{what}: deferred rewinds are not supported with "
                         f"{' and '.join(options)}, which read the host's KV offsets as the "
                         "true ones: use rewind_kv_cache() (the engine: async_scheduling=False), "
                         "or a context without them (kv_groups=False, kv_offload_gb=0)")


def settle(forward, request_ids, rejected_counts) -> torch.Tensor:
    """``settle_kv_rewind``: the host applies the rewind the device applied at this step's
    start (``rejected_counts[i]`` drafts of request ``request_ids[i]``, each a decode row of
    the step in flight, in ``[0, k]``); returns the blocks released (int64 CPU). Every check
    runs first."""
    forward.require("settle_kv_rewind")
    table, k = forward.table, forward.speculative
    if not forward.device.deferred_rewind:
        raise RuntimeError("settle_kv_rewind() before any defer_kv_rewind()")
    ids = host_integers(request_ids, "request_ids").astype(np.int64).reshape(-1)
    counts = host_integers(rejected_counts, "rejected_counts").astype(np.int64).reshape(-1)
    if counts.shape != ids.shape:
        raise StepShapeError(f"rejected_counts has {counts.size} entries, request_ids "
                             f"{ids.size}")
    spec.check_draft_range("rejected_counts", counts, k)
    unique, seen = np.unique(ids, return_counts=True)
    again = sorted(set(unique[seen > 1].tolist()) | (set(ids.tolist()) & forward.settled))
    if again:
        raise ValueError(f"request_ids: request {again[0]} is settled twice in this step (a "
                         "row's rewind is settled once; a second would rewind it again)")
    drafted = table.paused + np.arange(forward.step.drafted)
    row_ids = table.rows[FIELD_IDS, drafted].astype(np.int64)
    order = np.argsort(row_ids, kind="stable")
    at = np.searchsorted(row_ids[order], ids)
    found = at < row_ids.size
    found[found] = row_ids[order][at[found]] == ids[found]
    if not found.all():
        raise ValueError(f"request {int(ids[~found][0])} is not a decode row of the step in "
                         "flight (settle a request's rewind once its next step runs)")
    rows = drafted[order][at]
    sort = np.argsort(rows)
    plan = spec.plan_rewind(table, rows[sort], counts[sort])
    table.commit_rewind(plan)
    forward.settled.update(ids.tolist())
    if plan.dropped.size:
        forward.device.host_table_written = True
    forward.device.arena.dirty = True
    forward.steps.prepared = None
    return torch.from_numpy(plan.released)
