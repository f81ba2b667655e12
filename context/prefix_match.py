"""Megatron-Core 0.19's prefix-match helpers on the context (``dynamic_context.py`` at tag
``core_v0.19.0``: ``_compute_prefix_match``, ``_find_kv_match_count``,
``_find_mamba_match_count``), answered by dynctx's prefix cache (docs/SEMANTICS.md §16 row 43).

They are pure: they say what the next ``add_request`` of a request would match, as
``admission.plan_add`` plans it (``PrefixCache.plan_match``), in 0.19's tuple. Where dynctx's
matching differs, they give dynctx's answer: a request matches on its first chunk only, on its
salted digests, the cached blocks its chunk covers whole, of which it skips at most ``(chunk -
1) // block_size`` (0.19 caps the skipped tokens at ``chunk - 1`` and then rounds them down to
keep two computed tokens); a hybrid skips only up to a block with a Mamba snapshot and shares
the rest for memory (0.19's "memory-only" blocks); a request asking for prompt log probs
matches nothing.
"""

from __future__ import annotations

import numbers
from typing import Any, List, Tuple

import numpy as np

from .admission import check_request
from .prefix_cache import wants_every_prompt_logit

__all__ = ["PrefixMatchHelpers"]


def _count(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    if not low <= value <= high:
        raise ValueError(f"{name}={value} must lie in [{low}, {high}]")
    return int(value)


class PrefixMatchHelpers:
    """The mixin of ``DynamicInferenceContext`` that holds 0.19's prefix-match helpers; it reads
    the context's ``prefix_cache``, ``block_size_tokens``, ``is_hybrid_model`` and ``_table``."""

    def _compute_prefix_match(self, req: Any, prefill_chunk_length: int,
                              record_mamba_match: bool = False
                              ) -> Tuple[List[int], int, int, int, int, int]:
        """``(matched block ids, blocks from the pool, blocks already allocated, blocks the
        request needs after this chunk, prefix skip tokens, effective chunk length)`` of the
        next ``add_request(req, prefill_chunk_length)``; pure. A block of the prefix cache's
        host tier is matched as -1 and counted among the blocks from the pool (it is restored
        into a new one). ``record_mamba_match``: a hybrid's request gets
        ``_mamba_num_matched_blocks``, the matched blocks its Mamba state resumes from."""
        check_request(req)
        self._table.check_bound(getattr(req, "request_id", None))
        chunk = _count(prefill_chunk_length, "prefill_chunk_length", 1,
                       max(1, req.remaining_prompt_length))
        if not isinstance(record_mamba_match, (bool, np.bool_)):
            raise TypeError(f"record_mamba_match={record_mamba_match!r} must be a bool")
        bs = self.block_size_tokens
        finished = req.finished_chunk_token_count
        already = -(-finished // bs)
        overall = -(-(finished + chunk) // bs)
        cache = self.prefix_cache
        matched: List[int] = []
        skip = skipped = 0
        if cache is not None and finished == 0:
            hit = cache.plan_match(req, getattr(req, "request_id", -1), chunk,
                                   allow_hit=not wants_every_prompt_logit(req))
            matched, skip, skipped = hit.blocks.tolist(), hit.tokens, hit.skipped
        if record_mamba_match and self.is_hybrid_model and finished == 0:
            req._mamba_num_matched_blocks = skipped
        on_device = sum(block >= 0 for block in matched)
        return matched, max(0, overall - already - on_device), already, overall, skip, \
            chunk - skip

    def _find_kv_match_count(self, req: Any, start_block: int,
                             end_block: int) -> Tuple[List[int], int]:
        """``(block ids, parent hash)``: the cached blocks ``start_block..`` of the new
        request's prompt chain below ``end_block`` (the chain matches from its first block, so
        it must reach ``start_block``; device blocks only, the host tier has no block ids),
        and 0.19's hash of the last one (0: none); pure."""
        check_request(req)
        self._table.check_bound(getattr(req, "request_id", None))
        start = _count(start_block, "start_block", 0, 2**62)
        end = _count(end_block, "end_block", 0, 2**62)
        cache = self.prefix_cache
        if cache is None or start >= end:
            return [], 0
        _, blocks = cache.matched_chain(req, end)
        if len(blocks) <= start:
            return [], 0
        return blocks[start:], int(self.kv_block_allocator.hash_ids[blocks[-1]])

    def _find_mamba_match_count(self, req: Any, start_block: int, end_block: int) -> int:
        """Hybrids: ``i + 1`` for the last block ``i`` of the new request's chain blocks
        ``start_block..end_block - 1`` (counted from ``start_block``) that is cached with a
        Mamba snapshot at its end; 0 when none or not a hybrid; pure."""
        check_request(req)
        self._table.check_bound(getattr(req, "request_id", None))
        start = _count(start_block, "start_block", 0, 2**62)
        end = _count(end_block, "end_block", 0, 2**62)
        cache = self.prefix_cache
        if cache is None or cache.mamba is None or start >= end:
            return 0
        links, blocks = cache.matched_chain(req, end)
        return cache.snapshot_count(links, start, min(end, len(blocks)))
