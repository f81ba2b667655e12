"""KV groups before anything is built: which layers form which group, and each group's blocks.

``group_spec`` turns the constructor's ``kv_layer_windows`` and ``kv_groups`` into a
``GroupSpec`` (or None: the single group), refusing the options groups do not serve yet.
``sized_with_groups`` splits the memory layout of the context without groups
(``sizing.memory_layout``) between the groups (docs/SEMANTICS.md §22):

* **Windowed and full layers.** A windowed group gets the most blocks it can ever hold
  (``worst_case_blocks``), capped at group 0's count; group 0 (the full layers) gets the rest
  of the bytes (``group_block_counts``, ``grouped_memory``).
* **Every layer windowed.** Group 0 holds no layers: its blocks are the requests' block-table
  entries, which key the windowed groups' blocks, and cost no bytes. When the windowed groups'
  worst cases fit the bytes of the buffer (``windowed_fit``), each gets its worst case and
  group 0 gets enough blocks that every row can reach ``max_sequence_length`` without a pause
  (at most ``LOGICAL_BLOCK_CAP``); otherwise group 0 keeps the buffer's block count (its
  budgets bound every group, as without groups) and each windowed group gets its worst case
  capped at that count (``all_windowed_memory``). With ``max_requests`` not given, the context
  derives the most requests whose worst cases fit (``windowed_requests_rule``), at most
  ``max_tokens``.

Either way a windowed group can never run short, and the admission, pause and eviction rules
run on group 0 alone.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .sizing import MAX_BLOCK_TABLE_BYTES

# With every layer windowed, group 0's blocks cost no bytes, only host bookkeeping (about ten
# bytes each) and each windowed group's map (four bytes each, on the device too).
LOGICAL_BLOCK_CAP = 1 << 20


@dataclass(frozen=True)
class GroupSpec:
    """Which attention layers form which group: ``windows[g]`` (group 0: None, the full
    layers, none when every layer is windowed; then the windows, ascending), ``layers[g]``
    (0-based attention-layer indices) and ``where[layer] = (group, index within the group)``.
    ``margin``: tokens a window keeps beyond itself (a speculative step's rewind)."""

    windows: Tuple[Optional[int], ...]
    layers: Tuple[Tuple[int, ...], ...]
    where: Tuple[Tuple[int, int], ...]
    margin: int = 0

    @property
    def group_of_layer(self) -> Tuple[int, ...]:
        return tuple(group for group, _ in self.where)

    @property
    def all_windowed(self) -> bool:
        """Every layer windowed: group 0 holds no layers."""
        return not self.layers[0]

    def reach(self, group: int) -> int:
        """The tokens before a query (itself included) that windowed group ``group`` keeps."""
        return self.windows[group] + self.margin


def check_layer_windows(kv_layer_windows: Any, num_attention_layers: int
                        ) -> Optional[Tuple[Optional[int], ...]]:
    """``kv_layer_windows`` checked: None, or one entry per attention layer, each None (a full
    layer) or an int >= 1 (the keys a query sees, its own included)."""
    if kv_layer_windows is None:
        return None
    if isinstance(kv_layer_windows, (str, bytes)) or not isinstance(kv_layer_windows, Sequence):
        raise TypeError(f"kv_layer_windows={kv_layer_windows!r} must be a list with one window "
                        "(an int >= 1, or None for a full layer) per attention layer")
    windows = tuple(kv_layer_windows)
    if len(windows) != num_attention_layers:
        raise ValueError(f"kv_layer_windows has {len(windows)} entries; the context has "
                         f"{num_attention_layers} attention layers (one window each)")
    for layer, window in enumerate(windows):
        if window is not None and (isinstance(window, bool) or not isinstance(
                window, (int, np.integer)) or window < 1):
            raise ValueError(f"kv_layer_windows[{layer}]={window!r} must be an int >= 1 (keys "
                             "a query sees, its own included) or None (a full layer)")
    return tuple(None if w is None else int(w) for w in windows)


def window_groups(windows: Optional[Tuple[Optional[int], ...]], max_sequence_length: int,
                  margin: int = 0) -> Optional[GroupSpec]:
    """The groups of checked ``windows`` (``check_layer_windows``), or None when no layer has
    a window shorter than ``max_sequence_length`` (a longer one never frees a block)."""
    if windows is None:
        return None
    windows = tuple(None if w is None or w >= max_sequence_length else w for w in windows)
    distinct = sorted({w for w in windows if w is not None})
    if not distinct:
        return None
    order = [None] + distinct
    layers = tuple(tuple(i for i, w in enumerate(windows) if w == window) for window in order)
    where = [None] * len(windows)
    for group, members in enumerate(layers):
        for index, layer in enumerate(members):
            where[layer] = (group, index)
    return GroupSpec(tuple(order), layers, tuple(where), int(margin))


def group_spec(kv_layer_windows: Any, kv_groups: Any, *, num_attention_layers: int,
               max_sequence_length: int, speculative: int, mla: bool,
               hybrid: bool) -> Optional[GroupSpec]:
    """The groups of the constructor's ``kv_layer_windows`` and ``kv_groups`` (module
    docstring), or None for the single group; raises before anything is built."""
    if not isinstance(kv_groups, bool):
        raise TypeError(f"kv_groups={kv_groups!r} must be a bool")
    windows = check_layer_windows(kv_layer_windows, num_attention_layers)
    if not kv_groups:
        return None
    # Speculative steps: a rewind lowers a row's offset by up to ``speculative`` tokens, so
    # each window keeps that many more (the margin).
    spec = window_groups(windows, max_sequence_length, margin=speculative)
    if spec is None:
        return None
    refused = [what for what, on in (
        ("cache_mla_latent=True", mla),
        ("a hybrid model (mamba_inference_state_config)", hybrid)) if on]
    if refused:
        raise ValueError(f"KV groups (kv_layer_windows with windows shorter than "
                         f"max_sequence_length, kv_groups=True) do not support "
                         f"{', '.join(refused)} yet; pass kv_groups=False to keep every block "
                         "of every layer")
    return spec


def worst_case_blocks(window: int, *, block_size: int, max_requests: int,
                      max_tokens: int) -> int:
    """The most blocks a windowed group can hold at once (its dummy block included)."""
    return (math.ceil((max_tokens + max_requests * window) / block_size)
            + 2 * max_requests + 1)


def _worst_cases(spec: GroupSpec, *, block_size: int, max_requests: int,
                 max_tokens: int) -> List[int]:
    return [worst_case_blocks(spec.reach(g), block_size=block_size, max_requests=max_requests,
                              max_tokens=max_tokens) for g in range(1, len(spec.windows))]


def group_block_counts(spec: GroupSpec, total_blocks: int, *, block_size: int,
                       max_requests: int, max_tokens: int) -> Tuple[int, List[int]]:
    """``(group 0's blocks, [each windowed group's blocks])``, dummies included, out of the
    layer-blocks of ``total_blocks`` blocks of every layer (module docstring: a windowed group
    gets its worst case, capped at group 0's count; group 0 the rest)."""
    sizes = [len(members) for members in spec.layers]
    budget = total_blocks * sum(sizes)
    worst = _worst_cases(spec, block_size=block_size, max_requests=max_requests,
                         max_tokens=max_tokens)
    capped = {g: worst[g - 1] for g in range(1, len(sizes))}
    while True:
        free_layers = sizes[0] + sum(sizes[g] for g in range(1, len(sizes)) if g not in capped)
        main = (budget - sum(capped[g] * sizes[g] for g in capped)) // free_layers
        over = [g for g, blocks in capped.items() if blocks > main]
        if not over:
            break
        for g in over:
            del capped[g]
    return main, [capped.get(g, main) for g in range(1, len(sizes))]


def windowed_fit(spec: GroupSpec, total_blocks: int, *, block_size: int, max_requests: int,
                 max_tokens: int) -> Optional[List[int]]:
    """Every layer windowed: each windowed group's worst case when together they fit the
    layer-blocks of ``total_blocks`` blocks of every layer, else None."""
    sizes = [len(members) for members in spec.layers]
    worst = _worst_cases(spec, block_size=block_size, max_requests=max_requests,
                         max_tokens=max_tokens)
    used = sum(blocks * size for blocks, size in zip(worst, sizes[1:]))
    return worst if used <= total_blocks * sum(sizes) else None


def windowed_requests_rule(spec: Optional[GroupSpec], *, block_size: int, max_tokens: int
                           ) -> Optional[Callable[[int], int]]:
    """Every layer windowed (else None): the rule that derives ``max_requests`` from the
    buffer's block count (``sizing.memory_layout``'s ``derive_requests``): the most requests,
    at most ``max_tokens`` and the blocks, whose worst cases fit; the blocks less the dummy
    (the rule without groups) when not even one request fits."""
    if spec is None or not spec.all_windowed:
        return None

    def rule(total_count: int) -> int:
        low, high = 0, min(total_count - 1, max_tokens)
        while low < high:
            middle = (low + high + 1) // 2
            if windowed_fit(spec, total_count, block_size=block_size, max_requests=middle,
                            max_tokens=max_tokens) is None:
                high = middle - 1
            else:
                low = middle
        return low if low >= 1 else total_count - 1

    return rule


def grouped_memory(memory: Any, main_blocks: int, layer_fraction: Tuple[int, int],
                   max_sequence_length: int, block_size: int) -> Any:
    """``memory`` (``sizing.MemoryLayout``) for group 0 alone: ``main_blocks`` blocks of its
    layers (``layer_fraction``: its layers, all layers), its paused budget the same share of
    them as before."""
    paused = memory.paused_blocks * main_blocks // memory.total_blocks
    paused = min(paused, main_blocks - 2)
    own, every = layer_fraction
    columns = min(math.ceil(max_sequence_length / block_size), main_blocks - 1)
    return replace(memory, total_blocks=main_blocks, paused_blocks=paused,
                   max_kv_block_count=columns,
                   block_size_bytes=memory.block_size_bytes * own // every,
                   bytes_per_block=memory.bytes_per_block * own // every)


def all_windowed_memory(spec: GroupSpec, memory: Any, *, max_sequence_length: int,
                        block_size: int) -> Tuple[Any, List[int]]:
    """Every layer windowed: ``(group 0's memory layout, each windowed group's blocks)``
    (module docstring). Group 0's blocks cost no bytes (``block_size_bytes`` 0);
    ``bytes_per_block`` stays the buffer's, what one more block of the buffer costs."""
    rows, total = memory.max_requests, memory.total_blocks
    sizes = dict(block_size=block_size, max_requests=rows, max_tokens=memory.max_tokens)
    worst = windowed_fit(spec, total, **sizes)
    if worst is None:
        windowed = [min(blocks, total) for blocks in _worst_cases(spec, **sizes)]
        return replace(memory, block_size_bytes=0), windowed
    columns = min(math.ceil(max_sequence_length / block_size),
                  max(memory.max_kv_block_count, MAX_BLOCK_TABLE_BYTES // (4 * rows)))
    active = rows * columns
    paused = min(active, memory.paused_blocks * active
                 // max(1, total - memory.paused_blocks - 1))
    logical = active + paused + 1
    if logical > LOGICAL_BLOCK_CAP:
        logical = max(total, LOGICAL_BLOCK_CAP)
        paused = min(memory.paused_blocks * logical // total, logical - 2)
        columns = min(columns, logical - 1)
    return replace(memory, total_blocks=logical, paused_blocks=paused,
                   max_kv_block_count=columns, block_size_bytes=0), worst


SIZING_WARNING = "a long request may pause with no way to resume"


def reissue_sizing_warnings(records: list, memory: Any, max_sequence_length: int,
                            block_size: int) -> None:
    """Issue again the warnings ``sizing.memory_layout`` gave before the split
    (``records``), its sizing warning only if group 0's active budget (``memory``) still
    cannot hold one request of ``max_sequence_length``, with group 0's counts."""
    needed = math.ceil(max_sequence_length / block_size)
    active = memory.total_blocks - memory.paused_blocks - 1
    for record in records:
        message = str(record.message)
        if SIZING_WARNING in message:
            if active >= needed:
                continue
            message = (f"max_sequence_length={max_sequence_length} needs {needed} blocks of "
                       f"{block_size} tokens for one request, but KV group 0 (the requests' "
                       f"block tables) has an active budget of {active} (the paused budget is "
                       f"{memory.paused_blocks} blocks): {SIZING_WARNING}, and update_requests "
                       "then raises 'no request can run'. Raise buffer_size_gb (or lower "
                       "paused_buffer_size_gb), or lower max_sequence_length")
        warnings.warn_explicit(message, record.category, record.filename, record.lineno)


def sized_with_groups(spec: Optional[GroupSpec], layout: Any, *, max_sequence_length: int,
                      block_size: int, attention_layers: int) -> Tuple[Any, Optional[list]]:
    """``(memory layout, each windowed group's blocks)``: ``layout()`` (the context's
    ``sizing.memory_layout``) as it is without groups (``spec`` None); with groups split
    (module docstring), its warnings issued on group 0's counts."""
    if spec is None:
        return layout(), None
    with warnings.catch_warnings(record=True) as sizing:
        warnings.simplefilter("always")
        memory = layout()
    if spec.all_windowed:
        memory, windowed = all_windowed_memory(spec, memory,
                                               max_sequence_length=max_sequence_length,
                                               block_size=block_size)
    else:
        main_blocks, windowed = group_block_counts(spec, memory.total_blocks,
                                                   block_size=block_size,
                                                   max_requests=memory.max_requests,
                                                   max_tokens=memory.max_tokens)
        memory = grouped_memory(memory, main_blocks, (len(spec.layers[0]), attention_layers),
                                max_sequence_length, block_size)
    reissue_sizing_warnings(sizing, memory, max_sequence_length, block_size)
    return memory, windowed
