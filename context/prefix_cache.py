"""Prefix caching: full prompt blocks computed once and shared (docs/SEMANTICS.md §17).

A request's prompt is cut into blocks of ``block_size`` tokens; each FULL block gets a digest
chained from its parent's (BLAKE2b-128 over the parent digest and the block's int64 token ids;
the first block's parent is the digest of the request's salt, so that requests of different
salts never share). The cache maps a digest to ``(block id, parent digest, token bytes)`` and
every lookup compares the parent digest and the token bytes too: a digest collision can cost a
miss, never a wrong block.

* ``plan_match`` (pure, from ``admission.plan_add``): the longest run of cached blocks that
  starts the prompt, capped so that the chunk computes at least one token (its last prompt
  token's logits must exist) and never more than the chunk covers. The step's queries start
  after the matched tokens.
* ``commit_add`` (from ``RequestTable.commit_add``): the matched blocks get a reference each
  (idle cached blocks are revived out of the free stack); the request's digest chain waits in
  ``pending`` until its blocks are computed.
* ``plan_publish``/``commit_publish`` (from ``update_requests``, after the forward that wrote
  them): every pending block whose tokens are all computed enters the cache. A block already
  cached under the same digest (two requests computed it in the same step) is left private.
* The allocator (``block_allocator``) evicts: under "ref_zero" a cached block leaves the cache
  when its last reference goes; under "lru" it stays cached, idle, until allocation needs it
  (least recently released first). Its ``on_evict`` is the ``DigestTable``'s ``forget``, which
  drops the digest (the digest table refers to nothing, so that the allocator and the cache
  make no reference cycle).
* ``plan_update`` wraps the request table's update plan: publish, plan, and take the publishing
  back if the plan raises; ``stats_dict`` gives Megatron-Core 0.19's counters.

Only full prompt blocks whose every token was computed are shared, and a request's queries
start after its matched blocks: nothing is ever written into a shared or cached block.

Hybrids (Mamba layers): a hit must also resume the request's Mamba state at the matched
boundary. ``prefix_caching_mamba_gb`` buys ``MambaSnapshots`` (``mamba_states.py``): copies of a
request's conv and SSM states taken at ``update_requests`` when its computed tokens end exactly
on a full prompt block (keyed by that block's digest, least recently used replaced first). A
hybrid hit is the longest matched run whose last block has a snapshot; none, no hit (never a
wrong state). The hit row starts from the snapshot copied into its slot and runs as the step's
continuation (the last row, from its saved state; nothing is added after it in the step). To
make snapshots exist where requests share a prefix, ``first_chunk_boundary`` tells the scheduler
to end a hybrid's first chunk at the end of its cached blocks when the state there is missing
(vLLM's "align" idea): that request recomputes the prefix once, and later ones resume from it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ._fields import FIELD_IDS, FIELD_KV_OFFSET, FIELD_MAMBA_SLOT, FIELD_QUERY
from .inference_request import compute_block_hashes_batched
from .mamba_states import MambaSnapshots
from .prefix_digests import (  # noqa: F401 (re-exported: the context's modules import them here)
    DigestTable,
    Link,
    PrefixCacheStats,
    PrefixCachingEvictionPolicy,
    chain_links,
    salt_digest,
    wants_every_prompt_logit,
)
from .prefix_options import (  # noqa: F401 (re-exported likewise)
    POLICIES,
    check_prefix_caching_args,
    prefix_snapshot_count,
    warn_without_snapshots,
)
from .requests import whole_number_ids


@dataclass(frozen=True)
class PrefixHit:
    """What ``plan_match`` found for a new request: its chain, the matched blocks (in order,
    shared into its block-table row; -1: a block of the host tier, restored into a new block),
    which of them are idle (reference count 0) and must be revived, and how many of them the
    chunk skips (``skip``; the rest it recomputes, its K/V writes there discarded:
    ``discard_tokens``)."""

    links: Tuple[Link, ...]
    blocks: np.ndarray
    idle: np.ndarray
    block_size: int
    snapshot: int = -1         # hybrids: the Mamba snapshot the hit resumes from
    hashes: Tuple[int, ...] = ()   # 0.19's hash of each link (the allocator's block_hashes)
    skip: int = -1             # blocks skipped (-1: every matched block)
    host_snapshot: bytes = b""     # hybrids: the digest of a host tier snapshot it resumes from
    restored: bool = False         # a KV offload restore: publishes, is no lookup

    @property
    def skipped(self) -> int:
        return int(self.blocks.size) if self.skip < 0 else self.skip

    @property
    def tokens(self) -> int:
        """The prompt tokens the hit skips (their K/V are in the shared blocks)."""
        return self.skipped * self.block_size

    @property
    def discard_tokens(self) -> int:
        """The tokens the chunk computes inside shared blocks: their K/V are there already,
        so the forward's writes of them are discarded (the dummy block takes them)."""
        return (int(self.blocks.size) - self.skipped) * self.block_size

    @property
    def taken(self) -> int:
        """Blocks the hit takes from the free stack: the idle ones and one per host block."""
        return int(self.idle.size) + int((self.blocks < 0).sum())

    @property
    def resumes(self) -> bool:
        """Hybrids: the hit resumes from a snapshot (on the device or the host)."""
        return self.snapshot >= 0 or bool(self.host_snapshot)


