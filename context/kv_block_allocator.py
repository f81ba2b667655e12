"""Megatron-Core 0.19's ``KVBlockAllocator`` (``megatron/core/inference/contexts/
kv_block_allocator.py`` at tag ``core_v0.19.0``): dynctx's ``BlockAllocator`` under 0.19's
constructor and prefix-caching names.

One allocator, one stack: the 0.19 names are views of ``BlockAllocator``'s own state or a column
beside it, never a second copy of it (docs/SEMANTICS.md §16 row 43).

* ``block_ref_counts`` is ``ref_counts`` as a torch tensor (shared memory: a write through it is
  a write to the allocator); ``block_bag`` and ``total_avail`` are the allocator's own
  (``block_bag`` an int32 numpy array where 0.19's is a CPU tensor).
* ``block_hashes`` is the int64 column ``hash_ids`` beside the ``cached`` mark: 0.19's hash of
  each cached block (``compute_block_hashes_batched``; the prefix cache publishes it with the
  block, whose matching stays on its salted digests), -1 for the rest. ``kv_hash_to_block_id``
  is computed from it on each read. Under "lru", ``block_parent_id``, ``block_child_count`` and
  ``block_timestamps`` are columns too (the stamp is the context's ``prefix_cache_lru_clock`` at
  allocation and at a hit). Every eviction (``_evict``) clears a block's columns.
* Eviction order: dynctx's allocation takes idle cached blocks from the bottom of its stack,
  least recently released first (a request's tail first, row 30); 0.19's leaf-first
  ``evict_lru_blocks(n)`` over the timestamps is there for callers that ask for it.
  ``total_avail`` counts idle cached blocks as free (row 30), so ``is_memory_available`` adds the
  evictable blocks that are not in the stack (only a hand-written state has any) and takes away
  ``potential_matched_count``.
* ``block_routing``: 0.19's per-block MoE routing storage (host numpy arrays), cleared for a
  block when it is handed out again and on ``reset``.

Built on its own, as 0.19's tests build it, the allocator reads its usage from a duck-typed
``context`` (``paused_request_count``, ``total_request_count``, ``request_kv_block_counts``,
``request_to_kv_block_ids``; distinct block ids with prefix caching); the context's own
allocator reads the request table (``usage``) and holds the context by a weak reference.
"""

from __future__ import annotations

import heapq
import weakref
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from .block_allocator import BlockAllocator, _block_ids, check_count, check_counts
from .inputs import check_block_routing
from .megatron019 import ConfigAssertionError
from .prefix_cache import PrefixCachingEvictionPolicy

__all__ = ["KVBlockAllocator"]


def _policy(value: Any) -> PrefixCachingEvictionPolicy:
    try:
        return PrefixCachingEvictionPolicy(value)
    except ValueError:
        raise ValueError(f"prefix_caching_eviction_policy={value!r} must be one of "
                         f"{[p.value for p in PrefixCachingEvictionPolicy]}") from None


