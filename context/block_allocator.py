"""The KV block allocator: a host-side LIFO stack of block ids with reference counts.

The host knows every request's length, so block ids never need a device round trip: allocation
and release are numpy operations on the host. The Megatron-Core names take and give torch
tensors (``allocate_memory_blocks`` returns a CPU int32 tensor, ``release_memory_blocks`` takes
a tensor on any device, a numpy array or a list); the context itself uses the numpy form,
``allocate_memory_blocks_host``. Block ``dummy_block_idx`` (the last id) is never
handed out; padding tokens write into it. Reference counts (one per block) let several
requests share a block (prefix caching): ``share`` adds a reference and ``release`` returns a
block to the stack only when its last reference goes.

Prefix caching (``context/prefix_cache.py``) marks blocks ``cached``. Under the "lru" policy a
cached block whose last reference goes stays cached but free: it joins the *idle* section at the
bottom of the stack (``block_bag[:idle_count]``, the most recently released lowest), below the
uncached free blocks, so that allocation takes uncached blocks first and then evicts idle
cached blocks least recently released first (a request's tail blocks before its head).
``revive`` takes idle blocks back out of the stack for a cache hit. Under "ref_zero" (and
without caching) a freed block is uncached at once and the stack is the plain LIFO stack.
Every eviction (a cached block handed out again, or uncached at its last release) is reported
to ``on_evict`` (the prefix cache's digest table drops the block's digest).

The allocator takes what it needs at construction: its budgets, the policy, the eviction
listener, and the ``usage`` that answers Megatron-Core's ``get_active_used`` /
``get_paused_used`` (the request table, which owns the allocator: it is held by a weak
reference, so that the two make no reference cycle and a context is freed by reference counting
alone). ``StackSimulation`` and ``AllocatorSimulation`` replay an update plan's releases and
allocations without touching the allocator.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import numpy as np
import torch


def _block_ids(blocks: Any, name: str) -> np.ndarray:
    """``blocks`` as a flat integer numpy array (a device tensor is copied to the host: a
    sync). An integer numpy array, the context's own form, is used as it is."""
    if isinstance(blocks, np.ndarray) and blocks.dtype.kind in "iu":
        return blocks.reshape(-1)
    if isinstance(blocks, torch.Tensor):
        if blocks.is_floating_point() or blocks.is_complex() or blocks.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer block ids, got dtype {blocks.dtype}")
        blocks = blocks.detach().to("cpu").numpy()
    array = np.asarray(blocks)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer block ids, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False).reshape(-1)


