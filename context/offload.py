"""KV offload: evicted (and suspended) requests keep their KV blocks in host memory.

``Offload`` (built with ``kv_offload_gb > 0``, docs/SEMANTICS.md §21) owns the host block pool
(``context/host_pool.py``) and the host copies in it, one ``Offloaded`` entry per request, in
the order they were written (the oldest first):

* ``save_rows`` (an update's evicted rows, before their blocks are released; and every live
  row at an OFFLOAD suspend) copies each row's blocks that hold its ``kv_length_offset``
  tokens, and a hybrid's Mamba state, to the host. When the pool has no room, the oldest
  entries are dropped (those requests recompute, as without offload); a row that needs more
  host blocks than the pool has is not saved.
* ``plan_restore`` (from ``admission.plan_add``, pure) finds the entry of a request added
  again under its id, whose prompt (its prompt and the tokens it generated, as the engine
  re-adds an evicted request) is longer than the tokens saved and whose chunk covers them and
  one token more: those tokens are not computed again, as a prefix cache hit's.
* ``commit_restore`` (after ``RequestTable.commit_add``) copies the saved blocks into the row's
  new blocks (and the Mamba state into its slot: a hybrid's restored row then runs as the
  step's continuation, the last row starting from its slot's state, as a prefix hit does) and
  frees the entry's host slots. Any other add of the id drops its entry.

Nothing here changes the rows: the request table's plans and commits do, and the restore is a
plan's ``finished`` tokens. Statistics: ``stats``.

With prefix caching the pool is shared with the prefix cache's host tier (``tier``,
``context/host_tier.py``; ``prefix_caching_host_tier``): a swap that finds no room drops the
spilled prefix blocks (and snapshots) least recently used first, and only then the oldest
swapped requests; a spill never drops a swapped request.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ._fields import FIELD_IDS, FIELD_KV_OFFSET, FIELD_MAMBA_SLOT, FIELD_QUERY
from .errors import get_mem_size_str
from .host_pool import GIB, HostBlockPool
from .host_tier import HostTier
from .prefix_cache import wants_every_prompt_logit
from .prefix_options import check_host_tier_arg
from .sizing import available_bytes

KV_CACHE_MANAGEMENT_MODES = ("persist", "offload", "recompute")


def check_offload_args(kv_offload_gb: Any, mode: Any, *, host_tier: Any = None,
                       enable_prefix_caching: Any = False) -> tuple:
    """``(kv_offload_gb as a float, mode as a lower-case string, whether the prefix cache has
    a host tier)``; ``ValueError`` or ``TypeError`` naming the argument, the value and what it
    must be."""
    if isinstance(kv_offload_gb, bool) or not isinstance(
            kv_offload_gb, (int, float, np.integer, np.floating)):
        raise TypeError(f"kv_offload_gb={kv_offload_gb!r} must be a number of GiB (0: no "
                        "offload)")
    gb = float(kv_offload_gb)
    if not math.isfinite(gb) or gb < 0:
        raise ValueError(f"kv_offload_gb={kv_offload_gb!r} must be a finite number >= 0 (GiB "
                         "of host memory; 0: no offload)")
    have = available_bytes(torch.device("cpu"))
    if have is not None and gb * GIB > have:
        raise ValueError(f"kv_offload_gb={kv_offload_gb!r} asks for "
                         f"{get_mem_size_str(int(gb * GIB))} of host memory, but the host has "
                         f"{get_mem_size_str(have)} available: lower kv_offload_gb")
    if mode is None:
        mode = "recompute"
    value = getattr(mode, "value", mode)
    if not isinstance(value, str) or value.lower() not in KV_CACHE_MANAGEMENT_MODES:
        raise ValueError(f"kv_cache_management_mode={mode!r} must be one of "
                         f"{list(KV_CACHE_MANAGEMENT_MODES)} (or a KVCacheManagementMode)")
    value = value.lower()
    enable = isinstance(enable_prefix_caching, (bool, np.bool_)) and bool(enable_prefix_caching)
    tier = check_host_tier_arg(host_tier, enable_prefix_caching=enable,
                               kv_offload_gb=gb, mode=value)
    return gb, value, tier


@dataclass
class Offloaded:
    """One request's host copy: its ``tokens`` cached tokens in ``host_blocks`` (in block
    order) and, for a hybrid, its Mamba state in host state slot ``state`` (-1: none). With KV
    groups ``host_blocks`` is group 0's (empty when it holds no layers) and ``windowed`` each
    windowed group's ``(first column, host slots)``: the blocks its window reads from
    ``tokens`` on."""

    request_id: int
    tokens: int
    host_blocks: np.ndarray
    state: int = -1
    windowed: tuple = ()


@dataclass(frozen=True)
class OffloadPart:
    """One KV group's host copies: its ``pool``, its device ``cache`` (a ``KVCache``) and, for
    a windowed group, the ``group`` (``kv_groups.WindowedGroup``; None: group 0, or the cache
    of a context without groups)."""

    pool: HostBlockPool
    cache: Any
    group: Any = None

    def first(self, tokens: int, block_size: int) -> int:
        """The first block a row of ``tokens`` cached tokens keeps here."""
        if self.group is None:
            return 0
        return max(0, tokens - self.group.window + 1) // block_size


@dataclass
class OffloadStats:
    """Counters (they survive ``reset``): requests saved and restored, tokens restored (not
    computed again), entries dropped for room, rows not saved (larger than the pool)."""

    offloaded_requests: int = 0
    offloaded_blocks: int = 0
    restored_requests: int = 0
    restored_tokens: int = 0
    dropped_requests: int = 0
    unsaved_requests: int = 0

    def as_dict(self) -> dict:
        return {f"kv_offload_{name}": getattr(self, name) for name in (
            "offloaded_requests", "offloaded_blocks", "restored_requests", "restored_tokens",
            "dropped_requests", "unsaved_requests")}


@dataclass(frozen=True)
class RestorePlan:
    """What ``commit_restore`` copies back: the entry, and the blocks its tokens span."""

    entry: Offloaded
    blocks: int


class Offload:
    """The host copies of one context's requests.

    Args:
        pool: the ``HostBlockPool``; kv: the ``KVCache`` (its buffer); mamba: a hybrid's
            ``MambaStates`` (else None); block_size: tokens per block; mode: the
            ``kv_cache_management_mode`` ("persist", "offload" or "recompute").
    """

    def __init__(self, pool: HostBlockPool, kv, mamba, block_size: int, mode: str,
                 parts: tuple = ()):
        self.pool, self.kv, self.mamba = pool, kv, mamba
        # KV groups: group 0's part (``pool``, ``kv``) and the windowed groups' (``parts``).
        self.parts = (OffloadPart(pool, kv),) + tuple(parts)
        self.block_size, self.mode = block_size, mode
        self.entries: "OrderedDict[int, Offloaded]" = OrderedDict()
        self.stats = OffloadStats()
        self.held = False   # the host copies outlive the next reset (an OFFLOAD suspend)
        self.tier: Optional[HostTier] = None   # the prefix cache's host tier (``attach``)

    @classmethod
    def build(cls, *, kv_offload_gb: float, mode: str, kv, mamba, block_size: int,
              max_requests: int, device, table=None) -> Optional["Offload"]:
        """The context's offload part, or None for ``kv_offload_gb == 0`` (but in OFFLOAD
        mode, whose default pool holds every device block and Mamba state); ``ValueError``
        when the budget holds no block. ``table``: the request table whose prefix cache gets
        the host tier (None: none)."""
        if not kv_offload_gb and mode != "offload":
            return None
        groups = getattr(kv, "groups", None)
        if groups is not None:
            return cls._build_grouped(kv_offload_gb=kv_offload_gb, mode=mode, kv=kv,
                                      block_size=block_size, device=device)
        block_dim = 1 if kv.mla is not None else 2
        block_shape = tuple(n for i, n in enumerate(kv.shape) if i != block_dim)
        block_bytes = HostBlockPool.block_bytes(block_shape, kv.kv_dtype)
        states, shapes, dtypes, state_bytes = 0, (), (), 0
        if mamba is not None:
            shapes = ((mamba.conv_shape[0], *mamba.conv_shape[2:]),
                      (mamba.ssm_shape[0], *mamba.ssm_shape[2:]))
            dtypes = (mamba.layers.mamba_conv_states_dtype, mamba.layers.mamba_ssm_states_dtype)
            state_bytes = sum(HostBlockPool.block_bytes(s, d) for s, d in zip(shapes, dtypes))
        budget = int(kv_offload_gb * GIB) if kv_offload_gb else \
            (kv.shape[block_dim] - 1) * block_bytes + max_requests * state_bytes
        if mamba is not None:
            # A saved request (or a spilled snapshot) holds a state and at least one block.
            snapshots = 0 if table is None or mamba.snapshots is None else mamba.snapshots.count
            states = min(max_requests + snapshots, budget // (state_bytes + block_bytes))
        blocks = (budget - states * state_bytes) // block_bytes
        if blocks < 1:
            raise ValueError(f"kv_offload_gb={kv_offload_gb} holds no KV block: one block (and "
                             f"a hybrid's Mamba state) takes {block_bytes + state_bytes} bytes")
        pool = HostBlockPool(blocks=blocks, block_shape=block_shape, block_dim=block_dim,
                             dtype=kv.kv_dtype, device=device, states=states,
                             state_shapes=shapes, state_dtypes=dtypes)
        offload = cls(pool, kv, mamba, block_size, mode)
        if table is not None:
            offload.attach(table)
        return offload

    def attach(self, table) -> None:
        """Give ``table``'s prefix cache the host tier: its allocator spills to it, its
        matching and a hybrid's snapshots see it."""
        cache = table.prefix_cache
        self.tier = cache.tier = HostTier(self.pool, self.kv, cache.digests)
        table.allocator.on_spill = self.tier.spill
        if cache.mamba is not None:
            cache.mamba.tier = self.tier

    @classmethod
    def _build_grouped(cls, *, kv_offload_gb: float, mode: str, kv, block_size: int,
                       device) -> "Offload":
        """KV groups (``kv_groups.GroupedKV``, never MLA or a hybrid): one host pool per group,
        the budget split in proportion to the groups' device bytes (OFFLOAD mode without a
        budget: every device block of every group)."""
        caches = kv.caches
        every = sum(cache.nbytes() for cache in caches)
        pools = []
        for cache in caches:
            block_shape = tuple(n for i, n in enumerate(cache.shape) if i != 2)
            block_bytes = HostBlockPool.block_bytes(block_shape, cache.kv_dtype)
            if not block_bytes:
                blocks = 0      # group 0 of a layout whose every layer is windowed
            elif kv_offload_gb:
                blocks = int(kv_offload_gb * GIB) * cache.nbytes() // every // block_bytes
                if blocks < 1:
                    raise ValueError(
                        f"kv_offload_gb={kv_offload_gb} holds no KV block of every KV group: "
                        f"a group's share is in proportion to its device bytes, and one block "
                        f"of a group takes {block_bytes} bytes")
            else:
                blocks = cache.shape[2] - 1
            pools.append(HostBlockPool(blocks=blocks, block_shape=block_shape, block_dim=2,
                                       dtype=cache.kv_dtype, device=device))
        parts = tuple(OffloadPart(pool, group.cache, group)
                      for pool, group in zip(pools[1:], kv.groups))
        return cls(pools[0], kv.main, None, block_size, mode, parts)

    # ------------------------------------------------------------------ lifetime
    def allocate(self) -> None:
        for part in self.parts:
            if part.pool.kv is None:
                part.pool.allocate()

    def reset(self, keep_cache: bool = False) -> None:
        """Forget every host copy (the context's ``reset``; ``keep_cache``: the host tier's
        are kept with the prefix cache), except at the reset that follows the re-allocation
        after an OFFLOAD suspend (``release``)."""
        if self.held:
            self.held = False
            return
        if keep_cache:
            for request_id in list(self.entries):
                self._drop(request_id)
            return
        self.entries.clear()
        for part in self.parts:
            part.pool.reset()
        if self.tier is not None:
            self.tier.forget()

    def release(self) -> None:
        """Suspend: in OFFLOAD mode the host copies stay for the re-adds after the resume
        (what the mode is for); otherwise they go."""
        if self.mode == "offload":
            self.held = True
        else:
            self.held = False
            self.reset()

    # ------------------------------------------------------------------ saving
    def _drop(self, request_id: int) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self.pool.give(entry.host_blocks, np.array([entry.state] if entry.state >= 0
                                                       else [], dtype=np.int64))
            for part, (_, slots) in zip(self.parts[1:], entry.windowed):
                part.pool.give(slots, np.empty(0, dtype=np.int64))

    def _needs(self, tokens: int) -> list:
        """Each part's ``(first block, host blocks)`` for a row of ``tokens`` cached tokens."""
        count = math.ceil(tokens / self.block_size)
        needs = []
        for part in self.parts:
            first = part.first(tokens, self.block_size) if part.pool.blocks.count or \
                part.group is not None else count
            needs.append((first, count - first))
        return needs

    def save_rows(self, table, rows: np.ndarray, cached: np.ndarray) -> None:
        """Copy the blocks (and Mamba states) of the table's ``rows``, whose KV holds
        ``cached`` tokens each, to the host, each as an entry under its request id (the table
        is not changed)."""
        pool, bs, parts = self.pool, self.block_size, self.parts
        hybrid = self.mamba is not None
        device_blocks, host_blocks, device_slots, host_states = [], [], [], []
        windowed = [([], []) for _ in parts[1:]]
        for row, tokens in zip(np.asarray(rows, dtype=np.int64).tolist(),
                               np.asarray(cached, dtype=np.int64).tolist()):
            request_id = int(table.rows[FIELD_IDS, row])
            self._drop(request_id)
            count = math.ceil(tokens / bs)
            if not count:
                continue
            needs = self._needs(tokens)
            if any(n > part.pool.blocks.count for part, (_, n) in zip(parts, needs)) \
                    or (hybrid and pool.states.count == 0):
                self.stats.unsaved_requests += 1
                continue
            if self.tier is not None:   # the spilled prefix blocks and snapshots go first
                self.tier.drop_blocks(needs[0][1] - pool.free_blocks)
                self.tier.drop_states(int(hybrid) - pool.free_states)
            while any(part.pool.free_blocks < n for part, (_, n) in zip(parts, needs)) \
                    or (hybrid and pool.free_states == 0):
                self._drop(next(iter(self.entries)))
                self.stats.dropped_requests += 1
            blocks, states = pool.take(needs[0][1], 1 if hybrid else 0)
            device_blocks.append(table.block_table[row, :needs[0][1]].astype(np.int64))
            host_blocks.append(blocks)
            entry = Offloaded(request_id, tokens, blocks)
            line = table.block_table[row, :count].astype(np.int64)
            for part, (first, n), (devices, hosts) in zip(parts[1:], needs[1:], windowed):
                slots, _ = part.pool.take(n, 0)
                devices.append(part.group.map[line[first:]].astype(np.int64))
                hosts.append(slots)
                entry.windowed += ((first, slots),)
            if hybrid:
                entry.state = int(states[0])
                device_slots.append(int(table.rows[FIELD_MAMBA_SLOT, row]))
                host_states.append(entry.state)
            self.entries[request_id] = entry
            self.stats.offloaded_requests += 1
            self.stats.offloaded_blocks += count
        if not host_blocks:
            return
        for part, (devices, hosts) in zip(parts[1:], windowed):
            devices = np.concatenate(devices)
            if (devices < 0).any():
                raise RuntimeError("internal: a saved row's window reads a released block")
            part.pool.save(part.cache.buffer, devices, np.concatenate(hosts))
        mamba = self.mamba
        pool.save(self.kv.buffer, np.concatenate(device_blocks), np.concatenate(host_blocks),
                  states=() if mamba is None else (mamba.conv_states, mamba.ssm_states),
                  device_slots=np.asarray(device_slots, dtype=np.int64) if hybrid else None,
                  host_states=np.asarray(host_states, dtype=np.int64) if hybrid else None)

    def save_evicted(self, table, plan) -> None:
        """An update's evicted rows (``plan.evicted_ids``), before ``commit_update``: the
        table is the forwarded step's, so each row's KV holds its offset and its query."""
        if plan.evicted_ids.size:
            ids = table.rows[FIELD_IDS, :table.total]
            rows = np.flatnonzero(np.isin(ids, plan.evicted_ids))
            self.save_rows(table, rows, table.rows[FIELD_KV_OFFSET, rows]
                           + table.rows[FIELD_QUERY, rows])

    def save_all(self, table) -> None:
        """An OFFLOAD suspend, between steps: every live row. A paused row's KV holds its
        offset and its last query; an active row's query is still to be forwarded."""
        if table.bound and table.total:
            cached = table.rows[FIELD_KV_OFFSET, :table.total].astype(np.int64)
            cached[:table.paused] += table.rows[FIELD_QUERY, :table.paused]
            self.save_rows(table, np.arange(table.total), cached)

    # ------------------------------------------------------------------ restoring
    def lookup(self, req: Any) -> int:
        """Tokens an add of the new request ``req`` with its whole remaining prompt would
        restore (0: none); pure."""
        entry = self.entries.get(getattr(req, "request_id", None))
        if entry is None or req.finished_chunk_token_count or wants_every_prompt_logit(req):
            return 0
        return entry.tokens if req.remaining_prompt_length > entry.tokens else 0

    def plan_restore(self, req: Any, request_id: int, chunk: int) -> Optional[RestorePlan]:
        """The restore of a new request's add whose chunk is ``chunk`` prompt tokens, or None;
        pure."""
        entry = self.entries.get(request_id)
        if entry is None or wants_every_prompt_logit(req) or chunk <= entry.tokens:
            return None
        return RestorePlan(entry, math.ceil(entry.tokens / self.block_size))

    def commit_add(self, table, plan) -> None:
        """After ``RequestTable.commit_add`` of a new request's ``plan``: its restore
        (``commit_restore``), or a hybrid prefix hit's host snapshot into its Mamba slot."""
        self.commit_restore(table, plan.row, plan.request_id, plan.restore)
        hit = plan.prefix
        if hit is not None and hit.host_snapshot and hit.snapshot < 0:
            self.tier.load_snapshot(hit.host_snapshot, int(table.rows[FIELD_MAMBA_SLOT, plan.row]),
                                    self.mamba.conv_states, self.mamba.ssm_states)

    def commit_restore(self, table, row: int, request_id: int,
                       restore: Optional[RestorePlan]) -> None:
        """After ``commit_add`` of a new request at ``row``: copy its entry back (``restore``)
        or drop a stale one."""
        if restore is None:
            self._drop(request_id)
            return
        entry = restore.entry
        device_blocks = table.block_table[row, :entry.host_blocks.size].astype(np.int64)
        mamba = self.mamba
        slot = None
        if mamba is not None:
            slot = np.array([table.rows[FIELD_MAMBA_SLOT, row]], dtype=np.int64)
            # Its slot takes the saved state instead of zeros, and it runs as the step's
            # continuation (the last row, from its slot's state): it is the last slot staged.
            table.zero_count -= 1
            table.continuation_added = True
        self.pool.load(self.kv.buffer, entry.host_blocks, device_blocks,
                       states=() if mamba is None else (mamba.conv_states, mamba.ssm_states),
                       host_states=None if slot is None else np.array([entry.state]),
                       device_slots=slot)
        line = table.block_table[row, :restore.blocks].astype(np.int64)
        for part, (first, slots) in zip(self.parts[1:], entry.windowed):
            # The restored row's window reads these before its first step: they take the
            # group's blocks now (the step's reconcile keeps them); its blocks before the
            # window keep no copy.
            part.group.forget(line[:first])
            part.pool.load(part.cache.buffer, slots, part.group.adopt(line[first:]))
        self._drop(request_id)
        self.stats.restored_requests += 1
        self.stats.restored_tokens += entry.tokens

    def stats_dict(self) -> dict:
        """The counters (``OffloadStats``), the host pool's blocks and free blocks, the
        requests held, and with the host tier its counters and holdings (``HostTier``)."""
        stats = self.stats.as_dict()
        pools = [part.pool for part in self.parts]
        stats.update(kv_offload_host_blocks=sum(pool.blocks.count for pool in pools),
                     kv_offload_host_blocks_free=sum(pool.free_blocks for pool in pools),
                     kv_offload_requests_held=len(self.entries))
        if self.tier is not None:
            stats.update(self.tier.stats.as_dict(), **self.tier.held())
        return stats

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Every host slot free or owned by exactly one entry (``AssertionError``)."""
        entries = list(self.entries.values())
        blocks = [e.host_blocks for e in entries]
        states = np.array([e.state for e in entries if e.state >= 0], dtype=np.int64)
        if self.tier is not None:
            blocks.append(self.tier.owned_blocks())
            states = np.concatenate([states, self.tier.owned_states()])
        self.pool.check(np.concatenate(blocks) if blocks else np.empty(0, dtype=np.int64),
                        states)
        for index, part in enumerate(self.parts[1:]):
            owned = [e.windowed[index][1] for e in entries]
            part.pool.check(np.concatenate(owned) if owned else np.empty(0, dtype=np.int64),
                            np.empty(0, dtype=np.int64))
        for entry in entries:
            needs = self._needs(entry.tokens)
            assert entry.host_blocks.size == needs[0][1], entry
            assert [(first, slots.size) for first, slots in entry.windowed] == needs[1:], entry
