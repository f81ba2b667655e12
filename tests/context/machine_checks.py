"""The invariants the driver checks after every action (read-only: nothing here changes the
context or the driver's model).

``check()``: every block free or owned by exactly one live request with nothing leaked; counts
and rows consistent with the model; block counts == ceil(kv length / block size); the device
mirrors equal the host; the cached K/V of every live request (paused ones included) read back
through ``key_value_cache`` equal the pattern. Hybrids also: each live request owns the one
Mamba slot it got when added, slots distinct, free + live == max_requests, and every live
request's Mamba state holds its last pattern. ``_check_step_metadata``, ``_check_mamba_metadata``
and ``_check_logits`` check one step's metadata and logits helpers against the model.
"""

from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
import torch
from helpers import FIELD_NAMES
from machine_budgets import BudgetChecks
from machine_groups import GroupChecks
from machine_host_tier import HostTierChecks
from machine_model import VOCAB, Tracked, Violation, expected_metadata, require
from machine_patterns import Patterns

from dynctx.context.dynamic_context import (
    FIELD_BLOCKS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_OUTPUT,
    FIELD_QUERY,
)


class InvariantChecks(BudgetChecks, Patterns, GroupChecks, HostTierChecks):
    """Checks of a driver's ``ctx`` against its model (``cfg``, ``live``, ``chunked``)."""

    def _rows(self) -> List[Tracked]:
        ids = self.ctx.host_request_ids().tolist()
        require(len(set(ids)) == len(ids), lambda: f"a request id sits in two rows: {ids}")
        require(set(ids) == set(self.live), lambda: f"context rows {sorted(ids)} != live "
                f"requests {sorted(self.live)}")
        return [self.live[i] for i in ids]


    def _blocks_written_by_the_step(self, ids: List[int], table: np.ndarray) -> np.ndarray:
        """The blocks the pending prompt chunks complete and write to (not the ones they
        share): another request may share them before the forward writes them."""
        bs = self.cfg.block_size
        out = []
        for row, rid in enumerate(ids):
            t = self.live[rid]
            if not (t.prefill and t.query) or t.paused:
                continue
            first = max(t.query_start, t.shared) // bs
            end = (t.query_start + len(t.query)) // bs
            out.append(table[row, first:end])
        return np.concatenate(out).astype(np.int64) if out else np.empty(0, dtype=np.int64)

    def check_kv(self) -> None:
        """Every live request's cached K/V (positions < cached) equal the pattern."""
        ctx, cfg = self.ctx, self.cfg
        bs = cfg.block_size
        ids = ctx.host_request_ids().tolist()
        table = ctx.block_table_host
        uids, positions, blocks, owners, rows = [], [], [], [], []
        for row, rid in enumerate(ids):
            t = self.live[rid]
            pos = np.arange(t.cached)
            uids.append(self.kv_uids(t, pos))
            positions.append(pos)
            blocks.append(table[row, pos // bs])
            owners.append(np.full(t.cached, rid))
            rows.append(np.full(t.cached, row))
        if not ids:
            return
        uids, positions, blocks, owners, rows = map(np.concatenate,
                                                    (uids, positions, blocks, owners, rows))
        if positions.size == 0:
            return
        require(np.all(blocks >= 0), "a cached position has no block")
        # A prompt block shared the step it is added in (0.19) is written by its owner's
        # forward: until then no position in it is checked.
        writing = self._blocks_written_by_the_step(ids, table)
        if writing.size:
            later = np.isin(blocks, writing)
            uids, positions, blocks, owners, rows = (
                a[~later] for a in (uids, positions, blocks, owners, rows))
        slots = positions % bs
        for layer, number in enumerate(cfg.attention_layers):
            expected = self.pattern(uids, positions, layer)
            k_cache, v_cache = ctx.key_value_cache(number)
            # A windowed layer (KV groups) keeps the positions its window still reads, in its
            # group's blocks.
            keep = np.ones(positions.size, dtype=np.bool_)
            at = blocks
            group_blocks, first = self.windowed_blocks(layer, rows, blocks)
            if group_blocks is not None:
                keep = positions >= first
                at = group_blocks
                require(np.all(at[keep] >= 0), lambda: f"layer {number}: a position its window "
                        "reads has no block in its KV group")
            expected = expected[keep]
            if not keep.any():
                continue
            b, s = at[keep], slots[keep]
            if cfg.mla:
                require(v_cache is None, "the MLA cache returned a V view")
                got = k_cache[b, s].numpy()
            else:
                got = np.stack([k_cache[b, s].numpy(), v_cache[b, s].numpy()], axis=1)
            bad = np.flatnonzero((got != expected).reshape(len(b), -1).any(axis=1))
            if bad.size:
                j = bad[0]
                i = np.flatnonzero(keep)[j]
                rid = owners[i]
                raise Violation(
                    f"cached K/V of request {rid} (uid {uids[i]}) at position {positions[i]}, "
                    f"layer {number}, block {at[i]} slot {slots[i]} is "
                    f"{self._decode(got[j].reshape(-1)[0])}, expected "
                    f"{self._decode(expected[j].reshape(-1)[0])} ({bad.size} positions differ)")

    def check_prefix_cache(self, holdings: np.ndarray, free: np.ndarray) -> None:
        """Prefix caching: a block's reference count is the number of block-table entries
        holding it; the cached blocks are exactly the digest table's, distinct; the idle
        section (the bottom of the free stack) holds exactly the cached blocks nobody
        references; free (uncached) + idle cached + owned == every block but the dummy; and a
        cached block's bytes never change while it stays cached (read back here, compared with
        the bytes it had when first seen cached)."""
        ctx = self.ctx
        alloc, cache = ctx.block_allocator, ctx.prefix_cache
        total = alloc.total_count
        holders = np.bincount(holdings, minlength=total)
        require(np.array_equal(alloc.ref_counts[:total - 1], holders[:total - 1]),
                lambda: "reference counts != block-table holdings at blocks "
                f"{np.flatnonzero(alloc.ref_counts[:total - 1] != holders[:total - 1]).tolist()}")
        cached_ids = np.array(sorted(block for block, _, _ in cache.entries.values()),
                              dtype=np.int64)
        require(np.unique(cached_ids).size == cached_ids.size
                and np.array_equal(np.flatnonzero(alloc.cached), cached_ids)
                and all(cache.block_digest[b] == d for d, (b, _, _) in cache.entries.items())
                and len(cache.block_digest) == len(cache.entries),
                "the cached marks disagree with the digest table")
        require(np.array_equal(alloc.hash_ids != -1, alloc.cached)
                and np.array_equal(np.flatnonzero(alloc.parent_ids >= 0),
                                   np.flatnonzero(alloc.cached & (alloc.parent_ids >= 0)))
                and np.array_equal(np.bincount(alloc.parent_ids[alloc.parent_ids >= 0],
                                               minlength=total), alloc.child_counts),
                "0.19's block_hashes / parents / child counts disagree with the cached marks")
        idle = alloc.block_bag[:alloc.idle_count].astype(np.int64)
        want_idle = cached_ids[alloc.ref_counts[cached_ids] == 0]
        require(np.array_equal(np.sort(idle), want_idle), lambda: f"idle section "
                f"{idle.tolist()} != cached blocks without references {want_idle.tolist()}")
        require(self.cfg.prefix_caching == "lru" or idle.size == 0,
                "ref_zero keeps a cached block nobody references")
        uncached_free = free[alloc.idle_count:]
        require(not alloc.cached[uncached_free].any(), "a cached block sits among the free "
                "uncached blocks (allocation would hand it out first)")
        owned = np.unique(holdings)
        require(uncached_free.size + idle.size + owned.size == total - 1,
                lambda: f"{uncached_free.size} free + {idle.size} idle cached + {owned.size} "
                f"owned != {total - 1} blocks")
        buffer = ctx.memory_buffer
        axis = 1 if self.cfg.mla else 2
        seen = self.__dict__.setdefault("_cached_bytes", {})
        for block in [b for b in seen if not alloc.cached[b]]:
            del seen[block]
        # A block is cached at the add that fills it (0.19), before the forward writes it: its
        # bytes are first recorded once no prompt chunk waits for its forward.
        pending = any(t.prefill and t.query for t in self._rows()[ctx.paused_request_count:])
        for digest, (block, _, _) in cache.entries.items():
            now = buffer.select(axis, block).clone()
            if block in seen and seen[block][0] == digest:
                require(torch.equal(seen[block][1], now), lambda: f"cached block {block} "
                        "changed while cached")
            elif pending:
                seen.pop(block, None)
            else:
                seen[block] = (digest, now)

    # ------------------------------------------------------------------ Mamba (hybrids)
    def _slot_stack(self) -> Optional[List[int]]:
        """The free Mamba slots, bottom to top of the stack (None for a non-hybrid)."""
        if not self.cfg.hybrid or not self.ctx.is_tensor_state_allocated:
            return None
        slots = self.ctx._mamba_slots
        return slots.free_slots[:slots.free_count].tolist()


    def _check_mamba_states(self, live: List[Tracked], what: str, fresh_zero: bool) -> None:
        """Each request's state (through ``mamba_states_cache`` at its slot) holds its last
        pattern; one not written yet holds zeros (``fresh_zero``: it went through an
        ``initialize_attention_state``) or is skipped (its state is zeroed at the next one)."""
        if not fresh_zero:
            live = [t for t in live if t.mamba_writes]
        if not live:
            return
        cfg, ctx = self.cfg, self.ctx
        slots = torch.tensor([t.slot for t in live], dtype=torch.int64)
        uids, writes, fresh = self.mamba_keys(live)
        wants = self.mamba_pattern(uids, writes)
        caches = [ctx.mamba_states_cache(number) for number in cfg.mamba_layers]
        for ssm, want in enumerate(wants):
            got = torch.stack([c[ssm][slots] for c in caches], dim=1).numpy()  # [n, layers, ...]
            want[fresh] = 0
            differs = (got != want).reshape(len(live), -1)
            bad = np.flatnonzero(differs.any(axis=1))
            if bad.size:
                i = bad[0]
                t = live[i]
                first = np.flatnonzero(differs[i])[0]
                layer = cfg.mamba_layers[first // (differs.shape[1] // len(caches))]
                expected = ("zeros (a new request)" if fresh[i] else
                            self._decode_mamba(want[i].reshape(-1)[first]))
                raise Violation(
                    f"{what}: Mamba {('conv', 'ssm')[ssm]} state of request {t.rid} (uid "
                    f"{t.uid}, slot {t.slot}{', paused' if t.paused else ''}) in layer "
                    f"{layer} is {self._decode_mamba(got[i].reshape(-1)[first])}, expected "
                    f"{expected} ({bad.size} requests differ)")

    def _check_mamba_metadata(self, rows: List[Tracked], P: int, active: List[Tracked]) -> dict:
        ctx = self.ctx
        meta = ctx.mamba_metadata
        require(meta is not None, "no mamba_metadata after initialize_attention_state")
        continued = [i for i, t in enumerate(active) if t.continued]
        require(len(continued) <= 1 and (not continued or continued[0] == len(active) - 1),
                lambda: f"continuation chunks at active indices {continued}")
        chunked = bool(continued)
        decode = sum(not t.prefill for t in active)
        regular = len(active) - decode - int(chunked)
        padded = ctx.padded_batch_dimensions
        pd, pp = padded.decode_req_count, padded.prefill_req_count
        require(ctx.batch_dimensions.has_explicit_chunked_prefill_req == chunked
                and padded.has_explicit_chunked_prefill_req == chunked,
                lambda: f"chunked flags {ctx.batch_dimensions!r} / {padded!r}, expected {chunked}")
        slots = [t.slot for t in active]
        T = len(rows)
        got_map = meta.request_to_mamba_state_idx.numpy()
        want_map = [t.slot for t in rows] + [-1] * (len(got_map) - T)
        require(got_map.tolist() == want_map, lambda: f"request_to_mamba_state_idx "
                f"{got_map.tolist()}, expected {want_map}")

        def same(name, got, want):
            got = None if got is None else got.reshape(-1).tolist()
            require(got == want, lambda: f"mamba_metadata.{name} is {got}, expected {want}")

        same("batch_indices_decode", meta.batch_indices_decode,
             slots[:decode] + [-1] * (pd - decode) if pd else None)
        same("batch_indices_prefill", meta.batch_indices_prefill,
             slots[decode:decode + regular] + [-1] * (pp - regular) if pp else None)
        same("batch_indices_chunked_prefill", meta.batch_indices_chunked_prefill,
             [slots[-1]] if chunked else None)
        lengths = [len(t.query) for t in active[decode:decode + regular]]
        cu = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        same("cu_seqlens", meta.cu_seqlens,
             cu.tolist() + [int(cu[-1])] * (pp - regular) if pp else None)
        n = ctx.padded_active_token_count
        seq = np.repeat(np.arange(regular), lengths).tolist()
        same("seq_idx", meta.seq_idx, seq + [-1] * (n - len(seq)) if pp else None)
        require(meta.seq_idx is None or tuple(meta.seq_idx.shape) == (1, n),
                lambda: f"seq_idx shape {tuple(meta.seq_idx.shape)}, expected (1, {n})")
        require(tuple(meta.device_decode_prefill) == (decode, regular), lambda: f"device_decode_"
                f"prefill {meta.device_decode_prefill}, expected {(decode, regular)}")
        want = (int(cu[-1]), len(active[-1].query)) if chunked else None
        got = None if meta.device_chunked_prefill is None else tuple(meta.device_chunked_prefill)
        require(got == want, lambda: f"device_chunked_prefill {got}, expected {want}")
        return dict(decode=decode, regular=regular, chunked=chunked)


    def check_mamba(self, rows: List[Tracked], device: bool) -> None:
        """Slot invariants and every live request's Mamba state (paused ones included)."""
        ctx, cfg = self.ctx, self.cfg
        T = len(rows)
        h = ctx._h_req
        slots = h[FIELD_MAMBA_SLOT, :T].astype(np.int64)
        for row, t in enumerate(rows):
            require(slots[row] == t.slot and t.slot >= 0, lambda: f"request {t.rid} (row {row}) "
                    f"has Mamba slot {slots[row]}; it was given slot {t.slot}")
        require(np.unique(slots).size == T, lambda: f"two requests share a Mamba slot: "
                f"{slots.tolist()}")
        require(np.all(h[FIELD_MAMBA_SLOT, T:] == -1), "a free row holds a Mamba slot")
        free = np.array(self._slot_stack(), dtype=np.int64)
        require(np.unique(free).size == free.size, lambda: f"the free Mamba slot stack holds a "
                f"slot twice: {free.tolist()}")
        require(np.intersect1d(free, slots).size == 0, lambda: f"Mamba slots both live and free: "
                f"{np.intersect1d(free, slots).tolist()}")
        require(free.size + T == cfg.max_requests and np.all((free >= 0)
                & (free < cfg.max_requests)), lambda: f"{free.size} free + {T} live Mamba slots "
                f"!= {cfg.max_requests}: free {free.tolist()}")
        self._check_mamba_states(rows, "check", False)
        if device:
            got = ctx._device.mirrors(ctx._table)["req"][FIELD_MAMBA_SLOT].numpy()
            require(np.array_equal(got, h[FIELD_MAMBA_SLOT]), lambda: f"device Mamba slot map "
                    f"{got.tolist()} != host {h[FIELD_MAMBA_SLOT].tolist()}")
            index = torch.tensor(slots.tolist() + [-1], dtype=torch.int32)
            for number in cfg.mamba_layers:
                conv, ssm = ctx.mamba_states_cache(number)
                g_conv, g_ssm = ctx.gather_mamba_states(number, index)
                require(torch.equal(g_conv[:T], conv[slots]) and torch.equal(g_ssm[:T], ssm[slots])
                        and not g_conv[T:].any() and not g_ssm[T:].any(),
                        f"gather_mamba_states of layer {number} disagrees with the states")

    # ------------------------------------------------------------------ step checks
    def _check_step_metadata(self, P: int, active: List[Tracked]) -> None:
        ctx, cfg = self.ctx, self.cfg
        bs, A = cfg.block_size, len(active)
        n, R = ctx.padded_active_token_count, ctx.padded_active_request_count
        active_tokens = sum(len(t.query) for t in active)
        prefill = sum(t.prefill for t in active)
        require(ctx.active_token_count == active_tokens <= n <= cfg.max_tokens,
                lambda: f"tokens {ctx.active_token_count} (model {active_tokens}), padded {n}")
        require(A <= R <= cfg.max_requests, lambda: f"padded requests {R} for {A}")
        dims = ctx.batch_dimensions
        require((dims.token_count, dims.prefill_req_count, dims.decode_req_count)
                == (active_tokens, prefill, A - prefill), lambda: f"batch_dimensions {dims}")
        table = ctx.block_table_host
        tok = {name: getattr(ctx, name)[:n].numpy() for name in (
            "token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
            "token_to_block_idx", "token_to_position_in_request",
            "token_to_local_position_within_kv_block")}
        start = 0
        for i, t in enumerate(active):
            q = len(t.query)
            pos = t.query_start + np.arange(q)
            sl = slice(start, start + q)
            # A prompt chunk's tokens inside blocks it shares (0.19's full-block match) write
            # their K/V to the dummy block: the shared blocks hold them already.
            blocks = np.where(pos < t.shared, ctx.block_allocator.dummy_block_idx,
                              table[P + i, pos // bs]) if t.prefill else table[P + i, pos // bs]
            expect = {"token_to_input_ids": np.array(t.query), "token_to_pos_ids": pos,
                      "token_to_request_idx": np.full(q, P + i),
                      "token_to_block_idx": blocks,
                      "token_to_position_in_request": pos,
                      "token_to_local_position_within_kv_block": pos % bs}
            for name, want in expect.items():
                require(np.array_equal(tok[name][sl], want), lambda: f"{name} of request "
                        f"{t.rid} (row {P + i}) is {tok[name][sl].tolist()}, expected "
                        f"{want.tolist()}")
            require(np.all(table[P + i, pos // bs] >= 0),
                    lambda: f"request {t.rid} writes a token to a block it does not own")
            start += q
        pad = slice(active_tokens, n)
        dummy = ctx.block_allocator.dummy_block_idx
        require(np.all(tok["token_to_block_idx"][pad] == dummy)
                and np.all(tok["token_to_local_position_within_kv_block"][pad] == 0)
                and np.all(tok["token_to_position_in_request"][pad] == 0),
                "padding tokens do not write slot 0 of the dummy block")
        q_lens = np.array([len(t.query) for t in active])
        kv_lens = np.array([t.query_start + len(t.query) for t in active])
        cu_q, max_q = ctx.cu_query_lengths()
        cu_kv, kv_seq, max_k = ctx.cu_kv_lengths()
        cu_q, cu_kv, kv_seq = cu_q.numpy(), cu_kv.numpy(), kv_seq.numpy()
        want_cu_q = np.concatenate([[0], np.cumsum(q_lens), np.full(R - A, q_lens.sum())])
        want_cu_kv = np.concatenate([[0], np.cumsum(kv_lens), np.full(R - A, kv_lens.sum())])
        require(np.array_equal(cu_q, want_cu_q), lambda: f"cu_query_lengths {cu_q.tolist()}, "
                f"expected {want_cu_q.tolist()}")
        require(np.array_equal(cu_kv, want_cu_kv), lambda: f"cu_kv_lengths {cu_kv.tolist()}, "
                f"expected {want_cu_kv.tolist()}")
        want_kv = np.concatenate([kv_lens, np.zeros(R - A, dtype=kv_lens.dtype)])
        require(np.array_equal(kv_seq, want_kv), lambda: f"kv_seq_lengths {kv_seq.tolist()}")
        require(max_q >= q_lens.max() and (prefill > 0 or max_q == 1 + cfg.speculative
                                           or (cfg.draft_counts and max_q == q_lens.max())),
                lambda: f"max_seqlen_q {max_q} for query lengths {q_lens.tolist()}")
        require(max_k >= kv_lens.max(), lambda: f"max_seqlen_k {max_k} < {kv_lens.max()}")
        attn_table = ctx.active_attn_metadata.block_table.numpy()
        require(attn_table.shape[0] == R and np.array_equal(attn_table[:A], table[P:P + A])
                and np.all(attn_table[A:] == -1), "the step's block table is not the active rows")
        ids, pos_ids = ctx.current_input_and_position_ids()
        require(ids.shape == (1, n) and np.array_equal(ids[0].numpy(), tok["token_to_input_ids"])
                and np.array_equal(pos_ids[0].numpy(), tok["token_to_pos_ids"]),
                "current_input_and_position_ids disagrees with the token arrays")
        lengths = ctx.get_active_sequence_lengths().numpy()
        require(np.array_equal(lengths, kv_lens), lambda: f"get_active_sequence_lengths "
                f"{lengths.tolist()}, expected {kv_lens.tolist()}")
        max_lengths = ctx.get_max_sequence_lengths().numpy()
        want_max = np.array([t.req.finished_chunk_token_count + t.gen for t in active])
        require(np.array_equal(max_lengths, want_max), lambda: f"get_max_sequence_lengths "
                f"{max_lengths.tolist()}, expected {want_max.tolist()}")

    def _check_logits(self, active: List[Tracked], samples: List[int], logprobs: bool) -> None:
        ctx = self.ctx
        n = ctx.padded_active_token_count
        logits = torch.randn(1, n, VOCAB, generator=self._generator)
        last_index = np.cumsum([len(t.query) for t in active]) - 1
        last = ctx.last_token_logits(logits)
        if self.cfg.speculative:
            # Every token of a decode request (its pending token and drafts, to verify), the
            # last of a prefill.
            rows = [j for t, end in zip(active, last_index)
                    for j in (range(end - len(t.query) + 1, end + 1) if not t.prefill
                              else (end,))]
            require(torch.equal(last, logits[0, rows]) and ctx.num_last_token_logits == len(rows)
                    and ctx.speculative_required_logit_indices().tolist() == rows,
                    lambda: f"speculative logit rows {ctx.speculative_required_logit_indices()},"
                    f" expected {rows}")
            if logprobs:
                try:
                    ctx.calculate_log_probs(logits, torch.tensor(samples))
                except NotImplementedError:
                    return
                raise Violation("calculate_log_probs with speculative steps did not refuse")
            return
        require(torch.equal(last, logits[0, last_index]), "last_token_logits picked wrong rows")
        if not logprobs:
            return
        new_tokens = torch.tensor(samples, dtype=torch.int64)
        lsm = torch.log_softmax(logits[0].double(), -1).numpy()
        values, _ = ctx.calculate_log_probs(logits, new_tokens)
        if ctx.is_decode_only():
            want = [[lsm[i, s]] for i, s in enumerate(samples)]
        else:
            want, start = [], 0
            for t, s in zip(active, samples):
                targets = t.query[1:] + [s]
                want.append([lsm[start + j, x] for j, x in enumerate(targets)])
                start += len(t.query)
        require([len(v) for v in values] == [len(w) for w in want]
                and all(np.allclose(v, w, atol=1e-4) for v, w in zip(values, want)),
                "calculate_log_probs disagrees with log_softmax of the targets")
        values, _ = ctx.calculate_log_probs(last, new_tokens, only_last_token_logits=True)
        want = [lsm[i, s] for i, s in zip(last_index, samples)]
        require(np.allclose([v[0] for v in values], want, atol=1e-4),
                "calculate_log_probs(only_last_token_logits=True) disagrees")


    def check(self, device: bool = True) -> None:
        """All invariants; ``device`` also compares the device views with the host."""
        ctx, cfg = self.ctx, self.cfg
        bs = cfg.block_size
        require(ctx.is_tensor_state_allocated, "the context is deallocated")
        P, T = ctx.paused_request_count, ctx.total_request_count
        rows = self._rows()
        require(0 <= P <= T <= cfg.max_requests, lambda: f"P={P}, T={T}")
        require([t.paused for t in rows] == [True] * P + [False] * (T - P),
                lambda: f"paused rows {[t.rid for t in rows[:P]]} != model "
                f"{[t.rid for t in self.live.values() if t.paused]}")
        require(ctx._live_ids == set(self.live), "the context's live id set disagrees")
        if ctx._parts.offload is not None:
            # Host slots free or owned once; a live request holds no host copy.
            try:
                ctx._parts.offload.check()
            except AssertionError as error:
                raise Violation(f"host pool: {error}") from None
            held = set(ctx._parts.offload.entries) & set(self.live)
            require(not held, lambda: f"live requests {sorted(held)} hold host copies")
        active = rows[P:]
        require(ctx.active_token_count == sum(len(t.query) for t in active),
                lambda: f"active_token_count {ctx.active_token_count}, model "
                f"{sum(len(t.query) for t in active)}")
        flags = [t.prefill for t in active]
        require(ctx.num_prefill_requests == sum(flags), lambda: f"num_prefill_requests "
                f"{ctx.num_prefill_requests}, model {sum(flags)}")
        require(flags == sorted(flags), lambda: f"decode rows must come before prefill rows: "
                f"{[(t.rid, t.prefill) for t in active]}")
        require(ctx.get_active_request_count() == T - P and ctx.has_unfinished_requests() == (T > 0)
                and ctx.num_decode_requests == T - P - sum(flags)
                and ctx.is_decode_only() == (sum(flags) == 0), "the simple queries disagree")
        if self.chunked is not None:
            require(ctx.chunked_prefill_request_id == self.chunked.rid and active
                    and active[-1] is self.chunked
                    and ctx.get_index_of_chunked_prefill_request() == T - 1,
                    lambda: f"the chunked request {self.chunked.rid} is not the last active row: "
                    f"{[t.rid for t in active]}")
        else:
            require(ctx.chunked_prefill_request_id == -1, "a chunked id without a chunked prefill")

        h, table = ctx._h_req, ctx.block_table_host
        owned = []
        for row, t in enumerate(rows):
            count = int(h[FIELD_BLOCKS, row])
            offset, q = int(h[FIELD_KV_OFFSET, row]), int(h[FIELD_QUERY, row])
            where = f"request {t.rid} (row {row})"
            # A chunk's output length is provisional: prompt tokens so far + gen (§10).
            require(h[FIELD_OUTPUT, row] == t.req.finished_chunk_token_count + t.gen,
                    lambda: f"{where}: output length {h[FIELD_OUTPUT, row]}, expected "
                    f"{t.req.finished_chunk_token_count + t.gen}")
            if t.paused:
                # Paused: its next 1 + k tokens cross into a new block (k = 0: its last block
                # is full), which it could not get.
                last = h[FIELD_LAST_OFFSET, row]
                drafts = cfg.speculative if t.next_drafts < 0 else t.next_drafts
                require(offset + q == t.cached and last == (t.cached - 1) % bs
                        and last >= bs - 1 - drafts,
                        lambda: f"paused {where}: offset {offset} + query {q} != cached "
                        f"{t.cached} or its next step fits its last block (offset {last})")
            else:
                require(offset == t.query_start and q == len(t.query),
                        lambda: f"{where}: offset {offset}, query {q}; model {t.query_start}, "
                        f"{len(t.query)}")
                require(h[FIELD_LAST_OFFSET, row] == (offset + q - 1) % bs,
                        lambda: f"{where}: last block offset {h[FIELD_LAST_OFFSET, row]}")
            want = t.expected_blocks(bs)
            kv_len = offset + q
            require(count == want and (t.placeholder or count == math.ceil(kv_len / bs)),
                    lambda: f"{where}: {count} blocks, expected {want} (kv length {kv_len}, "
                    f"block size {bs})")
            line = table[row]
            require(np.all(line[:count] >= 0) and np.all(line[count:] == -1),
                    lambda: f"{where}: block-table row {line.tolist()} for {count} blocks")
            require(h[FIELD_LAST_BLOCK, row] == line[count - 1],
                    lambda: f"{where}: last block id {h[FIELD_LAST_BLOCK, row]}")
            blocks = line[:count].tolist()
            require(blocks[:len(t.blocks)] == t.blocks, lambda: f"{where}: blocks changed from "
                    f"{t.blocks} to {blocks}")
            t.blocks = blocks
            owned += blocks
            meta = expected_metadata(t.rid)
            for label, _, _ in ctx.request_metadata_types:
                got = ctx._arena.host[f"meta:{label}"][row]
                require(got == meta[label], lambda: f"{where}: metadata {label} = {got}, "
                        f"expected {meta[label]}")
        require(np.all(table[T:] == -1), "a free row holds blocks")

        alloc = ctx.block_allocator
        owned = np.array(owned, dtype=np.int64)
        free = alloc.block_bag[:alloc.total_avail].astype(np.int64)
        require(np.unique(free).size == free.size, "the free stack holds a block twice")
        if cfg.prefix_caching is not None:
            self.check_prefix_cache(owned, free)
            owned = np.unique(owned)
        require(np.unique(owned).size == owned.size, "a block is owned by two requests")
        require(np.intersect1d(owned, free).size == 0, "a block is both owned and free")
        require(owned.size + free.size == alloc.total_count - 1, lambda: f"blocks leaked: "
                f"{owned.size} owned + {free.size} free != {alloc.total_count - 1}")
        dummy = alloc.dummy_block_idx
        require(dummy not in owned and dummy not in free, "the dummy block is in use")
        require((cfg.prefix_caching is not None or np.all(alloc.ref_counts[owned] == 1))
                and np.all(alloc.ref_counts[free] == 0),
                "reference counts disagree with ownership")
        stats = ctx.get_kvcache_utilization_stats()
        require(stats["allocated_blocks"] == owned.size and stats["paused_request_count"] == P
                and stats["total_request_count"] == T, lambda: f"utilization stats {stats}")
        self.check_budget_usage()

        if device:
            # The device mirrors themselves: on a CPU device the public views are host arrays.
            mirrors = ctx._device.mirrors(ctx._table)
            require(np.array_equal(mirrors["block_table"].numpy(), table),
                    "the device block table differs from the host")
            for name, index in zip(FIELD_NAMES, range(len(FIELD_NAMES))):
                got = mirrors["req"][index, :T].numpy()
                require(np.array_equal(got, h[index, :T]), lambda: f"device {name} "
                        f"{got.tolist()} != host {h[index, :T].tolist()}")
            for label, values in mirrors["metadata"].items():
                require(np.array_equal(values[:T].numpy(), ctx._arena.host[f"meta:{label}"][:T]),
                        f"device metadata {label} differs from the host")
            pending = ctx.paused_tokens
            want = [t.query[0] for t in rows[:P]]
            require((pending is None and P == 0) or (pending is not None
                    and pending.tolist() == want), lambda: f"paused_tokens "
                    f"{None if pending is None else pending.tolist()}, expected {want}")
            if cfg.speculative:
                drafts = ctx.paused_speculative_tokens
                want = [t.kept_drafts for t in rows[:P]]
                require((drafts is None and P == 0) or (drafts is not None
                        and drafts.T.tolist() == want), lambda: f"paused_speculative_tokens "
                        f"{None if drafts is None else drafts.T.tolist()}, expected {want}")
        if cfg.hybrid:
            self.check_mamba(rows, device)
        self.check_kv()
        self.check_kv_groups()
        self.check_host_tier()
