"""KV groups: one KV buffer, block pool and block table per distinct layer window.

A model whose layers mix sliding-window and full attention (Gemma 3: five windowed per full;
gpt-oss: alternating) wastes most of its KV memory when every layer keeps every block: a layer
of window ``W`` reads, for a query at position ``p``, only the keys ``p - W < j <= p``. With
``kv_layer_windows`` (one entry per attention layer: its window, or None for a full layer) the
context keeps one *group* per distinct window, as vLLM's hybrid allocator does
(docs/SEMANTICS.md §22):

* group 0 holds the full layers: its buffer, allocator, block table and budgets are the
  context's own (``KVCache``, ``RequestTable``), unchanged; admission, pauses and evictions
  are decided on it exactly as without groups. When every layer is windowed, group 0 holds no
  layers: its blocks are the requests' block-table entries (no bytes), which key the
  windowed groups' blocks, and its budgets are still the ones every rule runs on.
* each windowed group ``g`` holds its layers' K/V in a buffer of its own
  (``[2, layers of g, blocks of g, block_size, H, D]``) with a block pool of its own. Its
  blocks are keyed by the group-0 block that covers the same positions of the same request
  (``map[main block] -> group block``, -1: none; ``map[-1]`` is -1), so the group's block table is
  ``map[main block table]`` and its per-token blocks ``map[main per-token blocks]``: row
  moves, pauses and evictions need nothing of the group.
* at each step (``begin``, from ``initialize_attention_state``) a group holds exactly the
  blocks its window still reads: for a row whose first query position is ``a`` (a paused row:
  its next token) the columns ``[max(0, a - W + 1) // block_size, block count)``; every other
  block goes back to its pool and its entry reads -1 (the attention never reads it: the
  window hides it). A decode row holds at most ``ceil(W / block_size) + 1`` blocks, a row of
  ``q`` query tokens ``ceil((q + W - 1) / block_size) + 1``.

Budgets (``kv_group_sizing.py``): a windowed group gets the blocks it can ever need,
``ceil((max_tokens + max_requests * W) / block_size) + 2 * max_requests`` (every row's window
and the step's query tokens, each row's range misaligned at both ends) plus its dummy block,
but never more than group 0 has (it never holds more than group 0 does); group 0 gets the rest
of the bytes the context would allocate without groups. So a windowed group never runs short,
and the checks of admission and eviction on group 0 are the checks of every group.

Without windows, with ``kv_groups=False``, or with no window shorter than
``max_sequence_length``, the context is exactly the single-group one: nothing here is built
and the step path does not change. Prefix caching keeps a windowed copy of a cached block,
idle, until the pool needs it, and a hit needs only the copies each window reads from its end
(``hit_blocks``). An FP8 cache keeps scales per group (each group's ``KVCache``). With
speculative steps each window keeps ``num_speculative_tokens`` more tokens (``reach``): a
rewind lowers a row's offset by at most that many. KV offload saves each window's last
blocks in the group's own host pool (``offload.OffloadPart``) and a restore takes them back
at the add (``adopt``). Groups are refused with the MLA latent cache and hybrid Mamba models
(each names the argument).
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import torch

from ._fields import FIELD_BLOCKS, FIELD_KV_OFFSET
from .kv_cache import KVCache
from .kv_group_sizing import (  # noqa: F401 (re-exported: the sizing's names)
    GroupSpec,
    check_layer_windows,
    group_block_counts,
    group_spec,
    sized_with_groups,
    worst_case_blocks,
)
from .staging import HostToDevice


class WindowedGroup:
    """One windowed group: its window, buffer (``cache``), block pool and map (module
    docstring). Host state is numpy; ``allocate`` builds the device map, table and per-token
    blocks. ``reach``: the tokens before a row's first query (itself included) whose blocks the
    group keeps, its window plus ``margin``."""

    def __init__(self, *, window: int, cache: KVCache, blocks: int, main_blocks: int,
                 main_dummy: int, block_size: int, max_requests: int, columns: int,
                 max_tokens: int, device: torch.device, margin: int = 0):
        self.window, self.reach, self.cache, self.blocks = window, window + margin, cache, blocks
        self.main_blocks, self.main_dummy, self.block_size = main_blocks, main_dummy, block_size
        self.dummy = blocks - 1
        self.shape = (max_requests, columns, max_tokens)
        self.device = device
        self.columns = np.arange(columns)
        # One entry more than group 0 has blocks, always -1: index -1 (an unused entry of
        # group 0's table) reads it.
        self.map = np.full(main_blocks + 1, -1, dtype=np.int32)
        self.free = np.arange(blocks - 1, dtype=np.int32)  # a stack; [0, free_count) free
        self.free_count = blocks - 1
        # Prefix caching: each group block's group-0 block (-1: free), and since when a block
        # no row reads is kept for its cached group-0 block (-1: read, or free).
        self.owner = np.full(blocks, -1, dtype=np.int64)
        self.idle_since = np.full(blocks, -1, dtype=np.int64)
        self.clock = 0
        self.map_device = self.table = self.token_blocks = self.h2d = None
        self.reset()

    def reset(self) -> None:
        self.map.fill(-1)
        self.map[self.main_dummy] = self.dummy
        self.free[:] = np.arange(self.blocks - 1, dtype=np.int32)[::-1]
        self.free_count = self.blocks - 1
        self.owner.fill(-1)
        self.owner[self.dummy] = self.main_dummy
        self.idle_since.fill(-1)
        self.clock = 0
        self.changed = True

    def allocate(self) -> None:
        rows, columns, tokens = self.shape
        device = self.device
        if device.type == "cpu":
            self.map_device = torch.from_numpy(self.map)   # shares the host map: no upload
        else:
            self.map_device = torch.empty(self.main_blocks + 1, dtype=torch.int32, device=device)
            # The map's uploads go through a pinned ring: non-blocking, no sync in the step.
            self.h2d = HostToDevice(device, self.map.nbytes + 64)
        self.table = torch.full((rows, columns), -1, dtype=torch.int32, device=device)
        self.token_blocks = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.reset()

    def release(self) -> None:
        self.map_device = self.table = self.token_blocks = self.h2d = None

    @property
    def held(self) -> int:
        """Blocks held (the dummy block not counted), idle ones included."""
        return self.blocks - 1 - self.free_count

    @property
    def idle(self) -> int:
        """Blocks no row reads, kept for their cached group-0 blocks (prefix caching)."""
        return int((self.idle_since >= 0).sum())

    def needed(self, table) -> np.ndarray:
        """bool ``[rows in use, columns]``: the block-table entries this group keeps."""
        total = table.total
        rows, block_table = table.rows, table.block_table[:total]
        offsets = rows[FIELD_KV_OFFSET, :total].astype(np.int64)
        first = np.maximum(offsets - (self.reach - 1), 0) // self.block_size
        columns = self.columns
        return ((columns >= first[:, None])
                & (columns < rows[FIELD_BLOCKS, :total].astype(np.int64)[:, None])
                & (block_table >= 0) & (block_table != self.main_dummy))

    def reconcile(self, table, cached: Optional[np.ndarray] = None) -> None:
        """Hold the blocks the rows' windows read (``needed``) and allocate the missing ones.
        A block no row reads goes back to the pool, unless its group-0 block is ``cached``
        (prefix caching: bool ``[group 0's blocks]``): then it stays, idle, for a later hit,
        until an allocation needs it (least recently idle first). Checked first: the sizing
        makes a shortage impossible."""
        need = np.zeros(self.main_blocks + 1, dtype=np.bool_)
        if table.total:
            need[table.block_table[:table.total][self.needed(table)]] = True
        need[self.main_dummy] = True
        have = self.map >= 0
        unread = have & ~need
        keep = np.zeros_like(unread)
        if cached is not None:
            keep[:-1] = unread[:-1] & cached
        release = np.flatnonzero(unread & ~keep)
        take = np.flatnonzero(need & ~have)
        kept = self.map[np.flatnonzero(keep)]
        if take.size > self.free_count + release.size + kept.size:
            raise RuntimeError(f"internal: KV group of window {self.window} needs {take.size} "
                               f"blocks, {self.free_count + release.size + kept.size} are free")
        self.idle_since[self.map[np.flatnonzero(need & have)]] = -1
        fresh = kept[self.idle_since[kept] < 0]
        if fresh.size:
            self.idle_since[fresh] = self.clock
            self.clock += 1
        if not release.size and not take.size:
            return
        self._free(self.map[release])
        short = take.size - self.free_count
        if short > 0:   # the least recently idle blocks make room
            self._free(kept[np.argsort(self.idle_since[kept], kind="stable")[:short]])
        count = self.free_count
        taken = self.free[count - take.size:count][::-1]
        self.map[take] = taken
        self.owner[taken] = take
        self.free_count = count - take.size
        self.changed = True

    def adopt(self, keys: np.ndarray) -> np.ndarray:
        """Blocks now for the new group-0 blocks ``keys`` (a row restored from the host, whose
        window reads them before its first step; the step's reconcile keeps them): a key
        still mapped (an idle copy of a block group 0 evicted from its cache and handed out
        again) keeps its block, the others take free ones, then the least recently idle
        copies. Returns them, in ``keys``' order, to be overwritten. The sizing makes a
        shortage impossible (they are that row's window)."""
        new = keys[self.map[keys] < 0]
        self.idle_since[self.map[keys[self.map[keys] >= 0]]] = -1
        idle = np.flatnonzero(self.idle_since >= 0)
        if new.size > self.free_count + idle.size:
            raise RuntimeError(f"internal: KV group of window {self.window} cannot take "
                               f"{new.size} blocks for a restored row")
        short = new.size - self.free_count
        if short > 0:
            self._free(idle[np.argsort(self.idle_since[idle], kind="stable")[:short]])
        count = self.free_count
        taken = self.free[count - new.size:count][::-1].copy()
        self.map[new] = taken
        self.owner[taken] = new
        self.free_count = count - new.size
        self.changed = True
        return self.map[keys].astype(np.int64)

    def forget(self, keys: np.ndarray) -> None:
        """Free the copies of group-0 blocks ``keys`` (a restored row's blocks before its
        window, handed out again by group 0 while an idle copy of their cached past stayed)."""
        mapped = keys[self.map[keys] >= 0]
        if mapped.size:
            self._free(self.map[mapped].astype(np.int64))
            self.changed = True

    def _free(self, blocks: np.ndarray) -> None:
        """Push group ``blocks`` on the free stack, their group-0 keys unmapped."""
        count = self.free_count
        self.map[self.owner[blocks]] = -1
        self.owner[blocks] = -1
        self.idle_since[blocks] = -1
        self.free[count:count + blocks.size] = blocks
        self.free_count = count + blocks.size

    def readable(self, blocks: np.ndarray) -> np.ndarray:
        """bool ``[len(blocks)]``: which group-0 ``blocks`` have this group's copy."""
        return self.map[blocks] >= 0

    def gather(self, main_table: torch.Tensor, main_token_blocks: torch.Tensor) -> torch.Tensor:
        """The step's device table and per-token blocks from group 0's; returns the table."""
        if self.changed and self.device.type != "cpu":
            self.h2d.copy(self.map_device, self.map)
            self.h2d.advance()
        self.changed = False
        rows, tokens = main_table.shape[0], main_token_blocks.shape[0]
        table = self.table[:rows]
        table.copy_(self.map_device[main_table])
        self.token_blocks[:tokens].copy_(self.map_device[main_token_blocks])
        return table


class GroupedKV:
    """The KV cache of a context with groups: group 0's ``KVCache`` (``main``) and the
    windowed groups, behind ``KVCache``'s interface (``append``, ``views``, ...) for the
    context's attention-layer index, which each call maps to its group's buffer and, for a
    windowed group, its per-token blocks. ``begin`` runs each step after the device built
    group 0's step arrays."""

    def __init__(self, spec: GroupSpec, main: KVCache, groups: List[WindowedGroup]):
        self.spec, self.main, self.groups = spec, main, groups
        self.allocator = None   # group 0's BlockAllocator (build_parts sets it)
        self.caches = [main] + [group.cache for group in groups]
        self.dtype, self.device, self.kv_dtype = main.dtype, main.device, main.kv_dtype
        self.fp8, self.mla = main.fp8, main.mla

    # ------------------------------------------------------------------ KVCache's interface
    buffer = property(lambda self: self.main.buffer)

    def nbytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)

    def allocate(self) -> None:
        for cache in self.caches:
            cache.allocate()
        for group in self.groups:
            group.allocate()

    def release(self) -> None:
        for cache in self.caches:
            cache.release()
        for group in self.groups:
            group.release()

    def begin_step(self, real_tokens: int, capture: bool) -> bool:
        return any([cache.begin_step(real_tokens, capture) for cache in self.caches])

    def views(self, layer: int):
        group, index = self.spec.where[layer]
        return self.caches[group].views(index)

    def layer_scales(self, layer: int):
        group, index = self.spec.where[layer]
        return self.caches[group].layer_scales(index)

    def _blocks(self, group: int, blocks: torch.Tensor) -> torch.Tensor:
        return blocks if group == 0 else self.groups[group - 1].token_blocks[:blocks.shape[0]]

    def append(self, layer: int, key, value, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        group, index = self.spec.where[layer]
        self.caches[group].append(index, key, value, self._blocks(group, blocks), slots)

    def rope_append(self, layer: int, query, key, value, positions, blocks: torch.Tensor,
                    slots: torch.Tensor, **rope) -> None:
        group, index = self.spec.where[layer]
        self.caches[group].rope_append(index, query, key, value, positions,
                                       self._blocks(group, blocks), slots, **rope)

    # ------------------------------------------------------------------ the step
    def settle(self, table) -> None:
        """Host only, after an update (and a reset): each windowed group releases the blocks
        its window no longer reads (``reconcile``; with prefix caching it keeps those of
        cached group-0 blocks, idle)."""
        cached = None if table.prefix_cache is None else table.allocator.cached
        for group in self.groups:
            group.reconcile(table, cached)

    def hit_blocks(self, blocks: Any) -> int:
        """Prefix caching: of a run of cached group-0 ``blocks`` that starts a prompt, the
        longest ``k`` whose hit every windowed group can serve: each holds a copy of the
        blocks its window reads from position ``k * block_size`` (the hit's first query) back.
        Group 0 (the full layers) holds every cached block. Pure."""
        n = len(blocks)
        if n == 0:
            return 0
        blocks = np.asarray(blocks, dtype=np.int64)
        ends = np.arange(n + 1)
        usable = np.ones(n + 1, dtype=np.bool_)
        for group in self.groups:
            missing = np.concatenate(([0], np.cumsum(~group.readable(blocks))))
            first = np.maximum(ends * group.block_size - group.window + 1, 0) \
                // group.block_size
            usable &= missing[ends] == missing[first]
        return int(np.flatnonzero(usable)[-1])

    def begin(self, step, table, device, attention) -> None:
        """Each windowed group holds the blocks its window reads (``reconcile``), then its
        table and per-token blocks are gathered on the device; ``attention`` (the step's
        metadata) gets ``kv_group_block_tables`` (group 0's table first) and
        ``kv_group_of_layer`` (each attention layer's group, 0-based layers)."""
        self.settle(table)
        main_table = attention.block_table
        tokens = device.token_to_block_idx[:step.padded_tokens]
        tables = [main_table] + [group.gather(main_table, tokens) for group in self.groups]
        attention.kv_group_block_tables = tuple(tables)
        attention.kv_group_of_layer = self.spec.group_of_layer
        attention.kv_group_windows = self.spec.windows

def build_grouped_kv(spec: GroupSpec, *, main_blocks: int, windowed_blocks: List[int],
                     block_size: int, max_requests: int, columns: int, max_tokens: int,
                     **cache: Any) -> GroupedKV:
    """The ``GroupedKV`` of ``spec``: group 0 of ``main_blocks`` blocks, the windowed groups
    of ``windowed_blocks``; ``cache``: ``KVCache``'s other arguments (an FP8 cache's given
    scales, ``[2, layers, heads]``, are cut to each group's layers: scales per group)."""
    scales = cache.pop("scales", None)

    def group_cache(g: int, blocks: int) -> KVCache:
        spec_scales = scales
        if scales is not None and scales.values is not None:
            spec_scales = scales._replace(values=scales.values[:, list(spec.layers[g])])
        return KVCache(layers=len(spec.layers[g]), total_blocks=blocks, block_size=block_size,
                       scales=spec_scales, **cache)

    groups = []
    for g, blocks in enumerate(windowed_blocks, start=1):
        groups.append(WindowedGroup(
            window=spec.windows[g], blocks=blocks, main_blocks=main_blocks,
            main_dummy=main_blocks - 1, block_size=block_size, max_requests=max_requests,
            columns=columns, max_tokens=max_tokens, device=cache["device"], margin=spec.margin,
            cache=group_cache(g, blocks)))
    return GroupedKV(spec, group_cache(0, main_blocks), groups)


def kv_group_usage(kv: Any) -> Optional[dict]:
    """What each KV group holds now (``ctx.kv_group_usage()``), or None for a context without
    groups: ``windows``, ``layers`` (attention layers per group), ``blocks`` (each pool, its
    dummy included), ``held`` (blocks held now, dummies not counted), ``idle`` (of those, held
    for the prefix cache only: group 0's idle cached blocks, a windowed group's copies no row
    reads), ``block_bytes`` (one block of the group, all its layers) and ``held_bytes`` (their
    sum over the held blocks)."""
    if not isinstance(kv, GroupedKV):
        return None
    allocator = kv.allocator
    held = [allocator.total_count - 1 - allocator.total_avail] + [g.held for g in kv.groups]
    block_bytes = [cache.nbytes() // cache.shape[2] for cache in kv.caches]
    return dict(windows=list(kv.spec.windows), layers=[len(m) for m in kv.spec.layers],
                blocks=[cache.shape[2] for cache in kv.caches], held=held,
                idle=[allocator.idle_count] + [g.idle for g in kv.groups],
                block_bytes=block_bytes,
                held_bytes=sum(h * b for h, b in zip(held, block_bytes)))