@dataclass
class _Pending:
    links: Tuple[Link, ...]
    published: int
    hashes: Tuple[int, ...] = ()


@dataclass(frozen=True)
class PublishPlan:
    """What one update publishes: blocks ``(request_id, index, link, block)``, each request's
    published count afterwards ``(request_id, count)``, and the Mamba snapshots to take."""

    items: Tuple[Tuple[int, int, Link, int], ...] = ()
    progress: Tuple[Tuple[int, int], ...] = ()
    snapshots: Tuple[Tuple[int, bytes], ...] = ()   # hybrids: (Mamba slot, block digest)


class PrefixCache:
    """The digest table of the cached blocks and the chains of requests still computing.

    Args:
        allocator: the ``BlockAllocator``, built with ``keeps_idle_blocks`` for "lru" and
            ``on_evict=digests.forget``.
        digests: the ``DigestTable``.
        block_size: tokens per block.
        policy: "ref_zero" or "lru".
        mamba: a hybrid's state snapshots (``MambaStates.snapshots``; None: not a hybrid).
    """

    tier = None   # the host tier (``host_tier.HostTier``), set by ``offload.Offload``

    def __init__(self, allocator, digests: DigestTable, block_size: int, policy: str,
                 mamba: Optional[MambaSnapshots] = None):
        self.allocator, self.digests = allocator, digests
        self.mamba = mamba
        self.block_size = int(block_size)
        self.policy = policy
        self.pending: Dict[int, _Pending] = {}
        self.stats = PrefixCacheStats()
        # KV groups (context/kv_groups.py): of a matched run, how many blocks a hit can use
        # (``GroupedKV.hit_blocks``: every windowed group holds what its window reads from
        # the hit's end); None: every matched block.
        self.window_reads = None

    @property
    def entries(self) -> Dict[bytes, Tuple[int, bytes, bytes]]:
        return self.digests.entries

    @property
    def block_digest(self) -> Dict[int, bytes]:
        return self.digests.block_digest

    def reset(self) -> None:
        """Forget every cached block and chain (the allocator is reset alongside; the
        statistics are kept)."""
        self.digests.clear()
        self.pending.clear()
        if self.mamba is not None:
            self.mamba.clear()

    # ------------------------------------------------------------------ lookup (pure)
    def _links(self, req: Any, request_id: int) -> Tuple[Link, ...]:
        prompt = req.remaining_prompt_tokens
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.detach().to("cpu").numpy()  # a device prompt: one copy (a sync)
        tokens = whole_number_ids(prompt, f"request {request_id}: prompt tokens")
        return chain_links(tokens, self.block_size, getattr(req, "prefix_caching_salt", None))

    def _matched(self, links: Tuple[Link, ...], limit: int, host: bool = True) -> List[int]:
        """The cached blocks that start ``links`` (at most ``limit``); -1 for a block of the
        host tier (``host=False``: the run stops there)."""
        blocks, tier = [], self.tier if host else None
        for digest, parent, data in links[:limit]:
            entry = self.entries.get(digest)
            if entry is not None and entry[1] == parent and entry[2] == data:
                blocks.append(entry[0])
            elif tier is not None and tier.find(digest, parent, data):
                blocks.append(-1)
            else:
                break
        if self.window_reads is not None and blocks:
            blocks = blocks[:self.window_reads(blocks)]
        return blocks

    def _resumable(self, links: Tuple[Link, ...], blocks: List[int]) -> Tuple[int, int, bytes]:
        """``(blocks, snapshot, host snapshot digest)``: on a hybrid, the longest matched run
        whose boundary has a Mamba snapshot, on the device or in the host tier (0, -1, b"":
        none); otherwise every matched block."""
        if self.mamba is None:
            return len(blocks), -1, b""
        index, tier = self.mamba.index, self.tier
        for count in range(len(blocks), 0, -1):
            digest = links[count - 1][0]
            snapshot = index.get(digest)
            if snapshot is not None:
                return count, snapshot, b""
            if tier is not None and tier.snapshot(digest) >= 0:
                return count, -1, digest
        return 0, -1, b""

    def plan_match(self, req: Any, request_id: int, chunk: int,
                   allow_hit: bool = True) -> PrefixHit:
        """The hit of a new request whose first add covers ``chunk`` prompt tokens; pure.
        Every cached block the chunk covers whole is shared (0.19's match); the chunk skips
        at most ``(chunk - 1) // block_size`` of them, so it computes at least its last token,
        and on a hybrid only up to a block whose boundary has a Mamba snapshot (none: the
        blocks are shared for memory only, 0.19's "memory-only" mode). ``allow_hit=False``
        (requests asking for prompt log probs) matches nothing but still plans the
        publishing. With KV groups a hit shares only the blocks it skips: a window's copy of a
        block past them may be gone, and the recomputed tokens would be written there."""
        links = self._links(req, request_id)
        skippable = max(0, (chunk - 1) // self.block_size) if allow_hit else 0
        if self.window_reads is not None:
            matched = self._matched(links, skippable)
        else:
            matched = self._matched(links, chunk // self.block_size if allow_hit else 0)
        skip, snapshot, host_snapshot = self._resumable(links, matched[:skippable])
        blocks = np.asarray(matched, dtype=np.int32)
        device = blocks[blocks >= 0]
        idle = device[self.allocator.ref_counts[device] == 0] if device.size else device
        return PrefixHit(links=links, blocks=blocks, idle=idle, block_size=self.block_size,
                         snapshot=snapshot, skip=skip, host_snapshot=host_snapshot,
                         hashes=self._hashes(req, len(links)) if len(links) > blocks.size
                         else ())

    def _hashes(self, req: Any, count: int) -> Tuple[int, ...]:
        """0.19's hashes of the ``count`` full prompt blocks of a new request: its
        ``precomputed_block_hashes`` when they are of this block size and cover them, else
        computed (one SHA-256 a block)."""
        given = getattr(req, "precomputed_block_hashes", None) or ()
        if len(given) == count and getattr(req, "block_size_tokens", None) == self.block_size:
            if not all(isinstance(h, numbers.Integral) and not isinstance(h, bool)
                       and 1 <= h < 2**63 for h in given):
                raise ValueError(f"request {getattr(req, 'request_id', None)}: "
                                 f"precomputed_block_hashes={list(given)[:4]}: each must be an "
                                 "int in [1, 2**63 - 1] (0.19's hashes; -1 marks an uncached "
                                 "block)")
            return tuple(int(h) for h in given)
        prompt = torch.as_tensor(req.remaining_prompt_tokens).reshape(-1)
        return tuple(compute_block_hashes_batched(prompt[:count * self.block_size].cpu(),
                                                  self.block_size))

    def matched_chain(self, req: Any, limit: int) -> Tuple[Tuple[Link, ...], List[int]]:
        """``(links, blocks)``: the new request's chain and the cached blocks that start it, at
        most ``limit`` (KV only: a hybrid's snapshots are not asked); pure."""
        links = self._links(req, getattr(req, "request_id", -1))
        return links, self._matched(links, max(0, int(limit)), host=False)

    def snapshot_count(self, links: Tuple[Link, ...], start: int, end: int) -> int:
        """Hybrids: ``i + 1 - start`` for the last block ``i`` of ``links[start:end]`` whose
        boundary has a Mamba snapshot (on the device or the host), 0 when none (or not a
        hybrid); pure."""
        if self.mamba is None:
            return 0
        for i in range(min(end, len(links)) - 1, start - 1, -1):
            if links[i][0] in self.mamba.index or (
                    self.tier is not None and self.tier.snapshot(links[i][0]) >= 0):
                return i + 1 - start
        return 0

    def lookup(self, req: Any) -> Tuple[int, int, int]:
        """``(tokens, blocks, blocks taken)``: the prompt tokens the next ``add_request`` of
        ``req`` (a new request whose chunk is its whole remaining prompt) would skip, the
        cached blocks it would share, and how many free blocks the hit takes (the idle ones it
        revives, one per host-tier block it restores); pure."""
        if wants_every_prompt_logit(req) or req.finished_chunk_token_count:
            return 0, 0, 0
        hit = self.plan_match(req, getattr(req, "request_id", -1), req.remaining_prompt_length)
        return hit.tokens, int(hit.blocks.size), hit.taken

    def first_chunk_boundary(self, req: Any) -> int:
        """Hybrids: where the first chunk of the new request ``req`` should end so that its
        Mamba state at the end of its cached blocks exists afterwards (the blocks are cached
        beyond the last snapshot); 0 when there is no such boundary. Pure."""
        if self.mamba is None or self.mamba.count == 0 or wants_every_prompt_logit(req) \
                or req.finished_chunk_token_count:
            return 0
        links = self._links(req, getattr(req, "request_id", -1))
        limit = max(0, (req.remaining_prompt_length - 1) // self.block_size)
        matched = self._matched(links, limit)
        count = self._resumable(links, matched)[0]
        return len(matched) * self.block_size if len(matched) > count else 0

    # ------------------------------------------------------------------ add (commit)
    def commit_add(self, request_id: int, hit: Optional[PrefixHit],
                   computed: int) -> Optional[np.ndarray]:
        """References for the matched blocks (a host-tier block restored into a new block:
        ``_restore``), the request's chain pending, the statistics; returns the matched blocks
        (device ids, in chain order)."""
        stats = self.stats
        stats.prefix_cache_prefill_computed_tokens += int(computed)
        if hit is None:
            return None
        stats.prefix_cache_lookups += not hit.restored
        blocks = hit.blocks
        if blocks.size:
            stats.prefix_cache_hits += 1
            stats.prefix_cache_blocks_matched += int(blocks.size)
            stats.prefix_cache_prefill_skipped_tokens += hit.tokens
            self.allocator.revive(hit.idle)
            shared = blocks[(blocks >= 0) & ~np.isin(blocks, hit.idle)]
            if shared.size:
                self.allocator.share(shared)
            if (blocks < 0).any():
                blocks = self._restore(hit)
            if hit.snapshot >= 0:
                self.mamba.index.move_to_end(hit.links[hit.skipped - 1][0])
        # The chain waits for its blocks beyond the shared ones (a hybrid's also for the Mamba
        # snapshot at the end of the blocks it recomputes).
        if len(hit.links) > (blocks.size if self.mamba is None else hit.skipped):
            self.pending[request_id] = _Pending(hit.links, int(blocks.size), hit.hashes)
        return blocks

    def _restore(self, hit: PrefixHit) -> np.ndarray:
        """A hit's host-tier blocks: pinned (the spills of this allocation cannot drop them),
        each copied into a new block, which is cached again under its digest (its 0.19 hash
        and parent block: the previous link's, on the device now); the chain's blocks."""
        where = np.flatnonzero(hit.blocks < 0)
        pinned = self.tier.pin([hit.links[i][0] for i in where.tolist()])
        new = self.allocator.allocate_memory_blocks_host(int(where.size))
        blocks = hit.blocks.copy()
        blocks[where] = new
        for i, block in zip(where.tolist(), new.tolist()):
            digest, parent, data = hit.links[i]
            self.entries[digest] = (block, parent, data)
            self.block_digest[block] = digest
        parents = np.where(where > 0, blocks[np.maximum(where - 1, 0)], -1).astype(np.int64)
        self.allocator.note_cached(new.astype(np.int64),
                                   np.asarray([p.hash for p in pinned], dtype=np.int64), parents)
        self.tier.restore(pinned, new)
        return blocks

    # ------------------------------------------------------------------ publish
    def publish_added(self, request_id: int, block_row: np.ndarray, covered: int) -> None:
        """Megatron-Core 0.19's registration at ``add_request``: every pending prompt block
        the added chunk fills (its ``covered`` prompt tokens reach the block's end) is shared
        at once, so that a request added later in the same step matches it; its K/V are
        written by this step's forward, which in each layer appends every token's K/V before
        attention reads any. ``block_row``: the request's block-table row."""
        pending = self.pending.get(request_id)
        if pending is None:
            return
        full = min(int(covered) // self.block_size, len(pending.links))
        if full > pending.published:
            self.commit_publish(PublishPlan(
                tuple((request_id, i, pending.links[i], int(block_row[i]))
                      for i in range(pending.published, full)), ((request_id, full),)))

    def plan_publish(self, table) -> PublishPlan:
        """The pending blocks the step just computed (active rows only); pure."""
        if not self.pending:
            return PublishPlan()
        paused, total = table.paused, table.total
        ids = table.rows[FIELD_IDS, paused:total]
        items, progress, snapshots = [], [], []
        snapshotting = self.mamba is not None and self.mamba.count > 0
        for rid, pending in self.pending.items():
            where = np.flatnonzero(ids == rid)
            if where.size == 0:
                continue
            row = paused + int(where[0])
            computed = int(table.rows[FIELD_KV_OFFSET, row]) + int(table.rows[FIELD_QUERY, row])
            full = min(computed // self.block_size, len(pending.links))
            if snapshotting and full and computed == full * self.block_size:
                # Its Mamba state is the state at the end of block ``full``.
                snapshots.append((int(table.rows[FIELD_MAMBA_SLOT, row]),
                                  pending.links[full - 1][0]))
            for index in range(pending.published, full):
                items.append((rid, index, pending.links[index],
                              int(table.block_table[row, index])))
            if full > pending.published:
                progress.append((rid, full))
        return PublishPlan(tuple(items), tuple(progress), tuple(snapshots))

    def commit_publish(self, plan: PublishPlan) -> list:
        """Publish the blocks (not the snapshots: ``MambaSnapshots.save`` once the update is
        sure), with 0.19's hashes and parent blocks (``note_cached``); returns what
        ``undo_publish`` needs to take it back."""
        added, old, hashes, parents = [], [], [], []
        cached = self.allocator.cached
        tier = self.tier
        for rid, index, (digest, parent, data), block in plan.items:
            if digest in self.entries or cached[block] or (tier is not None
                                                           and digest in tier.blocks):
                continue
            parent_entry = self.entries.get(parent)
            self.entries[digest] = (block, parent, data)
            self.block_digest[block] = digest
            added.append((digest, block))
            hashes.append(self.pending[rid].hashes[index])
            parents.append(-1 if parent_entry is None else parent_entry[0])
        if added:
            self.allocator.note_cached(np.asarray([b for _, b in added], dtype=np.int64),
                                       np.asarray(hashes, dtype=np.int64),
                                       np.asarray(parents, dtype=np.int64))
        for rid, full in plan.progress:
            pending = self.pending[rid]
            old.append((rid, pending.published))
            pending.published = full
        return [added, old]

    def undo_publish(self, undo: list) -> None:
        added, old = undo
        for digest, block in added:
            del self.entries[digest]
            del self.block_digest[block]
        if added:
            self.allocator.forget_cached(np.asarray([b for _, b in added], dtype=np.int64))
        for rid, published in old:
            self.pending[rid].published = published

    def drop_done(self, live_ids: set) -> None:
        """Forget the chains of requests that left, or whose every block is published."""
        for rid in [rid for rid, p in self.pending.items()
                    if rid not in live_ids or p.published >= len(p.links)]:
            del self.pending[rid]

    # ------------------------------------------------------------------ update_requests
    def plan_update(self, table, mask: np.ndarray, **limits) -> tuple:
        """``(table.plan_update(mask, **limits), snapshots)`` with the blocks this step
        computed published first, so that the plan sees them cached; an error of the plan
        takes the publishing back. ``snapshots``: the ``(slot, digest)`` Mamba states to save
        once the plan stands (the slots still hold the states the forward left)."""
        publish = self.plan_publish(table)
        undo = self.commit_publish(publish)
        try:
            return table.plan_update(mask, **limits), publish.snapshots
        except BaseException:
            self.undo_publish(undo)
            raise

    def stats_dict(self) -> Dict[str, float]:
        """Megatron-Core 0.19's counters plus lookups, the hit rates and the cached blocks now
        (``prefix_cache_blocks``, of which ``prefix_cache_blocks_idle``)."""
        stats = self.stats.as_dict()
        stats["prefix_cache_blocks"] = len(self.entries)
        stats["prefix_cache_blocks_idle"] = self.allocator.idle_count
        return stats
