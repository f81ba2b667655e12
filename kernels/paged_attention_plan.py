"""Paged attention's launch plans, keyed on what its kernels depend on rather than the lengths.

``paged_attention``'s host lengths change from step to step (``max_seqlen_k`` grows by one
every decode step, ``max_seqlen_q`` follows a prefill's chunks), and its launches depend on
them only through:

* the decode kernel's config (tuned per ``bucket_tokens`` of the keys it walks, a window's
  bound applied) and its number of splits of those keys: the decode grid, the ``num_splits``
  and ``lse_offset`` of the decode and merge kernels (both ``do_not_specialize``) and the
  size of the workspace between them;
* the varlen kernel's number of query tiles: its grid;
* which kernels run at all (none for a length of 0; every request decodes where
  ``max_seqlen_q == 1``), and the check ``max_seqlen_k <= block_table columns x block_size``.

So a plan's key (``launch_plan.py``) holds ``length_classes(...)`` in place of the two
lengths: ``max_seqlen_q`` as 1 or "more", ``max_seqlen_k`` as the bucket of the keys the decode
kernel walks (where it runs; else "positive"); anything else (0, a negative value, another
type) as itself, which the full path handles as before. A hit checks the bound, then takes
the launches of its split and tile counts (``AttentionPlan.launches_for``): made once per
count from the plan's first launches by ``KernelLaunch.varied`` and kept, they are the
compiled kernels, grids and arguments the full path gives for those lengths. A length the
checks refuse, a grid over CUDA's limits or a count Triton would compile another kernel for
takes the full path, which refuses the call (with nothing written) or launches it as before.
"""

from __future__ import annotations

import torch

from ._common import GRID_LIMITS
from .launch_plan import KernelLaunch, launch_all
from .paged_attention_decode import decode_workspace, walked_keys

# The tensors of a planned call, in the order paged_attention passes them (the workspace last).
ROLES = ("query", "key_cache", "value_cache", "out", "sinks", "key_scale", "value_scale",
         "cu_query_lengths", "kv_seq_lengths", "block_table", "workspace")
# Split and tile counts a plan keeps launches for: a decode loop moves to the next split count
# every SPLIT_TOKENS steps; prefill chunks come in a few lengths.
MAX_VARIANTS = 64


def length_classes(max_seqlen_q, max_seqlen_k, num_decode_requests, window) -> tuple:
    """The plan key's stand-ins for ``max_seqlen_q`` and ``max_seqlen_k`` (module docstring):
    ``(1 or "more", bucket_tokens of the keys walked)`` where the decode kernel runs, ``("more",
    "positive")`` where only the varlen one does, the two values themselves where they are not
    positive ints (or the window or decode count is not an int, or the window negative: the
    checks refuse those). Every call of the launcher asks, and the layers of a step ask with
    the same objects: the last answer is kept for them."""
    global _LAST_CLASSES
    last = _LAST_CLASSES
    if (max_seqlen_k is last[0] and max_seqlen_q is last[1] and window is last[2]
            and num_decode_requests is last[3]):
        return last[4]
    classes = (max_seqlen_q, max_seqlen_k)
    if (type(max_seqlen_q) is type(max_seqlen_k) is type(window) is type(num_decode_requests)
            is int and max_seqlen_q > 0 and max_seqlen_k > 0 and window >= 0):
        if max_seqlen_q == 1 or num_decode_requests > 0:
            walked = window if 0 < window < max_seqlen_k else max_seqlen_k
            # bucket_tokens(walked), written out: the next power of two.
            classes = (1 if max_seqlen_q == 1 else "more",
                       1 << (walked - 1).bit_length() if walked > 1 else 1)
        else:
            classes = ("more", "positive")
    # (One tuple, read and written whole: another thread sees this answer or the last.)
    _LAST_CLASSES = (max_seqlen_k, max_seqlen_q, window, num_decode_requests, classes)
    return classes


