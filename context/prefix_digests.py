"""Prefix caching's building blocks (docs/SEMANTICS.md §17): the eviction policies' enum, the
salted block digests, the statistics under Megatron-Core 0.19's names and the digest table of
the cached blocks. ``prefix_cache.PrefixCache`` composes them (and re-exports these names; the
constructor's arguments are ``prefix_options``')."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Tuple

import numpy as np


class PrefixCachingEvictionPolicy(str, Enum):
    """Megatron-Core 0.19's enum of the eviction policies (a plain string works as well)."""

    REF_ZERO = "ref_zero"
    LRU = "lru"


_DIGEST = 16

# (digest, parent digest, token bytes) of one full block.
Link = Tuple[bytes, bytes, bytes]


def salt_digest(salt: Any) -> bytes:
    """The root parent digest of a request's chain: its salt (None, str, bytes or int)."""
    if salt is None:
        data = b""
    elif isinstance(salt, bytes):
        data = b"b" + salt
    elif isinstance(salt, str):
        data = b"s" + salt.encode()
    elif isinstance(salt, (int, np.integer)) and not isinstance(salt, bool):
        data = b"i" + str(int(salt)).encode()
    else:
        raise TypeError(f"prefix_caching_salt={salt!r} must be None, a str, bytes or an int")
    return hashlib.blake2b(data, digest_size=_DIGEST, person=b"dynctx-salt").digest()


def chain_links(tokens: np.ndarray, block_size: int, salt: Any = None) -> Tuple[Link, ...]:
    """The chained links of every full block of ``tokens`` (int64 host ids)."""
    parent = salt_digest(salt)
    data = np.ascontiguousarray(tokens, dtype="<i8")
    links = []
    for start in range(0, (data.size // block_size) * block_size, block_size):
        chunk = data[start:start + block_size].tobytes()
        digest = hashlib.blake2b(parent + chunk, digest_size=_DIGEST).digest()
        links.append((digest, parent, chunk))
        parent = digest
    return tuple(links)


def wants_every_prompt_logit(req: Any) -> bool:
    """A request that asks for prompt log probs needs every prompt position computed."""
    params = getattr(req, "sampling_params", None)
    return bool(getattr(params, "return_log_probs", False)
                and not getattr(params, "skip_prompt_log_probs", False))


@dataclass
class PrefixCacheStats:
    """Megatron-Core 0.19's names. ``hits``: added requests that matched at least one block."""

    prefix_cache_hits: int = 0
    prefix_cache_blocks_matched: int = 0
    prefix_cache_prefill_skipped_tokens: int = 0
    prefix_cache_prefill_computed_tokens: int = 0
    prefix_cache_lookups: int = 0

    def as_dict(self) -> Dict[str, float]:
        total = self.prefix_cache_prefill_skipped_tokens + \
            self.prefix_cache_prefill_computed_tokens
        return {
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_lookups": self.prefix_cache_lookups,
            "prefix_cache_blocks_matched": self.prefix_cache_blocks_matched,
            "prefix_cache_prefill_skipped_tokens": self.prefix_cache_prefill_skipped_tokens,
            "prefix_cache_prefill_computed_tokens": self.prefix_cache_prefill_computed_tokens,
            "prefix_cache_hit_rate": (self.prefix_cache_hits / self.prefix_cache_lookups
                                      if self.prefix_cache_lookups else 0.0),
            "prefix_cache_token_hit_rate": (self.prefix_cache_prefill_skipped_tokens / total
                                            if total else 0.0),
        }


class DigestTable:
    """The cached blocks: ``entries`` maps a digest to ``(block id, parent digest, token
    bytes)``, ``block_digest`` a cached block to its digest. ``forget`` is the block
    allocator's ``on_evict``; ``on_forget`` (a hybrid's ``MambaSnapshots.drop``) hears the
    digests it drops: a Mamba snapshot goes with its block, as 0.19's slot does."""

    def __init__(self):
        self.entries: Dict[bytes, Tuple[int, bytes, bytes]] = {}
        self.block_digest: Dict[int, bytes] = {}
        self.on_forget = None

    def forget(self, blocks: np.ndarray) -> None:
        gone = []
        for block in blocks.tolist():
            digest = self.block_digest.pop(block, None)
            if digest is not None:
                del self.entries[digest]
                gone.append(digest)
        if gone and self.on_forget is not None:
            self.on_forget(gone)

    def clear(self) -> None:
        self.entries.clear()
        self.block_digest.clear()