class KVBlockAllocator(BlockAllocator):
    """0.19's constructor: ``KVBlockAllocator(context, total_count, paused_count,
    enable_prefix_caching=False, prefix_caching_eviction_policy=REF_ZERO)``.

    Args:
        context: what 0.19's allocator reads (its usage counts, ``prefix_cache_lru_clock``,
            and for routing ``block_size_tokens`` and the step's token-to-block arrays); None
            until ``attach``.
        total_count: blocks in the buffer, the dummy block included.
        paused_count: the paused budget in blocks; ``total_count - paused_count - 1 >= 1``
            (0.19's assertion: ``ConfigAssertionError``, a ``ValueError`` and an
            ``AssertionError``).
        usage: the request table (dynctx's context); None: the usage is read from ``context``.
        on_evict: called with the blocks that leave the cache (the digest table's ``forget``).
    """

    def __init__(self, context: Any, total_count: int, paused_count: int,
                 enable_prefix_caching: bool = False,
                 prefix_caching_eviction_policy: Any = PrefixCachingEvictionPolicy.REF_ZERO, *,
                 usage: Any = None, on_evict: Optional[Callable[[np.ndarray], None]] = None):
        policy = _policy(prefix_caching_eviction_policy)
        check_counts(total_count, paused_count)
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise TypeError(f"enable_prefix_caching={enable_prefix_caching!r} must be a bool")
        if total_count >= 2 and total_count - paused_count - 1 < 1:
            raise ConfigAssertionError(
                f"paused_count={paused_count} must lie in [0, total_count - 2 = "
                f"{total_count - 2}] so that at least one active block remains (0.19 asserts "
                f"active_count >= 1)")
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.prefix_caching_eviction_policy = policy
        self.on_blocks_deregistered: Optional[Callable] = None
        self.block_routing: Dict[int, np.ndarray] = {}
        self._context_ref: Any = (lambda: context)
        lru = self.enable_prefix_caching and policy is PrefixCachingEvictionPolicy.LRU
        super().__init__(total_count, paused_count, usage=usage, keeps_idle_blocks=lru,
                         on_evict=on_evict)

    # ------------------------------------------------------------------ the context
    @property
    def context(self) -> Any:
        """The context 0.19's methods read (None: none attached, or it is gone)."""
        return self._context_ref()

    def attach(self, context: Any) -> "KVBlockAllocator":
        """Read ``context`` from now on (held by a weak reference: the context owns the
        allocator); returns the allocator."""
        try:
            self._context_ref = weakref.ref(context)
        except TypeError:   # None, an int, ...: nothing a weak reference can hold
            raise TypeError(f"attach(context={context!r}): context must be the context the "
                            "allocator reads (an object with its request table)") from None
        return self

    def _set_total_avail(self, value: int) -> None:
        """``BlockAllocator.total_avail``'s setter, but a block cached by hand while free (0.19's
        tests register hashes on free blocks, then lower ``total_avail``) leaves the stack
        still cached, with its reference count: an evictable block outside the stack, as in
        0.19."""
        old = self._total_avail
        hand = np.empty(0, dtype=np.int32)
        if self.enable_prefix_caching and isinstance(value, (int, np.integer)) \
                and not isinstance(value, bool) and 0 <= value < old:
            taken = self.block_bag[int(value):old]
            hand = taken[self.cached[taken]].copy()
        refs = self.ref_counts[hand].copy()
        self.cached[hand] = False
        try:
            BlockAllocator.total_avail.fset(self, value)
        finally:
            self.cached[hand] = True
            self.ref_counts[hand] = refs

    total_avail = property(BlockAllocator.total_avail.fget, _set_total_avail)

    @property
    def _lru(self) -> bool:
        return self.keeps_idle_blocks

    def _clock(self) -> int:
        return int(getattr(self.context, "prefix_cache_lru_clock", 0))

    # ------------------------------------------------------------------ 0.19's names
    def _prefix_state(self, name: str, lru_only: bool = False):
        if not self.enable_prefix_caching or (lru_only and not self._lru):
            raise AttributeError(
                f"{name} exists with prefix caching on"
                + (" under the 'lru' policy" if lru_only else "") + " (as in Megatron-Core 0.19)")

    @property
    def block_ref_counts(self) -> torch.Tensor:
        """int32 ``[total_count]``: the reference counts (a view: writes go through)."""
        self._prefix_state("block_ref_counts")
        return torch.from_numpy(self.ref_counts)

    @property
    def block_hashes(self) -> torch.Tensor:
        """int64 ``[total_count]``: 0.19's hash of each cached block, -1 otherwise (a view)."""
        self._prefix_state("block_hashes")
        return torch.from_numpy(self.hash_ids)

    @property
    def kv_hash_to_block_id(self) -> Dict[int, int]:
        """0.19's hash -> block id of the cached blocks, computed on each read."""
        self._prefix_state("kv_hash_to_block_id")
        blocks = np.flatnonzero(self.hash_ids != -1)
        return dict(zip(self.hash_ids[blocks].tolist(), blocks.tolist()))

    @property
    def block_timestamps(self) -> torch.Tensor:
        self._prefix_state("block_timestamps", lru_only=True)
        return torch.from_numpy(self.timestamps)

    @property
    def block_parent_id(self) -> torch.Tensor:
        self._prefix_state("block_parent_id", lru_only=True)
        return torch.from_numpy(self.parent_ids)

    @property
    def block_child_count(self) -> torch.Tensor:
        self._prefix_state("block_child_count", lru_only=True)
        return torch.from_numpy(self.child_counts)

    # ------------------------------------------------------------------ lifetime
    def reset(self) -> None:
        """Every block free, uncached, without routing (``BlockAllocator.reset``)."""
        if getattr(self, "hash_ids", None) is None:
            self._new_columns()
        super().reset()
        self._new_columns()
        self.block_routing.clear()

    def _new_columns(self) -> None:
        n = self.total_count
        self.hash_ids = np.full(n, -1, dtype=np.int64)
        self.parent_ids = np.full(n, -1, dtype=np.int64)
        self.child_counts = np.zeros(n, dtype=np.int64)
        self.timestamps = np.zeros(n, dtype=np.int64)

    def _hashes(self, blocks: np.ndarray) -> np.ndarray:
        return self.hash_ids[blocks].copy()

    def _evict(self, blocks: np.ndarray, spill: bool = False) -> None:
        """Uncache ``blocks`` (those cached): ``on_spill`` is told first (``spill``), then
        their columns are cleared, their children become roots, ``on_blocks_deregistered``
        and ``on_evict`` are told."""
        blocks = blocks[self.cached[blocks]]
        if blocks.size == 0:
            return
        if spill and self.on_spill is not None:
            self.on_spill(blocks, self._hashes(blocks))
        parents = self.parent_ids[blocks]
        np.subtract.at(self.child_counts, parents[parents >= 0], 1)
        if self.child_counts[blocks].any():
            self.parent_ids[np.isin(self.parent_ids, blocks)] = -1
        hashes = set(self.hash_ids[blocks].tolist()) - {-1}
        self.parent_ids[blocks] = -1
        self.child_counts[blocks] = 0
        self.timestamps[blocks] = 0
        self.hash_ids[blocks] = -1
        if self.on_blocks_deregistered is not None:
            self.on_blocks_deregistered(blocks.tolist(), hashes)
        super()._evict(blocks)

    # ------------------------------------------------------------------ usage
    def get_active_used(self) -> int:
        """Active usage: the request table's, or 0.19's count over the duck-typed context."""
        if self._usage is not None:
            return super().get_active_used()
        ctx = self.context
        if ctx is None:
            return 0
        return self._used(ctx, ctx.paused_request_count, ctx.total_request_count)

    def get_paused_used(self) -> int:
        if self._usage is not None:
            return super().get_paused_used()
        ctx = self.context
        if ctx is None:
            return 0
        return self._used(ctx, 0, ctx.paused_request_count)

    def _used(self, ctx: Any, start: int, end: int) -> int:
        if not self.enable_prefix_caching:
            return int(ctx.request_kv_block_counts[start:end].sum().item())
        if end <= start:
            return 0
        rows = ctx.request_to_kv_block_ids[start:end]
        return int(torch.unique(rows[rows >= 0]).numel())

    # ------------------------------------------------------------------ allocation
    def get_evictable_block_count(self) -> torch.Tensor:
        """Cached blocks without references (0.19: a 0-d tensor)."""
        if not self.enable_prefix_caching:
            return torch.tensor(0)
        return torch.tensor(int(((self.ref_counts == 0) & (self.hash_ids != -1)).sum()))

    def is_memory_available(self, num_blocks: int, potential_matched_count: int = 0) -> bool:
        """Whether ``num_blocks`` can be allocated once ``potential_matched_count`` evictable
        blocks (prefix matches about to be pinned) are taken out; idle cached blocks are in
        ``total_avail`` already."""
        check_count("num_blocks", num_blocks)
        check_count("potential_matched_count", potential_matched_count)
        if self._total_avail - potential_matched_count >= num_blocks:
            return True
        if not self._lru:
            return False
        outside = int(((self.ref_counts == 0) & (self.hash_ids != -1)).sum()) - self.idle_count
        return self._total_avail + outside - potential_matched_count >= num_blocks

    def allocate_memory_blocks_host(self, num_blocks: int) -> np.ndarray | None:
        """``BlockAllocator.allocate_memory_blocks_host``; under "lru" the blocks are stamped
        with the clock, and a stack too short for ``num_blocks`` first evicts (0.19's
        ``evict_lru_blocks``) the evictable blocks that are not in it. Routing is cleared."""
        if self._lru and isinstance(num_blocks, (int, np.integer)) \
                and not isinstance(num_blocks, bool) and num_blocks > self._total_avail:
            outside = int(((self.ref_counts == 0) & (self.hash_ids != -1)).sum()) \
                - self.idle_count
            if outside >= num_blocks - self._total_avail:
                self._evict_outside(num_blocks - self._total_avail)
        blocks = super().allocate_memory_blocks_host(num_blocks)
        if blocks is not None:
            if self.enable_prefix_caching:
                self._evict(blocks)  # a block cached by hand while free leaves the cache
            if self._lru:
                self.timestamps[blocks] = self._clock()
            if self.block_routing:
                for block in blocks.tolist():
                    self.block_routing.pop(block, None)
        return blocks

    def revive(self, blocks: np.ndarray) -> None:
        """``BlockAllocator.revive``; an evictable block outside the stack (0.19's, where
        ``total_avail`` was lowered by hand) just takes its reference."""
        blocks = np.asarray(blocks, dtype=np.int32).reshape(-1)
        inside = np.isin(blocks, self.block_bag[:self.idle_count])
        outside = blocks[~inside]
        if outside.size and (np.any(self.ref_counts[outside] != 0)
                             or not self.cached[outside].all()):
            raise RuntimeError(f"revive() of blocks that are not idle cached blocks: "
                               f"{outside.tolist()}")
        super().revive(blocks[inside])
        self.ref_counts[outside] = 1
        self.update_timestamps(blocks)

    def share(self, blocks: Any) -> None:
        super().share(blocks)
        self.update_timestamps(_block_ids(blocks, "blocks"))

    def update_timestamps(self, block_ids: Any) -> None:
        """Stamp ``block_ids`` with the context's ``prefix_cache_lru_clock`` ("lru" only)."""
        if not self._lru:
            return
        blocks = _block_ids(block_ids, "block_ids")
        if np.any((blocks < 0) | (blocks >= self.total_count)):
            raise ValueError(f"block_ids={blocks.tolist()}: each must lie in [0, "
                             f"{self.total_count})")
        if blocks.size:
            self.timestamps[blocks] = self._clock()

    # ------------------------------------------------------------------ prefix caching
    def register_kv_block_hashes(self, block_ids: Any, block_hashes: Any,
                                 parent_hashes: Any = None) -> None:
        """Cache ``block_ids`` under 0.19's ``block_hashes`` (parents: their parents' hashes,
        0 for a root; they steer "lru" eviction). Every argument is checked first."""
        self._prefix_state("register_kv_block_hashes")
        blocks = _block_ids(block_ids, "block_ids")
        hashes = _block_ids(block_hashes, "block_hashes")
        if blocks.size == 0:
            return
        if hashes.size != blocks.size:
            raise ConfigAssertionError(f"block_hashes has {hashes.size} entries, block_ids "
                                       f"{blocks.size}")
        if np.any((blocks < 0) | (blocks >= self.dummy_block_idx)):
            raise ValueError(f"block_ids={blocks.tolist()}: each must lie in [0, "
                             f"{self.dummy_block_idx}) (the dummy block is never cached)")
        if np.unique(blocks).size != blocks.size:
            raise ValueError(f"block_ids={blocks.tolist()}: each block at most once (one hash "
                             "a block)")
        if np.any(hashes < 1):
            raise ValueError(f"block_hashes={hashes.tolist()}: each must be >= 1 (0.19's hashes "
                             "are; -1 marks an uncached block, 0 a root's parent)")
        if parent_hashes is not None:
            parent_hashes = _block_ids(parent_hashes, "parent_hashes")
            if parent_hashes.size != blocks.size:
                raise ConfigAssertionError(f"parent_hashes has {parent_hashes.size} entries, "
                                           f"block_ids {blocks.size}")
            if np.any(parent_hashes < 0):
                raise ValueError(f"parent_hashes={parent_hashes.tolist()}: each must be >= 0 "
                                 "(0: a root)")
        known = self.kv_hash_to_block_id
        known.update(zip(hashes.tolist(), blocks.tolist()))
        parents = np.full(blocks.size, -1, dtype=np.int64)
        if parent_hashes is not None:
            parents = np.asarray([known.get(h, -1) if h != 0 else -1
                                  for h in parent_hashes.tolist()], dtype=np.int64)
        self.note_cached(blocks, hashes, parents)

    def note_cached(self, blocks: np.ndarray, hashes: np.ndarray, parents: np.ndarray) -> None:
        """Mark ``blocks`` cached with 0.19's ``hashes`` and parent block ids (-1: a root);
        what the prefix cache calls as it publishes blocks."""
        self.cached[blocks] = True
        self.hash_ids[blocks] = hashes
        if self._lru:
            self.parent_ids[blocks] = parents
            np.add.at(self.child_counts, parents[parents >= 0], 1)

    def forget_cached(self, blocks: np.ndarray) -> None:
        """Take back ``note_cached`` (the prefix cache's ``undo_publish``), without eviction
        callbacks: the blocks were never seen cached."""
        parents = self.parent_ids[blocks]
        np.subtract.at(self.child_counts, parents[parents >= 0], 1)
        self.parent_ids[blocks] = -1
        self.hash_ids[blocks] = -1
        self.cached[blocks] = False

    def _deregister_blocks(self, blocks: np.ndarray) -> None:
        """0.19's deregistration: ``blocks`` (cached, without references) leave the cache
        and are free: idle ones stay in the stack, above the idle section; others are pushed
        unless already in the free stack."""
        idle = self.block_bag[:self.idle_count]
        hit = np.isin(idle, blocks)
        avail = self._total_avail
        if hit.any():
            self.block_bag[:avail] = np.concatenate(
                [idle[~hit], idle[hit], self.block_bag[self.idle_count:avail]])
            self.idle_count = int((~hit).sum())
        self.ref_counts[blocks] = 0
        self._evict(blocks, spill=True)
        pushed = blocks[~np.isin(blocks, self.block_bag[:avail])]
        self.block_bag[avail:avail + pushed.size] = pushed
        self._total_avail = avail + int(pushed.size)

    def _evict_outside(self, count: int) -> None:
        candidates = (self.ref_counts == 0) & (self.hash_ids != -1)
        candidates[self.block_bag[:self.idle_count]] = False
        self._peel(np.flatnonzero(candidates), count)

    def evict_lru_blocks(self, num_blocks_needed: int) -> bool:
        """0.19's leaf-first LRU eviction of ``num_blocks_needed`` cached blocks without
        references: the oldest leaf (own timestamp, then block id) goes first, so that no
        cached block outlives its parent. False (nothing changes) when too few are cached; a
        cyclic parent graph raises ``AssertionError``."""
        self._prefix_state("evict_lru_blocks", lru_only=True)
        check_count("num_blocks_needed", num_blocks_needed)
        cached = np.flatnonzero((self.ref_counts == 0) & (self.hash_ids != -1))
        if cached.size < num_blocks_needed:
            return False
        if num_blocks_needed > 0:
            self._peel(cached, int(num_blocks_needed))
        return True

    def _peel(self, cached: np.ndarray, count: int) -> None:
        local = {block: i for i, block in enumerate(cached.tolist())}
        stamps = self.timestamps[cached].tolist()
        parent = [local.get(p, -1) for p in self.parent_ids[cached].tolist()]
        children = self.child_counts[cached].tolist()
        heap = [(stamps[i], int(cached[i]), i) for i in range(cached.size) if children[i] == 0]
        heapq.heapify(heap)
        evicted = []
        while heap and len(evicted) < count:
            _, _, i = heapq.heappop(heap)
            evicted.append(i)
            p = parent[i]
            if p >= 0:
                children[p] -= 1
                if children[p] == 0:
                    heapq.heappush(heap, (stamps[p], int(cached[p]), p))
        if len(evicted) != count:
            raise AssertionError(
                f"leaf peel evicted {len(evicted)} of {count} requested from {cached.size} "
                f"cached blocks; the parent graph is not a forest (a block-hash collision)")
        self._deregister_blocks(cached[np.asarray(evicted, dtype=np.int64)])

    # ------------------------------------------------------------------ MoE routing
    def store_block_routing(self, block_id: int, positions: np.ndarray,
                            routing: np.ndarray) -> None:
        """Routing ``[len(positions), layers, topk]`` of ``positions`` of ``block_id``."""
        block_size = int(self.context.block_size_tokens)
        positions = check_block_routing(block_id, positions, routing, block_size=block_size,
                                        blocks=self.dummy_block_idx,
                                        existing=self.block_routing.get(block_id))
        if block_id not in self.block_routing:
            self.block_routing[block_id] = np.zeros(
                (block_size, routing.shape[-2], routing.shape[-1]), dtype=routing.dtype)
        self.block_routing[block_id][positions] = routing

    def get_block_routing(self, block_id: int) -> Optional[np.ndarray]:
        """``[block_size_tokens, layers, topk]`` of ``block_id``, or None."""
        return self.block_routing.get(block_id)

    def store_routing_per_block(self, flat_routing: Optional[np.ndarray]) -> None:
        """Scatter ``[active_token_count, layers, topk]`` routing (the step's token order)
        into the blocks the step's tokens sit in (the dummy block's padding skipped)."""
        if flat_routing is None:
            return
        ctx = self.context
        tokens = int(ctx.active_token_count)
        if tokens == 0:
            return
        if not isinstance(flat_routing, np.ndarray) or flat_routing.ndim != 3 \
                or flat_routing.shape[0] != tokens:
            got = getattr(flat_routing, "shape", type(flat_routing).__name__)
            raise ValueError(f"flat_routing is {got}, not a numpy array [active_token_count="
                             f"{tokens}, layers, topk] (the step's tokens)")
        blocks = np.asarray(ctx.token_to_block_idx[:tokens].cpu().numpy())
        clash = [b for b in np.unique(blocks).tolist() if b in self.block_routing
                 and self.block_routing[b].shape[1:] != flat_routing.shape[1:]]
        if clash:
            raise ValueError(f"flat_routing has [layers, topk]={list(flat_routing.shape[1:])}, "
                             f"the routing of blocks {clash} another")
        positions = np.asarray(ctx.token_to_local_position_within_kv_block[:tokens].cpu().numpy())
        order = np.argsort(blocks, kind="stable")
        unique, starts = np.unique(blocks[order], return_index=True)
        ends = np.append(starts[1:], tokens)
        for block, start, end in zip(unique.tolist(), starts.tolist(), ends.tolist()):
            if block != self.dummy_block_idx:
                rows = order[start:end]
                self.store_block_routing(block, positions[rows], flat_routing[rows])

    def reconstruct_routing_from_blocks(self, block_ids: Any,
                                        total_routing_tokens: int) -> Optional[np.ndarray]:
        """The routing of ``total_routing_tokens`` tokens over ``block_ids`` in order, or None
        when a block has none."""
        block_size = int(self.context.block_size_tokens)
        parts, collected = [], 0
        for block in list(block_ids):
            routing = self.get_block_routing(int(block))
            if routing is None:
                return None
            remaining = total_routing_tokens - collected
            if remaining <= 0:
                break
            take = min(block_size, remaining)
            parts.append(routing[:take])
            collected += take
        if not parts or collected != total_routing_tokens:
            return None
        return np.concatenate(parts, axis=0)

    def __str__(self) -> str:
        return (f"using: total {self.get_total_used()}/{self.total_count - 1}"
                f"; active {self.get_active_used()}/{self.active_count}"
                f"; paused {self.get_paused_used()}/{self.paused_count}")
