"""KV groups: one KV buffer, block pool and block table per distinct layer window.

A model whose layers mix sliding-window and full attention (Gemma 3: five windowed per full;
gpt-oss: alternating) wastes most of its KV memory when every layer keeps every block: a layer
of window ``W`` reads, for a query at position ``p``, only the keys ``p - W < j <= p``. With
``kv_layer_windows`` (one entry per attention layer: its window, or None for a full layer) the
context keeps one *group* per distinct window, as vLLM's hybrid allocator does
(docs/SEMANTICS.md §22):

* group 0 holds the full layers: its buffer, allocator, block table and budgets are the
  context's own (``KVCache``, ``RequestTable``), unchanged; admission, pauses and evictions
  are decided on it exactly as without groups.
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

Budgets, one rule: a windowed group gets the blocks it can ever need, ``ceil((max_tokens +
max_requests * W) / block_size) + 2 * max_requests`` (every row's window and the step's query
tokens, each row's range misaligned at both ends) plus its dummy block, but never more than
group 0 has (it never holds more than group 0 does); group 0 gets the rest of the bytes the
context would allocate without groups. So a windowed group never runs short, and the checks
of admission and eviction on group 0 are the checks of every group. Group 0's paused budget
keeps its share of its blocks.

Without windows, with ``kv_groups=False``, or with fewer than two distinct windows (a model
whose every layer has the same window keeps one group, without release), the context is
exactly the single-group one: nothing here is built and the step path does not change.
Groups are refused with prefix caching, speculative steps, an FP8 cache, the MLA latent cache,
hybrid Mamba models and KV offload (each names the argument).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ._fields import FIELD_BLOCKS, FIELD_KV_OFFSET
from .kv_cache import KVCache
from .staging import HostToDevice


@dataclass(frozen=True)
class GroupSpec:
    """Which attention layers form which group: ``windows[g]`` (group 0: None, the full
    layers; then the windows, ascending), ``layers[g]`` (0-based attention-layer indices) and
    ``where[layer] = (group, index within the group)``."""

    windows: Tuple[Optional[int], ...]
    layers: Tuple[Tuple[int, ...], ...]
    where: Tuple[Tuple[int, int], ...]

    @property
    def group_of_layer(self) -> Tuple[int, ...]:
        return tuple(group for group, _ in self.where)


def check_layer_windows(kv_layer_windows: Any, num_attention_layers: int
                        ) -> Optional[Tuple[Optional[int], ...]]:
    """``kv_layer_windows`` checked: None, or one entry per attention layer, each None (a full
    layer) or an int >= 1 (the keys a query sees, its own included)."""
    if kv_layer_windows is None:
        return None
    if isinstance(kv_layer_windows, (str, bytes)) or not isinstance(kv_layer_windows, Sequence):
        raise TypeError(f"kv_layer_windows={kv_layer_windows!r} must be a list with one window "
                        "(an int >= 1, or None for a full layer) per attention layer")
    windows = tuple(kv_layer_windows)
    if len(windows) != num_attention_layers:
        raise ValueError(f"kv_layer_windows has {len(windows)} entries; the context has "
                         f"{num_attention_layers} attention layers (one window each)")
    for layer, window in enumerate(windows):
        if window is not None and (isinstance(window, bool) or not isinstance(
                window, (int, np.integer)) or window < 1):
            raise ValueError(f"kv_layer_windows[{layer}]={window!r} must be an int >= 1 (keys "
                             "a query sees, its own included) or None (a full layer)")
    return tuple(None if w is None else int(w) for w in windows)


def group_spec(kv_layer_windows: Any, kv_groups: Any, *, num_attention_layers: int,
               max_sequence_length: int, prefix_caching: bool, speculative: int, fp8: bool,
               mla: bool, hybrid: bool, offload: bool = False) -> Optional[GroupSpec]:
    """The groups of the constructor's ``kv_layer_windows`` and ``kv_groups`` (module
    docstring), or None for the single group; raises before anything is built. A window of
    at least ``max_sequence_length`` is a full layer (it never frees a block)."""
    if not isinstance(kv_groups, bool):
        raise TypeError(f"kv_groups={kv_groups!r} must be a bool")
    windows = check_layer_windows(kv_layer_windows, num_attention_layers)
    if windows is None or not kv_groups:
        return None
    windows = tuple(None if w is None or w >= max_sequence_length else w for w in windows)
    distinct = sorted({w for w in windows if w is not None})
    if not distinct or None not in windows:
        return None     # one distinct window: the single group
    refused = [what for what, on in (
        ("enable_prefix_caching=True", prefix_caching),
        (f"num_speculative_tokens={speculative}", speculative),
        ("an FP8 cache (kv_cache_dtype)", fp8), ("cache_mla_latent=True", mla),
        ("a hybrid model (mamba_inference_state_config)", hybrid),
        ("KV offload (kv_offload_gb, kv_cache_management_mode='offload')", offload)) if on]
    if refused:
        raise ValueError(f"KV groups (kv_layer_windows with windowed and full layers, "
                         f"kv_groups=True) do not support {', '.join(refused)} yet; pass "
                         "kv_groups=False to keep every block of every layer")
    order = [None] + distinct
    layers = tuple(tuple(i for i, w in enumerate(windows) if w == window) for window in order)
    where = [None] * num_attention_layers
    for group, members in enumerate(layers):
        for index, layer in enumerate(members):
            where[layer] = (group, index)
    return GroupSpec(tuple(order), layers, tuple(where))


def worst_case_blocks(window: int, *, block_size: int, max_requests: int,
                      max_tokens: int) -> int:
    """The most blocks a windowed group can hold at once (its dummy block included)."""
    return (math.ceil((max_tokens + max_requests * window) / block_size)
            + 2 * max_requests + 1)


def group_block_counts(spec: GroupSpec, total_blocks: int, *, block_size: int,
                       max_requests: int, max_tokens: int) -> Tuple[int, List[int]]:
    """``(group 0's blocks, [each windowed group's blocks])``, dummies included, out of the
    layer-blocks of ``total_blocks`` blocks of every layer (module docstring: a windowed group
    gets its worst case, capped at group 0's count; group 0 the rest)."""
    sizes = [len(members) for members in spec.layers]
    budget = total_blocks * sum(sizes)
    capped = {g: worst_case_blocks(spec.windows[g], block_size=block_size,
                                   max_requests=max_requests, max_tokens=max_tokens)
              for g in range(1, len(sizes))}
    while True:
        free_layers = sizes[0] + sum(sizes[g] for g in range(1, len(sizes)) if g not in capped)
        main = (budget - sum(capped[g] * sizes[g] for g in capped)) // free_layers
        over = [g for g, blocks in capped.items() if blocks > main]
        if not over:
            break
        for g in over:
            del capped[g]
    return main, [capped.get(g, main) for g in range(1, len(sizes))]


def grouped_memory(memory: Any, main_blocks: int, layer_fraction: Tuple[int, int],
                   max_sequence_length: int, block_size: int) -> Any:
    """``memory`` (``sizing.MemoryLayout``) for group 0 alone: ``main_blocks`` blocks of its
    layers (``layer_fraction``: its layers, all layers), its paused budget the same share of
    them as before."""
    paused = memory.paused_blocks * main_blocks // memory.total_blocks
    paused = min(paused, main_blocks - 2)
    own, every = layer_fraction
    columns = min(math.ceil(max_sequence_length / block_size), main_blocks - 1)
    return replace(memory, total_blocks=main_blocks, paused_blocks=paused,
                   max_kv_block_count=columns,
                   block_size_bytes=memory.block_size_bytes * own // every,
                   bytes_per_block=memory.bytes_per_block * own // every)


SIZING_WARNING = "a long request may pause with no way to resume"


def reissue_sizing_warnings(records: list, memory: Any, max_sequence_length: int,
                            block_size: int) -> None:
    """Issue again the warnings ``sizing.memory_layout`` gave before the split
    (``records``), its sizing warning only if group 0's active budget (``memory``) still
    cannot hold one request of ``max_sequence_length``, with group 0's counts."""
    needed = math.ceil(max_sequence_length / block_size)
    active = memory.total_blocks - memory.paused_blocks - 1
    for record in records:
        message = str(record.message)
        if SIZING_WARNING in message:
            if active >= needed:
                continue
            message = (f"max_sequence_length={max_sequence_length} needs {needed} blocks of "
                       f"{block_size} tokens for one request, but KV group 0 (the full "
                       f"layers) has an active budget of {active} (the paused budget is "
                       f"{memory.paused_blocks} blocks): {SIZING_WARNING}, and update_requests "
                       "then raises 'no request can run'. Raise buffer_size_gb (or lower "
                       "paused_buffer_size_gb), or lower max_sequence_length")
        warnings.warn_explicit(message, record.category, record.filename, record.lineno)


def sized_with_groups(spec: Optional[GroupSpec], layout: Any, *, max_sequence_length: int,
                      block_size: int, attention_layers: int) -> Tuple[Any, Optional[list]]:
    """``(memory layout, each windowed group's blocks)``: ``layout()`` (the context's
    ``sizing.memory_layout``) as it is without groups (``spec`` None); with groups split
    (``group_block_counts``, ``grouped_memory``), its warnings issued on group 0's counts."""
    if spec is None:
        return layout(), None
    with warnings.catch_warnings(record=True) as sizing:
        warnings.simplefilter("always")
        memory = layout()
    main_blocks, windowed = group_block_counts(spec, memory.total_blocks, block_size=block_size,
                                               max_requests=memory.max_requests,
                                               max_tokens=memory.max_tokens)
    memory = grouped_memory(memory, main_blocks, (len(spec.layers[0]), attention_layers),
                            max_sequence_length, block_size)
    reissue_sizing_warnings(sizing, memory, max_sequence_length, block_size)
    return memory, windowed


class WindowedGroup:
    """One windowed group: its window, buffer (``cache``), block pool and map (module
    docstring). Host state is numpy; ``allocate`` builds the device map, table and per-token
    blocks."""

    def __init__(self, *, window: int, cache: KVCache, blocks: int, main_blocks: int,
                 main_dummy: int, block_size: int, max_requests: int, columns: int,
                 max_tokens: int, device: torch.device):
        self.window, self.cache, self.blocks = window, cache, blocks
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
        self.map_device = self.table = self.token_blocks = self.h2d = None
        self.reset()

    def reset(self) -> None:
        self.map.fill(-1)
        self.map[self.main_dummy] = self.dummy
        self.free[:] = np.arange(self.blocks - 1, dtype=np.int32)[::-1]
        self.free_count = self.blocks - 1
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
        """Blocks held (the dummy block not counted)."""
        return self.blocks - 1 - self.free_count

    def needed(self, table) -> np.ndarray:
        """bool ``[rows in use, columns]``: the block-table entries this group keeps."""
        total = table.total
        rows, block_table = table.rows, table.block_table[:total]
        offsets = rows[FIELD_KV_OFFSET, :total].astype(np.int64)
        first = np.maximum(offsets - (self.window - 1), 0) // self.block_size
        columns = self.columns
        return ((columns >= first[:, None])
                & (columns < rows[FIELD_BLOCKS, :total].astype(np.int64)[:, None])
                & (block_table >= 0) & (block_table != self.main_dummy))

    def reconcile(self, table) -> None:
        """Hold exactly the blocks the rows' windows read (``needed``): release the others,
        allocate the missing ones (checked first; the sizing makes a shortage impossible)."""
        need = np.zeros(self.main_blocks + 1, dtype=np.bool_)
        if table.total:
            need[table.block_table[:table.total][self.needed(table)]] = True
        need[self.main_dummy] = True
        have = self.map >= 0
        release = np.flatnonzero(have & ~need)
        take = np.flatnonzero(need & ~have)
        if take.size > self.free_count + release.size:
            raise RuntimeError(f"internal: KV group of window {self.window} needs {take.size} "
                               f"blocks, {self.free_count + release.size} are free")
        if not release.size and not take.size:
            return
        count = self.free_count
        self.free[count:count + release.size] = self.map[release]
        count += release.size
        self.map[release] = -1
        self.map[take] = self.free[count - take.size:count][::-1]
        self.free_count = count - take.size
        self.changed = True

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
        its window no longer reads (``reconcile``)."""
        for group in self.groups:
            group.reconcile(table)

    def begin(self, step, table, device, attention) -> None:
        """Each windowed group holds the blocks its window reads (``reconcile``), then its
        table and per-token blocks are gathered on the device; ``attention`` (the step's
        metadata) gets ``kv_group_block_tables`` (group 0's table first) and
        ``kv_group_of_layer`` (each attention layer's group, 0-based layers)."""
        for group in self.groups:
            group.reconcile(table)
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
    of ``windowed_blocks``; ``cache``: ``KVCache``'s other arguments."""
    main = KVCache(layers=len(spec.layers[0]), total_blocks=main_blocks, block_size=block_size,
                   **cache)
    groups = []
    for g, blocks in enumerate(windowed_blocks, start=1):
        groups.append(WindowedGroup(
            window=spec.windows[g], blocks=blocks, main_blocks=main_blocks,
            main_dummy=main_blocks - 1, block_size=block_size, max_requests=max_requests,
            columns=columns, max_tokens=max_tokens, device=cache["device"],
            cache=KVCache(layers=len(spec.layers[g]), total_blocks=blocks,
                          block_size=block_size, **cache)))
    return GroupedKV(spec, main, groups)


def kv_group_usage(kv: Any) -> Optional[dict]:
    """What each KV group holds now (``ctx.kv_group_usage()``), or None for a context without
    groups: ``windows``, ``layers`` (attention layers per group), ``blocks`` (each pool, its
    dummy included), ``held`` (blocks held now, dummies not counted), ``block_bytes`` (one block
    of the group, all its layers) and ``held_bytes`` (their sum over the held blocks)."""
    if not isinstance(kv, GroupedKV):
        return None
    allocator = kv.allocator
    held = [allocator.total_count - 1 - allocator.total_avail] + [g.held for g in kv.groups]
    block_bytes = [cache.nbytes() // cache.shape[2] for cache in kv.caches]
    return dict(windows=list(kv.spec.windows), layers=[len(m) for m in kv.spec.layers],
                blocks=[cache.shape[2] for cache in kv.caches], held=held,
                block_bytes=block_bytes,
                held_bytes=sum(h * b for h, b in zip(held, block_bytes)))
