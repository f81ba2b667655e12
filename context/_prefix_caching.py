"""The prefix caching side of ``DynamicInferenceContext`` (docs/SEMANTICS.md §17).

The mixin reads and writes the context's ``prefix_cache`` (``prefix_cache.PrefixCache``, None
when ``enable_prefix_caching`` is off), ``_table`` and ``_device``: construction, the lookups
the engine's scheduler asks, ``check_availability``, the publishing around ``update_requests``,
the Mamba snapshot restores of hybrid hits, and the statistics.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .prefix_cache import MambaSnapshots, PrefixCache, logger


class PrefixCachingMixin:
    """The prefix caching side of ``DynamicInferenceContext`` (``prefix_cache`` is None when
    ``enable_prefix_caching`` is off)."""

    def _setup_prefix_caching(self, enable: bool, policy: str, mamba_gb: Optional[float],
                              snapshots: int) -> None:
        """``snapshots``: the hybrid's Mamba state snapshot count (``prefix_snapshot_count``,
        the minimum over the ranks under tensor or pipeline parallelism)."""
        self.enable_prefix_caching, self.prefix_caching_eviction_policy = enable, policy
        self.prefix_caching_mamba_gb = mamba_gb
        self.prefix_cache = self._table.prefix_cache = None
        if not enable:
            return
        mamba = None
        if self.is_hybrid_model:
            # A hybrid's hit resumes from a Mamba state snapshot; without a budget, no hits.
            count = snapshots
            if count == 0:
                logger.warning(
                    "enable_prefix_caching on a hybrid model with prefix_caching_mamba_gb=%s: "
                    "no Mamba state snapshot fits (%d bytes each), so no request can resume "
                    "from the cache", mamba_gb, self.mamba_bytes_per_request)
            layers = self.num_mamba_layers
            mamba = MambaSnapshots(
                count, (layers, *self.mamba_conv_states_shape),
                (layers, *self.mamba_ssm_states_shape), self.mamba_conv_states_dtype,
                self.mamba_ssm_states_dtype, self.device)
        self.prefix_cache = self._table.prefix_cache = PrefixCache(
            self.block_allocator, self.block_size_tokens, policy, mamba)

    def _restore_mamba_snapshots(self) -> None:
        """Hybrid hits: their slots take their snapshots (at every build of the step)."""
        restores = self._table.mamba_restores
        if restores:
            self.prefix_cache.mamba.restore(restores, self._device.mamba_conv_states,
                                            self._device.mamba_ssm_states)

    def prefix_cache_lookup(self, req: Any) -> int:
        """Prompt tokens the next ``add_request`` of the new request ``req`` would take from
        the prefix cache (when its chunk covers them and one token more); 0 without caching.
        Host only (a prompt on the device is copied once)."""
        self._check_allocated(getattr(req, "request_id", None))
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.lookup(req)[0]

    def prefix_cache_first_chunk_boundary(self, req: Any) -> int:
        """Hybrids with prefix caching: the prompt position the first chunk of the new
        request ``req`` should end at, so that its Mamba state at the end of its cached blocks
        is snapshotted for later requests (0: no such boundary; always 0 for other models)."""
        self._check_allocated(getattr(req, "request_id", None))
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.first_chunk_boundary(req)

    def check_availability(self, req: Any) -> Tuple[bool, bool, bool]:
        """``(request slot free, tokens fit, KV blocks available)`` for the whole remaining
        prompt, less what the prefix cache holds of it; host only."""
        self._check_allocated(getattr(req, "request_id", None))
        remaining = req.remaining_prompt_length
        finished = req.finished_chunk_token_count
        bs = self.block_size_tokens
        request_ok = (self.total_request_count < self.max_requests
                      and self.paused_request_count == 0)
        skip, idle = 0, 0
        if self.prefix_cache is not None:
            skip, idle = self.prefix_cache.lookup(req)
        token_ok = self.active_token_count + remaining - skip <= self.max_tokens
        blocks = math.ceil((remaining + finished) / bs) - math.ceil(finished / bs) - skip // bs
        return request_ok, token_ok, self.block_allocator.total_avail >= blocks + idle

    def _plan_update_publishing(self, mask: np.ndarray):
        """Publish the blocks this step computed, then plan the update (so that the plan sees
        them cached); an error of the plan takes the publishing back."""
        table, cache = self._table, self.prefix_cache
        kwargs = dict(chunked_id=self.chunked_prefill_request_id,
                      max_sequence_length=self.max_sequence_length)
        if cache is None:
            return table.plan_update(mask, **kwargs)
        publish = cache.plan_publish(table)
        undo = cache.commit_publish(publish)
        try:
            plan = table.plan_update(mask, **kwargs)
        except BaseException:
            cache.undo_publish(undo)
            raise
        if publish.snapshots:
            # The slots still hold the states the forward left (the update moves no state).
            cache.mamba.save(list(publish.snapshots), self._device.mamba_conv_states,
                             self._device.mamba_ssm_states)
        return plan

    def _after_update_publishing(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.drop_done(self._table.live_ids)
            self._table.mamba_restores = []

    def get_prefix_cache_stats(self) -> Dict[str, float]:
        """Megatron-Core 0.19's counters (``prefix_cache_hits``, ``..._blocks_matched``,
        ``..._prefill_skipped_tokens``, ``..._prefill_computed_tokens``) plus lookups, the hit
        rates and the cached blocks now (``prefix_cache_blocks``, of which ``..._idle``);
        empty without caching."""
        cache = self.prefix_cache
        if cache is None:
            return {}
        stats = cache.stats.as_dict()
        alloc = self.block_allocator
        stats["prefix_cache_blocks"] = len(cache.entries)
        stats["prefix_cache_blocks_idle"] = alloc.idle_count
        return stats