_LAST_CLASSES = (None, None, None, None, None)


def _fits(grid: tuple) -> bool:
    return all(programs <= limit for programs, limit in zip(grid, GRID_LIMITS))


class AttentionPlan:
    """A key's kernel calls: the split-KV decode and its merge, then the varlen kernel (either
    part may be absent), per split and tile count, with the size of the decode's fp32
    workspace; ``launch(found, tensors)`` (laid out as ``ROLES``, without the workspace)
    replays what ``launches_for`` found."""

    def __init__(self, decode: tuple | None, varlen: KernelLaunch | None, workspace: int, *,
                 num_q_heads: int, head_dim: int, capacity: int, window: int):
        launches = (*(decode or ()), *((varlen,) if varlen is not None else ()))
        for launch in launches:
            launch.take_by_position(ROLES)
        self.decode, self.merge = decode or (None, None)
        self.varlen = varlen
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.capacity, self.window = capacity, window
        self.split_tokens = None if decode is None else self.decode.kwargs["SPLIT_TOKENS"]
        self.tile_tokens = None if varlen is None else varlen.kwargs["TILE_TOKENS"]
        counts = (0 if decode is None else self.decode.kwargs["num_splits"],
                  0 if varlen is None else varlen.grid[1])
        self.variants = {counts: (launches, workspace)}
        self._last = (None, None, None)
        # Under the interpreter no launch has a compiled kernel to call.
        self.direct = all(launch.direct for launch in launches)

    @property
    def launches(self) -> tuple:
        """Every launch the plan holds, of every count."""
        return tuple(launch for launches, _ in self.variants.values() for launch in launches)

    def launches_for(self, max_seqlen_q: int, max_seqlen_k: int) -> tuple | None:
        """``(launches, workspace)`` for a call of this plan's key with these lengths, or
        None where the full path must decide (a length over the block table's capacity, a
        grid over CUDA's limits, a count Triton would compile another kernel for)."""
        # The layers of a step call with the same lengths: the last answer first.
        last = self._last
        if last[0] == max_seqlen_k and last[1] == max_seqlen_q:
            return last[2]
        if max_seqlen_k > self.capacity:
            return None
        counts = (0 if self.split_tokens is None
                  else -(-walked_keys(max_seqlen_k, self.window) // self.split_tokens),
                  0 if self.tile_tokens is None else -(-max_seqlen_q // self.tile_tokens))
        found = self.variants.get(counts)
        if found is None:
            found = self._vary(*counts)
            if found is None:
                return None
        self._last = (max_seqlen_k, max_seqlen_q, found)
        return found

    def _vary(self, splits: int, tiles: int) -> tuple | None:
        launches, workspace = [], 0
        if self.decode is not None:
            grid = (*self.decode.grid[:2], splits)
            lse_offset, workspace = decode_workspace(grid[0], self.num_q_heads, self.head_dim,
                                                     splits)
            launches += [_fits(grid) and self.decode.varied(grid, num_splits=splits,
                                                             lse_offset=lse_offset),
                         self.merge.varied(self.merge.grid, num_splits=splits,
                                           lse_offset=lse_offset)]
        if self.varlen is not None:
            grid = (self.varlen.grid[0], tiles, self.varlen.grid[2])
            launches.append(_fits(grid) and self.varlen.varied(grid))
        if not all(launches):
            return None
        if len(self.variants) >= MAX_VARIANTS:
            self.variants.clear()
        found = self.variants[splits, tiles] = (tuple(launches), workspace)
        return found

    def launch(self, found: tuple, tensors: tuple) -> torch.Tensor:
        launches, workspace = found
        workspace = (tensors[0].new_empty(workspace, dtype=torch.float32) if workspace
                     else None)
        tensors = (*tensors, workspace)
        if self.direct:
            launch_all(launches, tensors)
        else:
            for launch in launches:
                launch.launch_with(tensors)
        return tensors[3]
