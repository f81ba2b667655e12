"""The state machine's checks of the active and paused block budgets (docs/SEMANTICS.md §9.3,
§9.4, §17.4), read-only like ``machine_checks``.

The budgets count physical blocks: the active usage is the number of distinct blocks the active
rows hold, the paused usage the number of distinct blocks the paused rows hold and no active row
does (with prefix caching a shared block counts once; without, every block has one holder and
these are the rows' block counts). ``check_budget_usage`` (every check): the allocator's usage
queries and the utilization stats equal those numbers, and active + paused usage equals the
blocks in use. ``check_budget_decisions`` (after every update): a request resumed in the update
leaves the active usage within the active budget; a request still paused could not resume (its
blocks no active row holds, plus its new block, exceed the active budget's room, or no block is
free); an eviction happened only when the paused rows' blocks could exceed the paused budget.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

from machine_model import require


def distinct(blocks: Iterable[List[int]]) -> set:
    return {b for line in blocks for b in line}


class BudgetChecks:
    """Budget checks of a driver's ``ctx`` (its block table read through the model's rows)."""

    def _held(self) -> tuple:
        """``(ids, blocks per row, paused count)`` read from the context."""
        ctx = self.ctx
        ids = ctx.host_request_ids().tolist()
        counts, table = ctx.kv_block_counts_host, ctx.block_table_host
        return ids, [table[row, :counts[row]].tolist() for row in range(len(ids))], \
            ctx.paused_request_count

    def check_budget_usage(self) -> None:
        alloc = self.ctx.block_allocator
        ids, held, P = self._held()
        active, paused = distinct(held[P:]), distinct(held[:P])
        paused_only = paused - active
        got_active, got_paused = alloc.get_active_used(), alloc.get_paused_used()
        require(got_active == len(active) and got_paused == len(paused_only), lambda: (
            f"budget usage: active {got_active} (distinct blocks of the active rows: "
            f"{len(active)}), paused {got_paused} (distinct blocks of paused rows only: "
            f"{len(paused_only)})"))
        require(alloc.get_active_avail() == alloc.active_count - got_active
                and alloc.get_paused_avail() == alloc.paused_count - got_paused,
                "get_active_avail/get_paused_avail disagree with the usage")
        stats = self.ctx.get_kvcache_utilization_stats()
        require(stats["paused_blocks"] == len(paused_only), lambda: f"utilization stats "
                f"paused_blocks {stats['paused_blocks']}, expected {len(paused_only)}")
        used = alloc.total_count - 1 - alloc.total_avail
        require(got_active + got_paused == used, lambda: f"active usage {got_active} + paused "
                f"usage {got_paused} != {used} blocks in use")

    def check_budget_decisions(self, old_blocks: Dict[int, List[int]], candidates: set,
                               evicted: List[int]) -> None:
        """After an update: ``old_blocks`` (id -> blocks before it), ``candidates`` (the ids
        paused before it or that filled their last block in it), ``evicted`` (its evictions)."""
        alloc = self.ctx.block_allocator
        ids, held, P = self._held()
        active = distinct(held[P:])
        resumed = [i for i in ids[P:] if i in candidates]
        require(not resumed or len(active) <= alloc.active_count, lambda: (
            f"requests {resumed} resumed, but the active rows hold {len(active)} distinct "
            f"blocks, beyond the active budget of {alloc.active_count}"))
        if P:
            # LIFO: the right-most paused request is the one that could not resume.
            need = len(set(held[P - 1]) - active) + 1
            require(alloc.total_avail == 0 or need > alloc.active_count - len(active), lambda: (
                f"request {ids[P - 1]} stays paused though it needs {need} blocks (its blocks "
                f"no active row holds, plus one), the active budget has room for "
                f"{alloc.active_count - len(active)} and {alloc.total_avail} blocks are free"))
        if evicted:
            # At eviction time the paused rows were among the paused, evicted and resumed ones
            # and the active rows included those never paused: an upper bound of the usage.
            stable = distinct(held[row] for row in range(P, len(ids)) if ids[row] not in resumed)
            maybe_paused = distinct(held[:P]) | distinct(old_blocks[i] for i in evicted) \
                | distinct(held[row] for row in range(P, len(ids)) if ids[row] in resumed)
            bound = len(maybe_paused - stable)
            require(bound > alloc.paused_count, lambda: (
                f"requests {evicted} were evicted, but the paused requests held at most {bound} "
                f"distinct blocks that no active request held, within the paused budget of "
                f"{alloc.paused_count}"))
