"""The state machine's own model of the prefix cache (docs/SEMANTICS.md §17), so that the hits it
expects come from what the requests computed, not from the context's ``plan_match``.

A cached block stands for a chain: the tokens of a prompt's first ``k`` full blocks. After every
update each active request publishes the full prompt blocks it has computed and not yet
published; a chain already cached stays with its first copy (the new one is private). The model
cannot see everything the context decides, so it keeps bounds:

* a chain is **surely cached** while a live request surely holds its cached block: one that
  took it from the cache, or every request that may have published it (when two published it in
  one update, or one published it while an older copy might have gone, either copy may be the
  cached one);
* a chain is **possibly cached** under "lru" once published (an idle cached block stays until
  an allocation needs it, and the model does not follow the allocator's order), under
  "ref_zero" while one of its possible holders is live; with the host tier under either
  policy once published (a block spills to the host instead of vanishing, and the model does
  not follow which spilled blocks the host pool drops for room).

A new request's hit is then between the longest run of surely cached chains and the longest run
of possibly cached ones, capped at ``(chunk - 1) // block_size`` blocks (0 for a request that
wants every prompt log prob). A hybrid's hit also needs a Mamba state snapshot at its boundary:
any run that ends where a snapshot may have been taken, or none (snapshots are replaced least
recently used first). With KV groups a hit also needs each windowed group's copies of the
blocks its window reads from the hit's end, which the model does not follow: any run up to the
longest possibly cached one. The driver checks the context's actual hit against these
candidates, and ``check_kv`` then checks the content of every matched block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Set, Tuple

Chain = Tuple[int, ...]


@dataclass
class _Entry:
    candidates: Set[int] = field(default_factory=set)   # uids that may hold the cached block
    sharers: Set[int] = field(default_factory=set)      # uids that took it from the cache


@dataclass(frozen=True)
class Hit:
    """A possible hit: ``blocks`` matched, ``idle`` of them without a live holder (revived out
    of the free stack)."""

    blocks: int
    idle: int
    tokens: int = -1    # the tokens it skips, when not ``blocks`` whole blocks (a restore)

    def skip(self, block_size: int) -> int:
        return self.tokens if self.tokens >= 0 else self.blocks * block_size


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
        self.snapshots: Set[Chain] = set()     # hybrids: chains whose boundary state was saved

    def clear(self) -> None:
        """A reset or a suspend: the context forgets its cache."""
        self.entries.clear()
        self.published.clear()
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
        limit = min((chunk - 1) // self.block_size if allow_hit else 0,
                    len(prompt) // self.block_size)
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
        counts = range(0 if self.windows else sure, possible + 1)
        if self.hybrid:
            counts = [0] + [k for k in range(1, possible + 1)
                            if self.chain(prompt, k) in self.snapshots]
        hits = []
        for count in counts:
            entries = [self.entries[self.chain(prompt, k)] for k in range(1, count + 1)]
            held = sum(self._sure(e, live) for e in entries)
            maybe_held = sum(bool((e.sharers | e.candidates) & live) for e in entries)
            hits += [Hit(count, idle) for idle in {count - maybe_held, count - held}]
        return hits

    def took(self, uid: int, prompt: List[int], blocks: int) -> None:
        """A new request was added with ``blocks`` blocks from the cache: it holds them."""
        for k in range(1, blocks + 1):
            self.entries[self.chain(prompt, k)].sharers.add(uid)
        self.published[uid] = blocks

    def after_update(self, computed: Iterable[Tuple[int, List[int], int]],
                     live: Set[int]) -> None:
        """The publishing of one update: ``(uid, prompt, tokens with K/V)`` of every request
        that was active in the step; ``live``: the uids in the context before the update."""
        bs = self.block_size
        new: Dict[Chain, Set[int]] = {}
        for uid, prompt, cached in computed:
            links = len(prompt) // bs
            done = self.published.get(uid, 0)
            full = min(cached // bs, links)
            if self.hybrid and done < links and full and cached == full * bs:
                self.snapshots.add(self.chain(prompt, full))
            for k in range(done + 1, full + 1):
                new.setdefault(self.chain(prompt, k), set()).add(uid)
            self.published[uid] = max(done, full)
        for chain, uids in new.items():
            entry = self.entries.get(chain)
            if entry is None or not self._possible(entry, live):
                self.entries[chain] = _Entry(candidates=set(uids))
            elif not self._sure(entry, live):
                # The old copy may be gone: either it or one of the new ones is cached now.
                entry.candidates |= uids