def check_count(name: str, value: Any) -> None:
    """A block count argument: an int >= 0 (``TypeError``/``ValueError`` naming it)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")


def check_counts(total_count: Any, paused_count: Any) -> None:
    """The block counts of an allocator are ints (``TypeError`` naming each)."""
    for name, value in (("total_count", total_count), ("paused_count", paused_count)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}={value!r} must be an int")


class BlockAllocator:
    """LIFO stack of free block ids (recently released blocks are reused first).

    Args:
        total_count: blocks in the buffer, the dummy block included.
        paused_count: the paused-request budget in blocks.
        usage: what the budgets are used by: an object with ``active_used_blocks()`` and
            ``paused_used_blocks()`` (the request table), held by a weak reference; None (or
            gone): nothing uses them.
        keeps_idle_blocks: the "lru" prefix caching policy (idle cached blocks stay cached).
        on_evict: called with the blocks that leave the cache (int32 array).
    """

    def __init__(self, total_count: int, paused_count: int, *, usage: Any = None,
                 keeps_idle_blocks: bool = False,
                 on_evict: Optional[Callable[[np.ndarray], None]] = None):
        check_counts(total_count, paused_count)
        if total_count < 2:
            raise ValueError(f"total_count={total_count} must be >= 2 (one block is the dummy)")
        if not 0 <= paused_count <= total_count - 2:
            raise ValueError(f"paused_count={paused_count} must lie in [0, total_count - 2 = "
                             f"{total_count - 2}] so that at least one active block remains")
        self.total_count = int(total_count)
        self.paused_count = int(paused_count)
        self.active_count = self.total_count - self.paused_count - 1
        self.dummy_block_idx = self.total_count - 1
        self._usage = None if usage is None else weakref.ref(usage)
        self.keeps_idle_blocks = bool(keeps_idle_blocks)
        self.on_evict = on_evict
        # The prefix cache's host tier (``host_tier.HostTier.spill``), set after construction.
        self.on_spill: Optional[Callable[[np.ndarray, np.ndarray], None]] = None
        self.reset()

    def _hashes(self, blocks: np.ndarray) -> np.ndarray:
        """0.19's hashes of ``blocks`` (``KVBlockAllocator``'s column; -1 here)."""
        return np.full(blocks.size, -1, dtype=np.int64)

    def reset(self) -> None:
        """Every block free again (the stack is rebuilt, so stale duplicates cannot survive).
        The cached blocks are evicted (``on_evict``): a reset by hand must not leave the prefix
        cache naming blocks that allocation hands out again."""
        cached = getattr(self, "cached", None)
        if cached is not None and cached.any():
            self._evict(np.flatnonzero(cached).astype(np.int32))
        self.block_bag = np.arange(self.total_count, dtype=np.int32)
        self.ref_counts = np.zeros(self.total_count, dtype=np.int32)
        self._total_avail = self.total_count - 1
        self.cached = np.zeros(self.total_count, dtype=bool)
        self.idle_count = 0

    def _evict(self, blocks: np.ndarray, spill: bool = False) -> None:
        """Uncache ``blocks`` (those cached) and tell ``on_evict``; ``spill``: their bytes are
        still the cached ones (reused or released, not freed by hand), so ``on_spill`` (the
        prefix cache's host tier) is told first, with their 0.19 hashes."""
        blocks = blocks[self.cached[blocks]]
        if blocks.size:
            if spill and self.on_spill is not None:
                self.on_spill(blocks, self._hashes(blocks))
            self.cached[blocks] = False
            if self.on_evict is not None:
                self.on_evict(blocks)

    @property
    def total_avail(self) -> int:
        """Free blocks: ``block_bag[:total_avail]`` is the free stack, its top last."""
        return self._total_avail

    @total_avail.setter
    def total_avail(self, value: int) -> None:
        """Move the top of the stack by hand, as Megatron-Core code does (its allocator is the
        same stack without reference counts): lowering it takes the blocks
        ``block_bag[value:total_avail]`` (one reference each), raising it frees
        ``block_bag[total_avail:value]`` whatever their references. Raising it undoes a
        lowering; otherwise it frees whatever ids lie above the top, as Megatron's does."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"total_avail={value!r} must be an int")
        if not 0 <= value <= self.total_count - 1:
            raise ValueError(f"total_avail={value} must lie in [0, total_count - 1 = "
                             f"{self.total_count - 1}] (the dummy block is never free)")
        old = self._total_avail
        if value < old:
            taken = self.block_bag[value:old]
            self.ref_counts[taken] = 1
            if value < self.idle_count:
                self.idle_count = int(value)
            self._evict(taken)
        else:
            freed = self.block_bag[old:value]
            self.ref_counts[freed] = 0
            self._evict(freed)  # freed by hand: their bytes are no longer vouched for
        self._total_avail = int(value)

    def get_active_used(self) -> int:
        """Blocks the active requests use against the active budget (Megatron-Core's name)."""
        usage = None if self._usage is None else self._usage()
        return 0 if usage is None else usage.active_used_blocks()

    def get_paused_used(self) -> int:
        """Blocks the paused requests use against the paused budget."""
        usage = None if self._usage is None else self._usage()
        return 0 if usage is None else usage.paused_used_blocks()

    def get_active_avail(self) -> int:
        return self.active_count - self.get_active_used()

    def get_paused_avail(self) -> int:
        return self.paused_count - self.get_paused_used()

    def is_memory_available(self, num_blocks: int) -> bool:
        return self._total_avail >= num_blocks

    def allocate_memory_blocks(self, num_blocks: int) -> torch.Tensor | None:
        """Pop ``num_blocks`` ids (ascending stack order) as a 1-D int32 CPU tensor, or None
        when too few are free (Megatron-Core's call; its tensor lives on the GPU, ours on the
        host, where the allocator is)."""
        blocks = self.allocate_memory_blocks_host(num_blocks)
        return None if blocks is None else torch.from_numpy(blocks)

    def allocate_memory_blocks_host(self, num_blocks: int) -> np.ndarray | None:
        """``allocate_memory_blocks`` as an int32 numpy array (what the context uses)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise TypeError(f"num_blocks={num_blocks!r} must be an int")
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        if num_blocks > self._total_avail:
            return None
        self._total_avail -= num_blocks
        blocks = self.block_bag[self._total_avail:self._total_avail + num_blocks].copy()
        self.ref_counts[blocks] = 1
        if self._total_avail < self.idle_count:
            # The uncached free blocks ran out: the least recently used idle blocks go.
            self.idle_count = self._total_avail
            self._evict(blocks, spill=True)
        return blocks

    def revive(self, blocks: np.ndarray) -> None:
        """Take idle cached blocks (free, reference count 0) out of the stack with one
        reference each: a cache hit on them. The other free blocks keep their order."""
        blocks = np.asarray(blocks, dtype=np.int32).reshape(-1)
        if blocks.size == 0:
            return
        idle = self.block_bag[:self.idle_count]
        hit = np.isin(idle, blocks)
        if int(hit.sum()) != blocks.size or np.unique(blocks).size != blocks.size:
            raise RuntimeError(f"revive() of blocks that are not idle cached blocks: "
                               f"{blocks.tolist()}")
        avail, r = self._total_avail, blocks.size
        free = self.block_bag[:avail]
        keep = np.concatenate([idle[~hit], free[self.idle_count:]])
        self.block_bag[:avail - r] = keep
        self.block_bag[avail - r:avail] = blocks
        self.idle_count -= r
        self._total_avail -= r
        self.ref_counts[blocks] = 1

    def share(self, blocks: Any) -> None:
        """Add a reference to blocks already owned (for shared prefixes)."""
        blocks = _block_ids(blocks, "blocks")
        if np.any((blocks < 0) | (blocks >= self.total_count)):
            raise ValueError(f"share() of block ids {blocks.tolist()}: each must lie in "
                             f"[0, total_count={self.total_count})")
        if np.any(self.ref_counts[blocks] <= 0):
            raise ValueError("share() of a block that is not allocated")
        np.add.at(self.ref_counts, blocks, 1)

    def release_memory_blocks(self, blocks: Any) -> None:
        """Drop one reference per id (``-1`` entries ignored); free ids go back on the stack.

        ``blocks``: a tensor on any device (a device tensor costs one copy to the host), a
        numpy array or a sequence of ints."""
        blocks = _block_ids(blocks, "blocks")
        if np.any(blocks < -1):
            raise ValueError(f"release of block ids {blocks[blocks < -1].tolist()}: each must "
                             "lie in [0, total_count) (-1, an empty entry, is skipped)")
        blocks = blocks[blocks >= 0]
        if blocks.size == 0:
            return
        if blocks.max() >= self.total_count:
            raise ValueError(f"release of block ids {blocks[blocks >= self.total_count].tolist()} "
                             f">= total_count={self.total_count}")
        if np.any(self.ref_counts[blocks] <= 0) or np.any(blocks == self.dummy_block_idx):
            raise RuntimeError(f"release of blocks that are not allocated: {blocks.tolist()}")
        np.subtract.at(self.ref_counts, blocks, 1)
        if self.ref_counts[blocks].min() < 0:   # a block listed more times than it is held
            np.add.at(self.ref_counts, blocks, 1)   # (as it was: the check costs no np.unique)
            ids, times = np.unique(blocks, return_counts=True)
            over = times > self.ref_counts[ids]
            raise RuntimeError(f"release of blocks {ids[over].tolist()} {times[over].tolist()} "
                               f"times, more than their references "
                               f"{self.ref_counts[ids[over]].tolist()}")
        freed = blocks[self.ref_counts[blocks] == 0]
        # A block listed twice with two references must be pushed once.
        if freed.size > 1:
            _, first = np.unique(freed, return_index=True)
            freed = freed[np.sort(first)]
        avail = self._total_avail
        if self.keeps_idle_blocks:
            idle = freed[self.cached[freed]]
            freed = freed[~self.cached[freed]]
            if idle.size:
                # Idle cached blocks go to the bottom of the stack (most recently released:
                # evicted last), a request's blocks in chain order (its tail evicted first).
                k = idle.size
                self.block_bag[k:avail + k] = self.block_bag[:avail].copy()
                self.block_bag[:k] = idle
                self.idle_count += k
                avail += k
        else:
            self._evict(freed, spill=True)
        self.block_bag[avail:avail + freed.size] = freed
        self._total_avail = avail + int(freed.size)

    def note_cached(self, blocks: np.ndarray, hashes: np.ndarray, parents: np.ndarray) -> None:
        """Mark ``blocks`` cached (the prefix cache publishes them); ``hashes`` and
        ``parents`` (Megatron-Core 0.19's hashes and parent block ids) are for
        ``KVBlockAllocator``'s columns."""
        self.cached[blocks] = True

    def forget_cached(self, blocks: np.ndarray) -> None:
        """Take back ``note_cached`` (no eviction: the blocks were never seen cached)."""
        self.cached[blocks] = False

    def clone(self) -> "BlockAllocator":
        """A copy of the stack, the reference counts and the cached marks, detached from
        ``on_evict`` (a plan simulates its releases and allocations on it)."""
        copy = object.__new__(BlockAllocator)
        copy.__dict__.update(self.__dict__)
        copy.block_bag, copy.ref_counts = self.block_bag.copy(), self.ref_counts.copy()
        copy.cached, copy.on_evict, copy.on_spill = self.cached.copy(), None, None
        return copy

    def get_total_used(self) -> int:
        return self.total_count - 1 - self._total_avail

    def __str__(self) -> str:
        return (f"using: total {self.get_total_used()}/{self.total_count - 1}; "
                f"active budget {self.active_count}; paused budget {self.paused_count}")


class AllocatorSimulation:
    """The allocator's releases and allocations replayed on a ``clone`` (the plan of an
    ``update_requests`` under the "lru" prefix caching policy, whose idle section the plain
    stack simulation does not model); ``ops`` lists them for the commit to replay."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self._clone = allocator.clone()
        self.ops: list = []

    @property
    def total_avail(self) -> int:
        return self._clone.total_avail

    def release(self, blocks: np.ndarray) -> None:
        blocks = blocks[(blocks >= 0) & (blocks != self.allocator.dummy_block_idx)].astype(np.int32)
        if blocks.size == 0:
            return
        self.ops.append(("release", blocks))
        self._clone.release_memory_blocks(blocks)

    def allocate(self, count: int) -> np.ndarray:
        self.ops.append(("allocate", count))
        return self._clone.allocate_memory_blocks_host(count)


class StackSimulation:
    """The allocator's LIFO stack as it would be after a plan's releases and allocations,
    without touching it: the untouched bottom ``bag[:avail]`` plus an overlay of pushed ids
    (the plain stack: without the "lru" idle section, which ``AllocatorSimulation`` models);
    ``ops`` lists them for the commit to replay."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.base_avail = allocator.total_avail
        self.overlay = np.empty(0, dtype=np.int32)
        self.released = np.empty(0, dtype=np.int32)
        self.ops: list = []

    @property
    def total_avail(self) -> int:
        return self.base_avail + self.overlay.size

    def release(self, blocks: np.ndarray) -> None:
        """As ``BlockAllocator.release_memory_blocks``: drop one reference per id; the ids
        whose last reference goes are pushed once, in order of first mention."""
        # The dummy block (rows of dummy requests) is never allocated: nothing to release.
        blocks = blocks[(blocks >= 0) & (blocks != self.allocator.dummy_block_idx)].astype(np.int32)
        if blocks.size == 0:
            return
        self.ops.append(("release", blocks))
        left = self.allocator.ref_counts[blocks].astype(np.int64)
        if self.released.size:
            done = np.sort(self.released)
            left -= (np.searchsorted(done, blocks, "right") - np.searchsorted(done, blocks, "left"))
        self.released = np.concatenate([self.released, blocks])
        _, inverse, counts = np.unique(blocks, return_inverse=True, return_counts=True)
        freed = blocks[left - counts[inverse] == 0]
        if freed.size > 1:
            _, first = np.unique(freed, return_index=True)
            freed = freed[np.sort(first)]
        self.overlay = np.concatenate([self.overlay, freed])

    def allocate(self, count: int) -> np.ndarray:
        self.ops.append(("allocate", count))
        if count <= self.overlay.size:
            blocks = self.overlay[self.overlay.size - count:]
            self.overlay = self.overlay[:self.overlay.size - count]
            return blocks
        below = count - self.overlay.size
        bag = self.allocator.block_bag
        blocks = np.concatenate([bag[self.base_avail - below:self.base_avail], self.overlay])
        self.base_avail -= below
        self.overlay = np.empty(0, dtype=np.int32)
        return blocks
