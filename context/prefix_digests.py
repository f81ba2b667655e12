"""Prefix caching's building blocks (docs/SEMANTICS.md §17): the constructor's arguments, the
salted block digests, the statistics under Megatron-Core 0.19's names and the digest table of
the cached blocks. ``prefix_cache.PrefixCache`` composes them (and re-exports these names)."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Optional, Tuple

import numpy as np

logger = logging.getLogger("dynctx.context")
POLICIES = ("ref_zero", "lru")


class PrefixCachingEvictionPolicy(str, Enum):
    """Megatron-Core 0.19's enum of the eviction policies (a plain string works as well)."""

    REF_ZERO = "ref_zero"
    LRU = "lru"


_DIGEST = 16

# (digest, parent digest, token bytes) of one full block.
Link = Tuple[bytes, bytes, bytes]


def check_prefix_caching_args(enable_prefix_caching: Any, prefix_caching_eviction_policy: Any,
                              prefix_caching_mamba_gb: Any) -> Tuple[bool, str, Optional[float]]:
    """The constructor's prefix caching arguments, checked (naming the argument and value)."""
    if not isinstance(enable_prefix_caching, (bool, np.bool_)):
        raise TypeError(f"enable_prefix_caching={enable_prefix_caching!r} must be a bool")
    policy = prefix_caching_eviction_policy
    if isinstance(policy, Enum):
        policy = policy.name
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        raise ValueError(f"prefix_caching_eviction_policy={policy!r} must be one of "
                         f"{', '.join(repr(p) for p in POLICIES)}")
    gb = prefix_caching_mamba_gb
    if gb is not None:
        if isinstance(gb, bool) or not isinstance(gb, (int, float, np.integer, np.floating)) \
                or not math.isfinite(gb) or gb < 0:
            raise ValueError(f"prefix_caching_mamba_gb={gb!r} must be a finite number of GiB "
                             ">= 0 (or None)")
        gb = float(gb)
    return bool(enable_prefix_caching), policy.lower(), gb


def prefix_snapshot_count(args: Tuple[bool, str, Optional[float]], layers: Any) -> int:
    """How many Mamba state snapshots ``prefix_caching_mamba_gb`` holds (``args``:
    ``check_prefix_caching_args``' result; ``layers``: the context's ``LayerLayout``); -1 when
    caching is off or the model has no Mamba layers."""
    enable, _, mamba_gb = args
    if not enable or not layers.is_hybrid_model:
        return -1
    return int((mamba_gb or 0.0) * 1024 ** 3 // layers.mamba_bytes_per_request)


def warn_without_snapshots(snapshots: int, mamba_gb: Optional[float], bytes_each: int) -> None:
    """Say once, at construction, that a hybrid's prefix cache skips no prompt token: no Mamba
    state snapshot fits its budget (a skip resumes from one), so cached blocks are shared for
    memory only (0.19's "memory-only" mode)."""
    if snapshots == 0:
        logger.warning(
            "enable_prefix_caching on a hybrid model with prefix_caching_mamba_gb=%s: no Mamba "
            "state snapshot fits (%d bytes each). Running in memory-only mode: identical KV "
            "prefixes are shared for memory, but no request can resume from the cache (every "
            "prompt token is recomputed)", mamba_gb, bytes_each)


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


