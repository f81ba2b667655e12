"""The constructor's prefix caching options, checked (docs/SEMANTICS.md §17, §21): the policy,
the hybrids' snapshot budget and the host tier."""

from __future__ import annotations

import logging
import math
from enum import Enum
from typing import Any, Optional, Tuple

import numpy as np

logger = logging.getLogger("dynctx.context")
POLICIES = ("ref_zero", "lru")


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


def check_host_tier_arg(value: Any, *, enable_prefix_caching: bool, kv_offload_gb: float,
                        mode: str) -> bool:
    """``prefix_caching_host_tier``, checked: whether the prefix cache spills to the host pool.
    None (the default): with prefix caching and ``kv_offload_gb > 0``; True needs prefix
    caching and a host pool (``kv_offload_gb > 0`` or ``kv_cache_management_mode='offload'``);
    False: never."""
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"prefix_caching_host_tier={value!r} must be a bool or None")
    if value is None:
        return bool(enable_prefix_caching and kv_offload_gb > 0)
    if value and not enable_prefix_caching:
        raise ValueError("prefix_caching_host_tier=True needs enable_prefix_caching=True")
    if value and not (kv_offload_gb > 0 or mode == "offload"):
        raise ValueError(f"prefix_caching_host_tier=True needs a host pool: kv_offload_gb="
                         f"{kv_offload_gb} must be > 0 (or kv_cache_management_mode='offload')")
    return bool(value)


def host_tier_with_groups(host_tier: bool, asked: Any, kv_spec: Any, windows: Any) -> bool:
    """Whether the host tier stays on once the KV groups are known (``kv_spec``: None without
    groups): it spills group 0's blocks only, so groups turn the default off, and an explicit
    ``prefix_caching_host_tier=True`` (``asked``) raises naming the two ways out."""
    if kv_spec is None or not host_tier:
        return host_tier
    if asked:
        raise ValueError(f"prefix_caching_host_tier=True is not supported with KV groups "
                         f"(kv_layer_windows={list(windows)!r}): pass kv_groups=False or "
                         f"prefix_caching_host_tier=False")
    return False
