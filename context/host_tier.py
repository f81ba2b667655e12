"""The prefix cache's host tier: cached blocks (and hybrids' Mamba snapshots) that the device
must reuse move to the host block pool instead of vanishing (docs/SEMANTICS.md §21).

``HostTier`` (built by ``offload.Offload`` when prefix caching and a host pool are both on)
keeps the spilled blocks by digest, least recently used first, each as ``(host slot, parent
digest, token bytes, 0.19 hash)``, and a hybrid's spilled snapshots by digest (a host state
slot each). A digest lives in one tier at a time: the device's digest table or this one.

* ``spill`` is the block allocator's ``on_spill``: the cached blocks it evicts to hand them out
  again (or, under "ref_zero", at their last release) are copied to free host slots, in one
  gather and a copy per run of host slots, before their digests are forgotten; for room, the
  least recently spilled blocks are dropped first, never a swapped request's (a block that
  finds no room is not spilled: it goes as without the tier).
* ``pin`` (from ``PrefixCache.commit_add``) takes a hit's host blocks out of the index, so that
  the spills its own allocation causes cannot drop them; ``restore`` copies them into their new
  device blocks and frees their host slots (the prefix cache publishes the blocks again).
* ``spill_snapshots`` is ``MambaSnapshots``' hook for the snapshots it replaces;
  ``load_snapshot`` copies a host snapshot into a hit row's Mamba slot (the snapshot stays on
  the host, most recently used).
* ``drop_blocks``/``drop_states`` free host slots for a swap (``Offload.save_rows``): the
  spilled prefix blocks and snapshots go before any swapped request.

The tier holds the pool, the KV cache and the digest table, never the allocator, the prefix
cache or the Mamba states (which hold it): no reference cycle.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, NamedTuple, Sequence

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


class HostBlock(NamedTuple):
    """A spilled block: its host slot, chain link (parent digest, token bytes), 0.19 hash."""

    slot: int
    parent: bytes
    data: bytes
    hash: int


@dataclass
class HostTierStats:
    """Counters (they survive ``clear``)."""

    spilled_blocks: int = 0
    restored_blocks: int = 0
    dropped_blocks: int = 0
    unspilled_blocks: int = 0
    spilled_snapshots: int = 0
    restored_snapshots: int = 0
    dropped_snapshots: int = 0

    def as_dict(self) -> dict:
        return {f"kv_offload_prefix_{name}": value for name, value in vars(self).items()}


class HostTier:
    """Spilled prefix blocks and Mamba snapshots in a ``HostBlockPool`` (module docstring).

    Args:
        pool: the host block pool (shared with the swapped requests); kv: the ``KVCache``;
        digests: the prefix cache's ``DigestTable`` (digest of each cached device block).
    """

    def __init__(self, pool, kv, digests):
        self.pool, self.kv, self.digests = pool, kv, digests
        self.blocks: "OrderedDict[bytes, HostBlock]" = OrderedDict()
        self.snapshots: "OrderedDict[bytes, int]" = OrderedDict()
        self.stats = HostTierStats()

    # ------------------------------------------------------------------ lifetime
    def clear(self) -> None:
        """Forget every spilled block and snapshot (their slots go back to the pool)."""
        self.pool.give(self.owned_blocks(), self.owned_states())
        self.blocks.clear()
        self.snapshots.clear()

    def forget(self) -> None:
        """Forget the index only (the pool itself was reset)."""
        self.blocks.clear()
        self.snapshots.clear()

    def owned_blocks(self) -> np.ndarray:
        return np.fromiter((b.slot for b in self.blocks.values()), dtype=np.int64,
                           count=len(self.blocks))

    def owned_states(self) -> np.ndarray:
        return np.fromiter(self.snapshots.values(), dtype=np.int64, count=len(self.snapshots))

    # ------------------------------------------------------------------ room
    def drop_blocks(self, count: int) -> int:
        """Drop up to ``count`` spilled blocks, least recently used first; returns how many."""
        dropped = [self.blocks.popitem(last=False)[1].slot
                   for _ in range(min(count, len(self.blocks)))]
        if dropped:
            self.pool.give(np.asarray(dropped, dtype=np.int64), _EMPTY)
            self.stats.dropped_blocks += len(dropped)
        return len(dropped)

    def drop_states(self, count: int) -> int:
        """Drop up to ``count`` spilled snapshots, least recently used first."""
        dropped = [self.snapshots.popitem(last=False)[1]
                   for _ in range(min(count, len(self.snapshots)))]
        if dropped:
            self.pool.give(_EMPTY, np.asarray(dropped, dtype=np.int64))
            self.stats.dropped_snapshots += len(dropped)
        return len(dropped)

    def _block_room(self, wanted: int) -> int:
        """How many of ``wanted`` host block slots can be had, dropping spilled blocks."""
        if wanted > self.pool.free_blocks:
            self.drop_blocks(wanted - self.pool.free_blocks)
        return min(wanted, self.pool.free_blocks)

    def _state_room(self, wanted: int) -> int:
        if wanted > self.pool.free_states:
            self.drop_states(wanted - self.pool.free_states)
        return min(wanted, self.pool.free_states)

    # ------------------------------------------------------------------ blocks
    def spill(self, blocks: np.ndarray, hashes: np.ndarray) -> None:
        """The allocator's ``on_spill``: copy the cached ``blocks`` it evicts (their 0.19
        ``hashes``) to the host before their digests go. ``blocks`` come most valuable first
        (the allocator's stack order: the most recently released, a chain's head before its
        tail), so the last ones are the least recently used and are left out first."""
        names = self.digests.block_digest
        keep = [i for i, block in enumerate(blocks.tolist()) if block in names]
        if not keep:
            return
        room = self._block_room(len(keep))
        self.stats.unspilled_blocks += len(keep) - room
        keep = keep[:room]
        if not keep:
            return
        device = blocks[keep].astype(np.int64)
        slots, _ = self.pool.take(len(keep), 0)
        self.pool.save(self.kv.buffer, device, slots)
        # The least recently used first: the last of ``blocks`` enter the index first.
        for i, slot in zip(reversed(keep), slots[::-1].tolist()):
            digest = names[int(blocks[i])]
            _, parent, data = self.digests.entries[digest]
            self.blocks[digest] = HostBlock(slot, parent, data, int(hashes[i]))
        self.stats.spilled_blocks += len(keep)

    def find(self, digest: bytes, parent: bytes, data: bytes) -> bool:
        """Whether the block of this chain link is spilled here (parent and bytes compared)."""
        entry = self.blocks.get(digest)
        return entry is not None and entry.parent == parent and entry.data == data

    def pin(self, digests: Sequence[bytes]) -> List[HostBlock]:
        """Take the spilled blocks of ``digests`` out of the index (their slots stay taken
        until ``restore``): a hit is about to copy them back."""
        return [self.blocks.pop(digest) for digest in digests]

    def restore(self, pinned: List[HostBlock], device_blocks: np.ndarray) -> None:
        """Copy the ``pinned`` blocks into ``device_blocks`` and free their host slots."""
        slots = np.asarray([entry.slot for entry in pinned], dtype=np.int64)
        self.pool.load(self.kv.buffer, slots, device_blocks.astype(np.int64))
        self.pool.give(slots, _EMPTY)
        self.stats.restored_blocks += len(pinned)

    def discard(self, digest: bytes) -> None:
        entry = self.blocks.pop(digest, None)
        if entry is not None:
            self.pool.give(np.array([entry.slot], dtype=np.int64), _EMPTY)

    # ------------------------------------------------------------------ Mamba snapshots
    def spill_snapshots(self, items: Sequence[tuple], conv, ssm) -> None:
        """``MambaSnapshots``' hook: ``(digest, snapshot index)`` of the snapshots about to be
        replaced (least recently used first), copied out of ``conv``/``ssm`` (the snapshot
        tensors, ``[layers, snapshots, ...]``) into free host state slots."""
        items = [(d, i) for d, i in items if d not in self.snapshots]
        room = self._state_room(len(items))
        items = items[len(items) - room:]   # the most recently used ones, when short
        if not items:
            return
        _, slots = self.pool.take(0, len(items))
        self.pool.save(self.kv.buffer, _EMPTY, _EMPTY, states=(conv, ssm),
                       device_slots=np.asarray([i for _, i in items], dtype=np.int64),
                       host_states=slots)
        for (digest, _), slot in zip(items, slots.tolist()):
            self.snapshots[digest] = slot
        self.stats.spilled_snapshots += len(items)

    def snapshot(self, digest: bytes) -> int:
        """The host state slot of ``digest``'s spilled snapshot, -1: none."""
        return self.snapshots.get(digest, -1)

    def load_snapshot(self, digest: bytes, slot: int, conv_states, ssm_states) -> None:
        """Copy ``digest``'s spilled snapshot into Mamba slot ``slot`` of the request states;
        the snapshot stays here, most recently used."""
        host = self.snapshots[digest]
        self.snapshots.move_to_end(digest)
        self.pool.load(self.kv.buffer, _EMPTY, _EMPTY, states=(conv_states, ssm_states),
                       host_states=np.array([host], dtype=np.int64),
                       device_slots=np.array([slot], dtype=np.int64))
        self.stats.restored_snapshots += 1

    def discard_snapshots(self, digests) -> None:
        """The device snapshots these digests again: their host copies go."""
        slots = [self.snapshots.pop(d) for d in digests if d in self.snapshots]
        if slots:
            self.pool.give(_EMPTY, np.asarray(slots, dtype=np.int64))

    def held(self) -> dict:
        return dict(kv_offload_prefix_blocks_held=len(self.blocks),
                    kv_offload_prefix_snapshots_held=len(self.snapshots))
