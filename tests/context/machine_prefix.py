"""The state machine's own model of the prefix cache (docs/SEMANTICS.md §17), so that the hits it
expects come from what the requests computed, not from the context's ``plan_match``.

A cached block stands for a chain: the tokens of a prompt's first ``k`` full blocks. At every
``add_request`` the request publishes the full prompt blocks its chunk fills and it did not
take from the cache (Megatron-Core 0.19 registers them there, before the forward that writes
them); a chain already cached stays with its first copy (the new one is private). The model
cannot see everything the context decides, so it keeps bounds:

* a chain is **surely cached** while a live request surely holds its cached block: one that
  took it from the cache, or every request that may have published it (when one published it
  while an older copy might have gone, either copy may be the cached one);
* a chain is **possibly cached** under "lru" once published (an idle cached block stays until
  an allocation needs it, and the model does not follow the allocator's order), under
  "ref_zero" while one of its possible holders is live; with the host tier under either
  policy once published (a block spills to the host instead of vanishing, and the model does
  not follow which spilled blocks the host pool drops for room).

A new request shares the longest run of cached chains its chunk covers whole (between the
longest run of surely cached chains and the longest run of possibly cached ones), and skips
the first ``min(shared, (chunk - 1) // block_size)`` of them (none for a request that wants
every prompt log prob). A hybrid skips only to a run that ends where a Mamba state snapshot may
have been taken, or none (snapshots are replaced least recently used first); the blocks beyond
are shared for memory. Snapshots are taken at an update where a request whose chain is still
open (blocks to publish, or on a hybrid blocks it recomputed) has computed exactly to a block
boundary. With the host tier a chain stays possibly cached as said above. With KV groups a hit
shares only the blocks it skips, and also needs each windowed group's copies of the blocks its
window reads from the hit's end, which the model does not follow: any run up to the longest
possibly cached one. The driver checks the context's actual hit against these candidates, and
``check_kv`` then checks the content of every matched block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

Chain = Tuple[int, ...]


@dataclass
class _Entry:
    candidates: Set[int] = field(default_factory=set)   # uids that may hold the cached block
    sharers: Set[int] = field(default_factory=set)      # uids that took it from the cache


@dataclass(frozen=True)
class Hit:
    """A possible hit: ``blocks`` shared, ``idle`` of them without a live holder (revived out
    of the free stack), ``skip`` of them skipped (None: all)."""

    blocks: int
    idle: int
    skip: Optional[int] = None
    tokens: int = -1    # the tokens it skips, when not whole blocks (a KV offload restore)

    @property
    def skipped(self) -> int:
        return self.blocks if self.skip is None else self.skip

    def skip_tokens(self, block_size: int) -> int:
        return self.tokens if self.tokens >= 0 else self.skipped * block_size


class PrefixModel:
    """Bounds on what the prefix cache holds (module docstring)."""

    def __init__(self, block_size: int, policy: str, hybrid: bool, host_tier: bool = False,
                 windows: bool = False):
        self.block_size = block_size
        self.policy = policy
        self.host_tier = host_tier
        self.hybrid = hybrid
        self.windows = windows
        self.entries: Dict[Chain, _Entry] = {}
        self.published: Dict[int, int] = {}    # uid -> its prompt blocks published (or taken)
        self.open: Set[int] = set()            # uids whose chain the context keeps pending
        self.snapshots: Set[Chain] = set()     # hybrids: chains whose boundary state was saved

    def clear(self) -> None:
        """A reset or a suspend: the context forgets its cache."""
        self.entries.clear()
        self.published.clear()
        self.open.clear()
        self.snapshots.clear()

    def chain(self, prompt: List[int], blocks: int) -> Chain:
        return tuple(prompt[:blocks * self.block_size])

    def _sure(self, entry: _Entry, live: Set[int]) -> bool:
        return bool(entry.sharers & live) or (bool(entry.candidates)
                                               and entry.candidates <= live)

    def _possible(self, entry: _Entry, live: Set[int]) -> bool:
        return self.policy == "lru" or self.host_tier \
            or bool((entry.sharers | entry.candidates) & live)

    def hits(self, prompt: List[int], chunk: int, allow_hit: bool, live: Set[int]) -> List[Hit]:
        """Every hit the context may give a new request of ``prompt`` whose first add covers
        ``chunk`` tokens, with the idle blocks each may revive (lowest and highest)."""
        bs = self.block_size
        # With KV groups a hit shares only the blocks it skips (``PrefixCache.plan_match``).
        cover = (chunk - 1) // bs if self.windows else chunk // bs
        limit = min(cover if allow_hit else 0, len(prompt) // bs)
        sure = possible = 0
        for blocks in range(1, limit + 1):
            entry = self.entries.get(self.chain(prompt, blocks))
            if entry is None or not self._possible(entry, live):
                break
            possible = blocks
            if sure == blocks - 1 and self._sure(entry, live):
                sure = blocks
        # KV groups: a windowed group may have released (or evicted) a copy its window reads
        # from a hit's end, which then shortens the hit, to any count (the model does not
        # follow the groups' pools; check_kv reads every block a window reads).
        hits = []
        for count in range(0 if self.windows else sure, possible + 1):
            cap = min(count, (chunk - 1) // bs)
            skips = [cap]
            if self.hybrid:
                skips = [0] + [k for k in range(1, cap + 1)
                               if self.chain(prompt, k) in self.snapshots]
            entries = [self.entries[self.chain(prompt, k)] for k in range(1, count + 1)]
            held = sum(self._sure(e, live) for e in entries)
            maybe_held = sum(bool((e.sharers | e.candidates) & live) for e in entries)
            hits += [Hit(count, idle, skip) for idle in {count - maybe_held, count - held}
                     for skip in skips]
        return hits

    def took(self, uid: int, prompt: List[int], blocks: int, skipped: int) -> None:
        """A new request was added with ``blocks`` blocks shared from the cache, ``skipped`` of
        them skipped: it holds them, and its chain stays open while it has blocks to publish
        (on a hybrid, also blocks it recomputes)."""
        for k in range(1, blocks + 1):
            self.entries[self.chain(prompt, k)].sharers.add(uid)
        self.published[uid] = blocks
        if len(prompt) // self.block_size > (skipped if self.hybrid else blocks):
            self.open.add(uid)

    def added(self, uid: int, prompt: List[int], covered: int, live: Set[int]) -> None:
        """The publishing of one ``add_request`` (0.19's registration): the request's prompt
        blocks its ``covered`` prompt tokens fill, not yet published or taken; ``live``: the
        uids in the context."""
        if uid not in self.open:
            return
        done = self.published.get(uid, 0)
        full = min(covered // self.block_size, len(prompt) // self.block_size)
        for k in range(done + 1, full + 1):
            chain = self.chain(prompt, k)
            entry = self.entries.get(chain)
            if entry is None or not self._possible(entry, live):
                self.entries[chain] = _Entry(candidates={uid})
            elif not self._sure(entry, live):
                # The old copy may be gone: either it or this one is cached now.
                entry.candidates.add(uid)
        self.published[uid] = max(done, full)

    def after_update(self, computed: Iterable[Tuple[int, List[int], int]],
                     live: Set[int]) -> None:
        """The snapshots of one update: ``(uid, prompt, tokens with K/V)`` of every request
        that was active in the step; ``live``: the uids in the context before the update."""
        bs = self.block_size
        for uid, prompt, cached in computed:
            if uid not in self.open:
                continue
            links = len(prompt) // bs
            full = min(cached // bs, links)
            if self.hybrid and full and cached == full * bs:
                self.snapshots.add(self.chain(prompt, full))
            if self.published.get(uid, 0) >= links:
                self.open.discard(uid)
        self.open &= live
