"""The state machine's checks of the prefix cache's host tier (docs/SEMANTICS.md §21): a digest
lives on the device or the host, never both; every spilled block holds exactly the K/V the
requests wrote for its chain (the content patterns of ``machine_patterns.py``), with its chain
link (parent digest, token bytes) intact; every spilled Mamba snapshot holds the state of its
chain's tokens. The host pool's slots (free, or owned once by a swapped request or the tier)
are ``Offload.check``'s, which ``check()`` runs."""

from __future__ import annotations

from typing import List

import numpy as np
from machine_model import require

from dynctx.context.prefix_cache import chain_links


class HostTierChecks:
    """Mixed into the driver: ``note_chains`` for every prompt it makes, ``check_host_tier``."""

    def note_chains(self, prompt: List[int]) -> None:
        """Remember the chain of every full block of ``prompt``: digest -> (tokens, link)."""
        if self.cfg.host_tier:
            chains = self.__dict__.setdefault("_chains", {})
            links = chain_links(np.asarray(prompt, dtype=np.int64), self.cfg.block_size)
            for k, link in enumerate(links, start=1):
                chains.setdefault(link[0], (tuple(prompt[:k * self.cfg.block_size]), link))

    def _content_uids(self, chain: tuple, positions: np.ndarray) -> np.ndarray:
        ids = self.__dict__.get("_content_ids", {})
        uids = [ids.get(chain[:p + 1], -1) for p in positions.tolist()]
        require(min(uids) >= 0, lambda: f"a host-tier block of chain {chain} holds tokens no "
                "request ever wrote")
        return np.asarray(uids, dtype=np.int64)

    def check_host_tier(self) -> None:
        offload = self.ctx._parts.offload
        tier = None if offload is None else offload.tier
        if tier is None:
            return
        cfg, pool = self.cfg, offload.pool
        bs = cfg.block_size
        both = set(tier.blocks) & set(self.ctx.prefix_cache.entries)
        require(not both, lambda: f"{len(both)} digests cached on the device and the host")
        chains = self.__dict__.get("_chains", {})
        for digest, entry in tier.blocks.items():
            require(digest in chains, "a host-tier block under a digest no prompt has")
            chain, link = chains[digest]
            require((entry.parent, entry.data) == link[1:], lambda: f"host-tier block of chain "
                    f"{chain}: its parent digest or token bytes changed")
            positions = np.arange(len(chain) - bs, len(chain))
            uids = self._content_uids(chain, positions)
            host = pool.kv[entry.slot].numpy()   # MHA [2, L, bs, H, D]; MLA [L, bs, latent]
            for layer in range(len(cfg.attention_layers)):
                want = self.pattern(uids, positions, layer)
                got = host[layer] if cfg.mla else host[:, layer].transpose(1, 0, 2, 3)
                require(np.array_equal(got, want), lambda: f"host-tier block of chain {chain} "
                        f"(host slot {entry.slot}), layer {layer}: "
                        f"{self._decode(got.reshape(-1)[0])}, expected "
                        f"{self._decode(want.reshape(-1)[0])}")
        for digest, slot in tier.snapshots.items():
            require(digest in chains, "a host-tier snapshot under a digest no prompt has")
            chain, _ = chains[digest]
            uid = self._content_uids(chain, np.array([len(chain) - 1]))
            wants = self.mamba_pattern(uid, np.ones(1, dtype=np.int64))
            for host, want, kind in zip(pool.mamba, wants, ("conv", "ssm")):
                got = host[slot].numpy()
                require(np.array_equal(got, want[0]), lambda: f"host-tier {kind} snapshot of "
                        f"chain {chain} (host state slot {slot}) is "
                        f"{self._decode_mamba(got.reshape(-1)[0])}, expected "
                        f"{self._decode_mamba(want.reshape(-1)[0])}")
