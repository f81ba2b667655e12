"""The state machine's KV group checks (``MachineConfig.windows``: docs/SEMANTICS.md §22).

Read-only. ``check_kv_groups`` (part of every ``check()``): each windowed group's pool holds
every block once (free, or the group block of exactly one group-0 block), its map keys only
blocks a live row's window still reads, and every row at most its bound of blocks,
``ceil((q + W - 1) / block_size) + 1`` for a query of ``q`` tokens (``ceil(W / block_size) +
1`` for one); ``settled=True`` (after ``initialize_attention_state``): the map holds exactly
what the windows read and the step's device tables equal ``map[group 0's table]``.
With prefix caching a copy no window reads may stay, idle, while its group-0 block is cached
(every idle copy is of a cached block, and no other copy is unread). ``windowed_blocks`` gives
``check_kv`` the block of a windowed layer (-1: released) and the first position its window
keeps.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
from machine_model import require

from dynctx.context.dynamic_context import FIELD_BLOCKS, FIELD_KV_OFFSET, FIELD_QUERY


class GroupChecks:
    """Mixed into ``InvariantChecks``: needs ``self.ctx`` and ``self.cfg``."""

    def _groups(self):
        kv = self.ctx._kv
        return getattr(kv, "groups", None), getattr(kv, "spec", None)

    def windowed_blocks(self, layer: int, rows: np.ndarray, blocks: np.ndarray
                        ) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """For attention layer ``layer`` (0-based) of a windowed group: ``(its blocks for
        group-0 ``blocks``, the first position each entry's row keeps)``, rows being the rows
        of the entries; ``(None, None)`` for a full layer or no groups."""
        groups, spec = self._groups()
        if groups is None or spec.where[layer][0] == 0:
            return None, None
        group = groups[spec.where[layer][0] - 1]
        offsets = self.ctx._h_req[FIELD_KV_OFFSET].astype(np.int64)[rows]
        bs = self.cfg.block_size
        first = np.maximum(offsets - (group.window - 1), 0) // bs * bs
        return group.map[blocks], first

    def check_kv_groups(self, settled: bool = False) -> None:
        groups, spec = self._groups()
        if groups is None:
            require(self.cfg.windows is None or self.ctx.kv_group_usage() is None,
                    "a context without groups reports group usage")
            return
        ctx, bs = self.ctx, self.cfg.block_size
        table, h, total = ctx._table, ctx._h_req, ctx.total_request_count
        usage = ctx.kv_group_usage()
        for g, group in enumerate(groups, start=1):
            name = f"KV group {g} (window {group.window})"
            free = group.free[:group.free_count]
            held = group.map[group.map >= 0]
            held = held[held != group.dummy]
            require(np.unique(free).size == free.size, f"{name}: a block free twice")
            require(np.unique(held).size == held.size, f"{name}: a block held twice")
            require(np.intersect1d(free, held).size == 0, f"{name}: a block free and held")
            require(free.size + held.size == group.blocks - 1, lambda: f"{name}: blocks lost: "
                    f"{free.size} free + {held.size} held != {group.blocks - 1}")
            require(group.map[table.allocator.dummy_block_idx] == group.dummy,
                    f"{name}: the dummy block is not mapped to the group's dummy")
            require(usage["held"][g] == held.size, f"{name}: kv_group_usage disagrees")
            need = group.needed(table)
            wanted = np.unique(table.block_table[:total][need])
            keys = np.flatnonzero(group.map >= 0)
            keys = keys[keys != table.allocator.dummy_block_idx]
            require(np.array_equal(group.owner[group.map[keys]], keys),
                    f"{name}: a block's owner is not the group-0 block that maps it")
            # Prefix caching: a copy no window reads stays, idle, for a cached group-0 block.
            idle = keys[group.idle_since[group.map[keys]] >= 0]
            read = np.setdiff1d(keys, idle)
            cached = np.flatnonzero(table.allocator.cached)
            require(usage["idle"][g] == idle.size, f"{name}: kv_group_usage's idle disagrees")
            require(np.setdiff1d(read, wanted).size == 0, lambda: f"{name}: holds blocks for "
                    f"group-0 blocks {np.setdiff1d(read, wanted).tolist()} no window reads")
            require(np.setdiff1d(idle, np.union1d(cached, wanted)).size == 0, lambda:
                    f"{name}: keeps idle copies of uncached group-0 blocks "
                    f"{np.setdiff1d(idle, np.union1d(cached, wanted)).tolist()}")
            if settled:
                require(np.array_equal(read, wanted), lambda: f"{name}: lacks blocks for "
                        f"{np.setdiff1d(wanted, read).tolist()}")
                require(np.setdiff1d(idle, cached).size == 0 and
                        np.intersect1d(idle, wanted).size == 0,
                        f"{name}: an idle copy is read, or of an uncached block")
            for row in range(total):
                q = int(h[FIELD_QUERY, row])
                count = int(need[row].sum())
                bound = math.ceil((q + group.reach - 1) / bs) + 1
                require(count <= bound, lambda: f"{name}: row {row} holds {count} blocks, over "
                        f"its bound {bound} (query {q})")
                # Outside the window: released (or kept idle, or read by another row's window:
                # prefix caching), in the group's table.
                line = table.block_table[row, :int(h[FIELD_BLOCKS, row])]
                first = max(int(h[FIELD_KV_OFFSET, row]) - (group.reach - 1), 0) // bs
                before = line[:first]
                before = before[group.map[before] >= 0]
                require(not settled or np.isin(before, np.union1d(idle, wanted)).all(),
                        f"{name}: row {row} keeps a block before its window")
        if settled:
            meta = ctx.active_attn_metadata
            main = meta.kv_group_block_tables[0].numpy()
            for g, group in enumerate(groups, start=1):
                got = meta.kv_group_block_tables[g].numpy()
                require(np.array_equal(got, group.map[main]), f"KV group {g}: the step's "
                        "table is not the map of group 0's")
                n = ctx.padded_active_token_count
                tokens = ctx.token_to_block_idx[:n].numpy()
                require(np.array_equal(group.token_blocks[:n].numpy(), group.map[tokens]),
                        f"KV group {g}: the step's token blocks are not the map of group 0's")
