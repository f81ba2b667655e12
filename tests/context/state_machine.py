"""A model engine that drives ``DynamicInferenceContext`` and checks it after every action.

``ContextDriver`` plays the engine (docs/SEMANTICS.md §10-§11) against one small fp32 context
and keeps its own model of every request: prompt, generated tokens, the tokens of its pending
query and how many of its tokens have K/V in the cache. Each action takes its random choices as
explicit arguments, so that two front ends drive the same machine:

* ``tests/context/test_state_machine.py``: a hypothesis ``RuleBasedStateMachine`` (shrinking);
* ``tests/context/soak.py``: a seeded ``random.Random`` for many thousands of steps (no shrinking).

The parts, in reading order:

* ``machine_model.py``: the configurations (``MachineConfig``, ``CONFIGS``), the request model
  (``Tracked``) and ``require``/``Violation``;
* this file: the actions. Add a request directly (fitting, too long, too many tokens for one
  step, a duplicate id, while paused requests exist, a first chunk), admit the waiting queue,
  one step (``initialize_attention_state``, a known K/V pattern appended for every token and
  layer, logits checks, ``update_requests`` with a random finish mask, then the chunked
  continuation), suspend + resume, and reset. Admission, chunk continuation and the re-queue of
  evicted and suspended requests go through the engine's own ``Scheduler``
  (``engine/scheduler.py``, without the engine's chunk reserve, so that a continuation can
  stall and the driver recovers by suspending); the driver checks each of its ``add_request``
  calls against the model;
* ``machine_checks.py``: ``check()`` and the per-step checks (raising ``Violation``);
* ``machine_budgets.py``: the active and paused budgets counted in distinct blocks, and each
  update's pause, resume and eviction decisions against them;
* ``machine_patterns.py``: the exact K/V and Mamba state patterns written and read back.

Hybrids (``MachineConfig.layer_types``) also check the Mamba side: every live request owns
exactly one slot, the one it got when added (the top of the free stack), through compaction,
pause, resume and eviction. Each step writes every active request's pattern (incarnation, write
count, layer) into its slot through ``scatter_mamba_states`` at the step's batch indices
(poisoned rows at the -1 padding entries must be skipped); every check reads every live
request's state back, and a new request's state must read zero after its first
``initialize_attention_state``. Nothing is added after a hybrid's continuation chunk in the
same step (the scheduler stops there).

Speculative configurations (``MachineConfig.speculative = k``, names ``spec*``) forward each
decode request's pending token and ``k`` drafts, accept a chosen number of them (``_rewind``:
``rewind_kv_cache``, its released blocks checked; a hybrid's Mamba state restored from the
intermediate states the driver writes), pass the next drafts to ``update_requests`` and check
them on paused rows; every other check holds as it is, with the query ``1 + k`` tokens long.
With ``draft_counts`` (names ``spec*-counts-*``) each update gives every row its own draft
count (``update_requests(draft_counts=)``): queries of ``1 + d`` tokens, plain and ragged steps,
a row's block taken when its next ``1 + d`` tokens cross into it, a row resumed from the paused
ones forwarding none.

Token-rewind configurations (``MachineConfig.token_rewinds``, names ``rw-*``) call
``rewind_tokens`` at one step in three: decode rows drop a chosen number of their generated
tokens, this step's and earlier ones (``_rewind_tokens``: the released blocks, in row order,
and the lengths checked); every other check then holds with the shorter rows.

Prefix caching configurations (``MachineConfig.prefix_caching``, names ``pc-*``) draw prompts
from two token families so that they share prefixes, and key the K/V and Mamba patterns by
content (the tokens up to the position, or those a state absorbed) instead of by incarnation:
a block or a state taken from the cache must hold exactly what the request would have written.
``check()`` adds the caching invariants (``InvariantChecks.check_prefix_cache``); a hybrid's
hit is the step's continuation, resuming from a snapshot that must hold its prefix's state.
The hits the driver expects come from its own model of the cache (``machine_prefix.py``: what
the requests computed and published, with bounds where the context's eviction order decides),
and every add's actual hit must be one of them.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, List, Optional

import numpy as np
import torch
from helpers import assert_same, snapshot
from machine_checks import InvariantChecks
from machine_model import (  # noqa: F401 (re-exported for the test and the soak)
    _POISON,
    CI_CONFIGS,
    CONFIGS,
    HYBRID_LAYERS,
    VOCAB,
    WAITING_LIMIT,
    MachineConfig,
    Tracked,
    Violation,
    expected_metadata,
    require,
    sample_token,
)
from machine_prefix import Hit, PrefixModel

from dynctx.context import (
    BlockOverflowError,
    DynamicInferenceRequest,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    SamplingParams,
    TensorStateDeallocatedError,
    TokenOverflowError,
)
from dynctx.context.dynamic_context import FIELD_MAMBA_SLOT
from dynctx.context.prefix_cache import wants_every_prompt_logit
from dynctx.engine.scheduler import Admission, Scheduler


class ContextDriver(InvariantChecks):
    """The model engine (see the module docstring)."""

    def __init__(self, config: MachineConfig):
        self.cfg = config
        self.ctx = config.make_context()
        self.scheduler = Scheduler(self.ctx, reserve_for_chunks=False)
        self.live: Dict[int, Tracked] = {}
        self.queued: Dict[int, Tracked] = {}   # not in the context, in the scheduler's queue
        self.chunked: Optional[Tracked] = None
        self.next_rid = 0
        self.next_uid = 0
        self.stats: Counter = Counter()
        self.prefix = None if config.prefix_caching is None else PrefixModel(
            config.block_size, config.prefix_caching, config.hybrid, config.host_tier,
            windows=config.windows is not None)
        self._generator = torch.Generator().manual_seed(1234)
        self.actions: List[str] = []
        self._poison_mamba()

    @property
    def waiting(self) -> List[Tracked]:
        """The queued requests in the scheduler's order (not the chunked one in flight)."""
        return [self.queued[rid] for rid in self.scheduler.waiting if rid in self.queued]

    # ------------------------------------------------------------------ model helpers
    def note(self, action: str) -> None:
        self.actions.append(action)
        del self.actions[:-40]

    def _new(self, prompt: List[int], gen: int, rid: Optional[int] = None) -> Tracked:
        if rid is None:
            rid = self.next_rid
            self.next_rid += 1
        uid = self.next_uid
        self.next_uid += 1
        self.note_chains(prompt)
        params = SamplingParams(num_tokens_to_generate=gen, **expected_metadata(rid))
        req = DynamicInferenceRequest(request_id=rid, sampling_params=params,
                                      prompt_tokens=torch.tensor(prompt, dtype=torch.int64))
        return Tracked(rid=rid, uid=uid, prompt=list(prompt), gen=gen, req=req)

    def _checkpoint(self, t: Tracked) -> Tracked:
        """What the engine re-queues after an eviction or a suspend: prompt + generated."""
        return self._new(t.prompt + t.generated, t.gen - len(t.generated), rid=t.rid)

    def _prompt(self, length: int, salt: int) -> List[int]:
        if self.cfg.prefix_caching is not None:
            # Two prompt families: prompts share prefixes. Their tokens repeat every two
            # blocks, so that equal blocks also follow different prefixes (a block must match
            # as the end of its chain, never by its content alone).
            period = 2 * self.cfg.block_size
            return [((salt % 2) * 7919 + (i % period) * 104729 + 13) % VOCAB
                    for i in range(length)]
        return [(salt * 7919 + i * 104729 + 13) % VOCAB for i in range(length)]

    def _prefix_hits(self, t: Tracked, chunk: int) -> List[Hit]:
        """The hits a new request's add of ``chunk`` tokens may take from the prefix cache, from
        the driver's own model (``machine_prefix.py``; check_kv and the Mamba checks verify the
        content); ``[Hit(0, 0)]`` without caching and for a continuation."""
        if self.prefix is None or t.req.finished_chunk_token_count:
            return [Hit(0, 0)]
        return self.prefix.hits(t.prompt, chunk, not wants_every_prompt_logit(t.req),
                                {x.uid for x in self.live.values()})

    def _restorable(self, t: Tracked, chunk: int, continuation: bool) -> int:
        """Tokens the add of ``t`` must restore from the host (KV offload; 0: none): its
        evicted incarnation's, while the context still holds its copy."""
        offload = self.ctx._parts.offload
        if offload is None or continuation or t.restore is None \
                or t.rid not in offload.entries or wants_every_prompt_logit(t.req):
            return 0
        return t.restore[1] if chunk > t.restore[1] else 0

    def _active(self) -> List[Tracked]:
        return [t for t in self.live.values() if not t.paused]

    def _model_active_tokens(self) -> int:
        return sum(len(t.query) for t in self._active())

    def _model_free_blocks(self) -> int:
        if self.cfg.prefix_caching is not None:
            # Shared blocks: check() verifies the allocator against the block tables.
            return self.ctx.block_allocator.total_avail
        bs = self.cfg.block_size
        owned = sum(t.expected_blocks(bs) for t in self.live.values())
        return self.ctx.block_allocator.total_count - 1 - owned

    # ------------------------------------------------------------------ adding
    def _expected_add_errors(self, t: Tracked, chunk: int, continuation: bool,
                             duplicate: bool, hit: Hit) -> set:
        """The errors ``add_request`` must raise if the cache gives the request ``hit``."""
        cfg, ctx = self.cfg, self.ctx
        errors = set()
        fin = t.req.finished_chunk_token_count
        # Only a prompt longer than max_sequence_length is refused; a longer generation budget
        # is accepted and the request finished when it reaches max_sequence_length.
        if fin + t.req.remaining_prompt_length > cfg.max_sequence_length:
            errors.add(MaxSequenceLengthOverflowError)
            hit = Hit(0, 0)  # refused before any lookup
        tokens = self._model_active_tokens() - (1 if continuation else 0)
        skip, idle = hit.skip_tokens(cfg.block_size), hit.idle
        if not continuation:
            if duplicate:
                errors.add(ValueError)
            if len(self.live) >= cfg.max_requests:
                errors.add(RequestOverflowError)
            if ctx.chunked_prefill_request_id != -1:
                errors.add(ValueError)
            if self._continuation_pending():
                errors.add(ValueError)  # a hybrid's continuation must stay the last row
        if tokens + chunk - skip > cfg.max_tokens:
            errors.add(TokenOverflowError)
        bs = cfg.block_size
        if math.ceil((fin + chunk) / bs) - math.ceil(fin / bs) - hit.blocks + idle \
                > self._model_free_blocks():
            errors.add(BlockOverflowError)
        return errors

    def _try_add(self, t: Tracked, chunk: int, *, continuation: bool = False,
                 duplicate: bool = False, pass_none: bool = False, advance: bool = True) -> bool:
        """``add_request(t, chunk)``; True if added. An expected rejection leaves the state.
        ``advance=False``: the caller (the scheduler) advances ``t.req`` past the chunk."""
        ctx = self.ctx
        hits = [Hit(0, 0)] if continuation else self._prefix_hits(t, chunk)
        restored = self._restorable(t, chunk, continuation)
        if restored:
            # A restore: its tokens skipped, every block new (as many as a hit revives).
            bs = self.cfg.block_size
            # (With speculative steps its last block may be partly filled.)
            hits = [Hit(restored // bs, restored // bs, tokens=restored)]
        options = {hit: self._expected_add_errors(t, chunk, continuation, duplicate, hit)
                   for hit in hits}
        expected = set().union(*options.values())
        before = snapshot(ctx)
        matched_before = ctx.prefix_cache_blocks_matched
        remaining = t.req.remaining_prompt_length
        arg = None if pass_none and chunk == remaining else chunk
        paused = ctx.paused_request_count
        slots_before = self._slot_stack()
        try:
            ctx.add_request(t.req, arg)
        except Exception as error:  # noqa: BLE001 - any unexpected error is a violation
            raised = error
            require(type(raised) in expected, lambda: f"add_request(id={t.rid}, chunk={arg}, "
                    f"prompt={len(t.prompt)}, gen={t.gen}) raised {raised!r}; expected "
                    f"{sorted(e.__name__ for e in expected) or 'success'}")
            try:
                assert_same(before, snapshot(ctx))
            except AssertionError as changed:
                raise Violation(f"rejected add_request(id={t.rid}) changed the state: "
                                f"{changed}") from None
            require(self._slot_stack() == slots_before, lambda: f"rejected add_request("
                    f"id={t.rid}) changed the free Mamba slots: {slots_before} -> "
                    f"{self._slot_stack()}")
            self.stats["rejected_adds"] += 1
            return False
        require(not all(options.values()), lambda: f"add_request(id={t.rid}, chunk={arg}, "
                f"prompt={len(t.prompt)}, gen={t.gen}) succeeded; expected one of "
                f"{sorted(e.__name__ for e in expected)}")
        fin = t.req.finished_chunk_token_count
        row = ctx.host_request_ids().tolist().index(t.rid)
        skip = int(ctx.request_kv_length_offsets[row]) - fin
        shared = skip // self.cfg.block_size if restored else \
            ctx.prefix_cache_blocks_matched - matched_before
        allowed = sorted({(h.blocks, h.skip_tokens(self.cfg.block_size))
                          for h, errors in options.items() if not errors})
        require((shared, skip) in allowed, lambda: f"add_request(id={t.rid}, chunk={chunk}) "
                f"shared {shared} blocks and skipped {skip} tokens from the prefix cache; the "
                f"model allows (blocks, tokens) in {allowed}")
        t.shared = 0 if continuation else shared * self.cfg.block_size
        if self.prefix is not None and not continuation:
            # A restored request holds private copies (its blocks are published at the add).
            self.prefix.took(t.uid, t.prompt, 0 if restored else shared,
                             0 if restored else skip // self.cfg.block_size)
        if self.prefix is not None:
            self.prefix.added(t.uid, t.prompt, fin + chunk, {x.uid for x in self.live.values()}
                              | {t.uid})
        require(not restored or skip == restored, lambda: f"add_request(id={t.rid}) restored "
                f"{skip} tokens from the host, {restored} were saved")
        if advance:
            t.req.remaining_prompt_tokens = t.req.remaining_prompt_tokens[chunk:]
            t.req.finished_chunk_token_count = fin + chunk
        t.query_start, t.query = fin + skip, t.prompt[fin + skip:fin + chunk]
        t.drafts = []
        t.cached = fin + skip
        if skip:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_skipped_tokens"] += skip
        t.prefill, t.placeholder, t.paused = True, False, False
        # A hybrid's prefix cache hit resumes from a Mamba snapshot as the continuation.
        t.continued = continuation or (skip > 0 and self.cfg.hybrid)
        if self.cfg.hybrid:
            row = ctx.host_request_ids().tolist().index(t.rid)
            slot = int(ctx._h_req[FIELD_MAMBA_SLOT, row])
            if continuation:
                require(slot == t.slot, lambda: f"the continuation chunk of request {t.rid} "
                        f"moved it from Mamba slot {t.slot} to {slot}")
            else:
                free = self._slot_stack()
                require(slot >= 0 and slots_before is not None and free == slots_before[:-1]
                        and slots_before[-1] == slot, lambda: f"add_request(id={t.rid}) got "
                        f"Mamba slot {slot}; the free stack was {slots_before}, is {free} (the "
                        "top of the stack must be handed out)")
                t.slot, t.mamba_writes, t.mamba_len = slot, 0, skip
        if restored:
            # The restored K/V (and Mamba state) are the evicted incarnation's (with prefix
            # caching the patterns are keyed by content, and the uid keys its cache model).
            uid, _, writes, length = t.restore
            if self.prefix is None:
                t.uid = uid
            if self.cfg.hybrid:
                t.mamba_writes, t.mamba_len = writes, length
            self.stats["restores"] += 1
        self.live[t.rid] = t
        self.stats["adds"] += 1
        if chunk < remaining or continuation:
            self.stats["chunks"] += 1
        if paused and not continuation:
            self.stats["adds_while_paused"] += 1
        return True

    def add_new(self, kind: str, prompt_len: int, gen: int, choice: int = 0) -> bool:
        """Add a fresh request. ``kind``: ``fit`` (prompt + gen fits), ``too_long`` (prompt +
        gen > max_sequence_length: accepted, and finished by the context at max_sequence_length),
        ``too_many_tokens`` (a prompt longer than max_tokens,
        unchunked), ``duplicate`` (a live id), ``chunked`` (a first chunk of
        ``1 + choice % (prompt - 1)`` tokens; the engine then sets the chunked id)."""
        cfg = self.cfg
        S = cfg.max_sequence_length
        prompt_len = max(1, min(prompt_len, S - 1))
        gen = max(1, min(gen, S - prompt_len))  # large draws: as long as the context allows
        rid = None
        if kind == "too_long":
            gen = S - prompt_len + 1 + gen % 4
        elif kind == "too_many_tokens":
            prompt_len = cfg.max_tokens + 1 + prompt_len % (S - 1 - cfg.max_tokens)
            gen = max(1, min(gen, S - prompt_len))
        elif kind == "duplicate":
            if not self.live:
                return False
            rid = sorted(self.live)[choice % len(self.live)]
        elif kind == "chunked":
            prompt_len = max(prompt_len, 2)
        elif kind != "fit":
            raise ValueError(kind)
        t = self._new(self._prompt(prompt_len, self.next_uid), gen, rid=rid)
        self.note(f"add_new({kind}, id={t.rid}, prompt={prompt_len}, gen={gen})")
        chunk = prompt_len
        if kind == "chunked":
            chunk = 1 + choice % (prompt_len - 1)
        if kind in ("fit", "chunked") and self._continuation_pending():
            # Hybrids: the scheduler stops after a continuation chunk (docs/SEMANTICS.md §10,
            # fixed version), so the request waits for the next step.
            self.stats["deferred_adds"] += 1
            self._enqueue(t)
            return False
        added = self._try_add(t, chunk, duplicate=kind == "duplicate", pass_none=choice % 2 == 0)
        if added and t.continued:
            self.scheduler.close_step()  # a hybrid's cache hit must stay the step's last row
        if added and kind == "chunked":
            self.ctx.chunked_prefill_request_id = t.rid
            self.chunked, t.chunking = t, True
            self.scheduler.note_chunked_prefill(t.rid)
        if not added and kind in ("fit", "too_many_tokens"):
            self._enqueue(t)  # the engine keeps it waiting (and chunks it if needed)
        return added

    def _enqueue(self, t: Tracked) -> None:
        """Queue ``t`` at the back (up to ``WAITING_LIMIT`` waiting requests)."""
        if len(self.queued) < WAITING_LIMIT:
            self.queued[t.rid] = t
            self.scheduler.waiting.append(t.rid)

    def _continuation_pending(self) -> bool:
        """A hybrid's continuation chunk (the final one included) is in the context for the next
        step: the fixed engine adds nothing after it (its Mamba metadata takes the last active
        row as the continuation; see the xfail regression in test_state_machine.py)."""
        return self.cfg.hybrid and any(t.continued for t in self.live.values())


    # ------------------------------------------------------------------ admission (the scheduler)
    def admit(self) -> int:
        """The engine's scheduler over the waiting queue (FIFO, stop at the first that does not
        fit; a prompt longer than the room left is chunked and ends the admission); each add is
        checked against the model."""
        self.note("admit")
        done = self.scheduler.schedule(self._scheduled_request, add=self._scheduled_add)
        require(not done.refused, lambda: f"the scheduler saw adds refused: {done.refused}")
        for admission in done.admitted:
            self._admitted(admission)
        return len(done.admitted)

    def _scheduled_request(self, rid: int) -> DynamicInferenceRequest:
        """The request the scheduler considers next; a new one's ``check_availability`` is
        checked against the model first (the scheduler asks the same state next)."""
        if self.chunked is not None and rid == self.chunked.rid:
            return self.chunked.req
        t = self.queued[rid]
        got = self.ctx.check_availability(t.req)
        remaining = t.req.remaining_prompt_length
        paused = any(x.paused for x in self.live.values())
        bs = self.cfg.block_size
        restored = self._restorable(t, remaining, False)
        hits = [Hit(restored // bs, restored // bs, tokens=restored)] if restored else \
            self._prefix_hits(t, remaining)
        wants = {(len(self.live) < self.cfg.max_requests and not paused,
                  self._model_active_tokens() + remaining - hit.skip_tokens(bs)
                  <= self.cfg.max_tokens,
                  self._model_free_blocks() >= math.ceil(remaining / bs) - hit.blocks + hit.idle)
                 for hit in hits}
        require(tuple(got) in wants, lambda: f"check_availability(id={t.rid}, remaining="
                f"{remaining}) = {got}, expected one of {sorted(wants)}")
        return t.req

    def _scheduled_add(self, req: DynamicInferenceRequest, chunk_length: Optional[int]) -> None:
        """The scheduler's ``add_request``, checked against the model (it must succeed)."""
        continuation = req.finished_chunk_token_count > 0
        t = self.chunked if continuation else self.queued[req.request_id]
        chunk = req.remaining_prompt_length if chunk_length is None else chunk_length
        require(self._try_add(t, chunk, continuation=continuation, advance=False,
                              pass_none=chunk_length is None),
                lambda: f"the scheduler's add_request(id={t.rid}, chunk={chunk_length}) failed")
        self.queued.pop(t.rid, None)

    def _admitted(self, admission: Admission) -> None:
        t = self.live[admission.request_id]
        if not admission.final:
            self.chunked, t.chunking = t, True
        elif admission.continuation:
            self.chunked, t.chunking = None, False

    def _continue_chunk(self, choice: int) -> None:
        """The step after a non-final chunk starts with the next chunk (the protocol): through
        the scheduler, with a chunk size drawn from ``choice``."""
        cfg, t = self.cfg, self.chunked
        bs = cfg.block_size
        fin = t.req.finished_chunk_token_count
        remaining = t.req.remaining_prompt_length
        token_room = cfg.max_tokens - (self._model_active_tokens() - 1)
        block_room = (math.ceil(fin / bs) + self._model_free_blocks()) * bs - fin
        most = min(remaining, token_room, block_room)
        room = self.scheduler.continuation_room(t.req)
        require(room == most, lambda: f"the scheduler's continuation room {room} for request "
                f"{t.rid}, the model's {most}")
        if most < 1:
            # No block for the next chunk: the step cannot run (forwarding the junk token would
            # write to a block the request does not own). The engine recovers by suspending.
            self.stats["stalls"] += 1
            self.note("stall -> suspend_resume")
            self.suspend_resume(check_calls=False)
            return
        if choice % 5 == 4 and most + 1 < remaining:
            self.note(f"continue {t.rid} with {most + 1} (too many)")
            require(not self._try_add(t, most + 1, continuation=True),
                    "an oversized continuation chunk was accepted")
        chunk = most if choice % 3 == 0 else 1 + (choice // 3) % most
        self.note(f"continue {t.rid} with {chunk} of {remaining}")
        done = self.scheduler.schedule(self._scheduled_request, add=self._scheduled_add,
                                       continuation_chunk=lambda req, room: chunk, limit=1)
        require([(a.request_id, a.chunk, a.continuation) for a in done.admitted]
                == [(t.rid, chunk, True)], lambda: f"the scheduler continued with "
                f"{done.admitted}, expected request {t.rid} with {chunk} tokens")
        self._admitted(done.admitted[0])

    # ------------------------------------------------------------------ the step
    def step(self, finish=frozenset(), *, mask_as_int: bool = False, choice: int = 0,
             layout: int = 0, logprobs: bool = False, reinit: bool = False) -> None:
        """One forward pass and ``update_requests``. ``finish``: indices (into the active
        requests) that finish now; ``layout`` picks the K/V tensor layout (0: [n,1,H,D],
        1: [n,H,D], 2: [n+3,1,H,D] with poisoned extra rows); ``choice`` drives the chunked
        continuation; ``logprobs`` also checks ``calculate_log_probs``; ``reinit`` builds the
        step's metadata twice (with ``reset_attention_state`` between), which must not matter."""
        ctx, cfg = self.ctx, self.cfg
        self.note(f"step(finish={sorted(finish)}, layout={layout}, choice={choice}, "
                  f"reinit={reinit})")
        ctx.initialize_attention_state()
        if reinit:
            ctx.reset_attention_state()
            ctx.initialize_attention_state()
        rows = self._rows()
        P = ctx.paused_request_count
        active = rows[P:]
        require(active, "initialize_attention_state with no active request")
        self._check_step_metadata(P, active)
        self.check_kv_groups(settled=True)
        if cfg.hybrid:
            self._step_mamba(rows, P, active)
        self._write_kv(active, layout)
        if cfg.speculative:
            self._rewind(active, choice)
        else:
            for t in active:
                t.cached = t.query_start + len(t.query)
        if cfg.token_rewinds:
            self._rewind_tokens(active, choice)
        self.check_kv()
        samples = [sample_token(t.rid, t.cached) for t in active]
        self._check_logits(active, samples, logprobs)

        mask = []
        for i, t in enumerate(active):
            if t.chunking:
                mask.append(i not in finish)  # the context keeps it whatever the mask says
            else:
                mask.append(len(t.generated) + 1 < t.gen and i not in finish)
        # A kept request whose next token would lie beyond max_sequence_length is finished by
        # the context (a request admitted with prompt + gen > max_sequence_length).
        at_max_length = {t.rid for t, keep in zip(active, mask) if keep and not t.chunking
                         and t.cached + 1 > cfg.max_sequence_length}
        counts, table = ctx.kv_block_counts_host, ctx.block_table_host
        old_blocks = {t.rid: table[row, :counts[row]].tolist() for row, t in enumerate(rows)}
        old_paused = {t.rid for t in rows[:P]}
        mask_tensor = torch.tensor(mask, dtype=torch.int32 if mask_as_int else torch.bool)
        k = cfg.speculative
        drafts = [[(sample_token(t.rid, t.cached + 1 + j) + 1 + j) % VOCAB for j in range(k)]
                  for t in active]
        draft_counts = [(t.rid + choice + self.stats["steps"]) % (k + 1) for t in active] \
            if cfg.draft_counts else None
        newly = ctx.update_requests(mask_tensor, torch.tensor(samples, dtype=torch.int64),
                                    torch.tensor(drafts, dtype=torch.int64).reshape(
                                        len(active), k).T if k else None, draft_counts=draft_counts)
        self.stats["steps"] += 1
        if self.prefix is not None:
            self.prefix.after_update([(t.uid, t.prompt, t.cached) for t in active],
                                     {t.uid for t in self.live.values()})

        finished = {t.rid for t, keep in zip(active, mask) if not keep and not t.chunking}
        reported = ctx.max_length_finished_request_ids.tolist()
        require(sorted(reported) == sorted(at_max_length), lambda: f"update_requests finished "
                f"{sorted(reported)} at max_sequence_length, expected {sorted(at_max_length)}")
        finished |= at_max_length
        self.stats["max_length_finished"] += len(at_max_length)
        eligible = set()
        for i, (t, token, draft) in enumerate(zip(active, samples, drafts)):
            t.continued = False
            t.kept_drafts = draft
            t.next_drafts = k if draft_counts is None else draft_counts[i]
            if t.rid in finished:
                del self.live[t.rid]
                continue
            t.query_start, t.query, t.prefill, t.drafts = t.cached, [token], False, []
            if t.chunking:
                t.placeholder = True  # the sampled token of a non-final chunk is junk
            else:
                t.generated.append(token)
                d = t.next_drafts
                t.query, t.drafts = [token] + draft[:d], draft[:d]
                # Its next 1 + d tokens cross into a new block (k = 0: its last block is
                # full): it may pause.
                if (t.cached - 1) % cfg.block_size >= cfg.block_size - 1 - d:
                    eligible.add(t.rid)
        self.stats["finished"] += len(finished)

        evicted = ctx.evicted_request_ids.tolist()
        ids = ctx.host_request_ids().tolist()
        P = ctx.paused_request_count
        survivors = set(self.live)
        require(len(set(evicted)) == len(evicted) and set(evicted) <= survivors,
                lambda: f"evicted {evicted} are not distinct survivors {sorted(survivors)}")
        require(set(evicted) <= old_paused | eligible, lambda: f"evicted {evicted}, but only "
                f"{sorted(old_paused | eligible)} could pause")
        require(set(ids) == survivors - set(evicted), lambda: f"rows hold {sorted(ids)}; "
                f"survivors {sorted(survivors)}, finished {sorted(finished)}, evicted {evicted}")
        paused_now = set(ids[:P])
        require(paused_now <= old_paused | eligible, lambda: f"paused {sorted(paused_now)}, but "
                f"only {sorted(old_paused | eligible)} filled their last block")
        newly = newly.tolist()
        require(len(newly) == len(set(newly)) and set(newly) == paused_now - old_paused,
                lambda: f"update_requests returned newly paused {newly}, expected "
                f"{sorted(paused_now - old_paused)}")
        offload = ctx._parts.offload
        for rid in evicted:
            t = self.live.pop(rid)
            require(t is not self.chunked, "the chunked prefill request was evicted")
            self.queued[rid] = self._checkpoint(t)
            entry = None if offload is None else offload.entries.get(rid)
            if entry is not None:
                require(entry.tokens == t.cached, lambda: f"evicted request {rid}: the host "
                        f"holds {entry.tokens} tokens, its cache held {t.cached}")
                self.queued[rid].restore = (t.uid, t.cached, t.mamba_writes, t.mamba_len)
                self.stats["offloads"] += 1
        self.check_budget_decisions(old_blocks, old_paused | eligible, evicted)
        self.scheduler.after_update(evicted)  # at the front, behind the chunked prefill
        self.stats["evictions"] += len(evicted)
        self.stats["pauses"] += len(newly)
        self.stats["resumes"] += len(old_paused - paused_now - set(evicted))
        for t in self.live.values():
            if cfg.draft_counts and t.rid in old_paused and t.rid not in paused_now:
                # Resumed from the paused ones: it forwards no drafts (§19, draft counts).
                t.query, t.drafts, t.next_drafts = t.query[:1], [], 0
            t.paused = t.rid in paused_now
        for row, rid in enumerate(ids):
            old, new = old_blocks[rid], table[row, :counts[row]].tolist()
            require(new[:len(old)] == old and len(new) - len(old) in (0, 1), lambda: f"request "
                    f"{rid} had blocks {old} and has {new} after one update (only one block may "
                    "be appended)")
        if self.chunked is not None:
            self._continue_chunk(choice)

    # ------------------------------------------------------------------ lifecycle
    def suspend_resume(self, check_calls: bool = True) -> None:
        """Engine suspend (``deallocate_all_tensors``) and resume (``allocate_all_tensors
        (is_init=False)``); the in-flight requests go back to the head of the waiting queue as
        fresh requests with prompt = prompt + generated, and are admitted again."""
        ctx, cfg = self.ctx, self.cfg
        self.note("suspend_resume")
        rows = self._rows()
        ctx.deallocate_all_tensors()
        require(not ctx.is_tensor_state_allocated, "deallocate_all_tensors left the state")
        if check_calls:
            probe = self._new([1, 2, 3], 1)
            calls = {
                "add_request": lambda: ctx.add_request(probe.req),
                "check_availability": lambda: ctx.check_availability(probe.req),
                "initialize_attention_state": ctx.initialize_attention_state,
                "update_requests": lambda: ctx.update_requests(torch.ones(1, dtype=torch.bool),
                                                               torch.zeros(1, dtype=torch.int64)),
                "key_value_cache": lambda: ctx.key_value_cache(1),
                "append_key_value_cache": lambda: ctx.append_key_value_cache(
                    1, torch.zeros(1, 1, 1), None),
                "request_to_kv_block_ids": lambda: ctx.request_to_kv_block_ids,
            }
            for name, call in calls.items():
                try:
                    call()
                except TensorStateDeallocatedError:
                    continue
                except Exception as error:  # noqa: BLE001
                    raise Violation(f"{name} while deallocated raised {error!r}, expected "
                                    "TensorStateDeallocatedError") from None
                raise Violation(f"{name} while deallocated did not raise")
        ctx.allocate_all_tensors(is_init=False)
        self._poison_mamba()
        alloc = ctx.block_allocator
        require((ctx.total_request_count, ctx.paused_request_count, ctx.active_token_count,
                 ctx.num_prefill_requests, ctx.chunked_prefill_request_id) == (0, 0, 0, 0, -1),
                "the context is not empty after a resume")
        require(alloc.total_avail == alloc.total_count - 1, "blocks in use after a resume")
        require(not cfg.hybrid or ctx._mamba_slots.free_count == cfg.max_requests,
                "Mamba slots in use after a resume")
        self.queued.update({t.rid: self._checkpoint(t) for t in rows})
        self.scheduler.requeue_suspended([t.rid for t in rows])
        self.live.clear()
        if self.prefix is not None:
            self.prefix.clear()
        self.chunked = None
        self.stats["suspends"] += 1
        self.check(device=True)
        self.admit()

    def reset(self) -> None:
        """``reset()``: the context and the engine's queues are emptied."""
        self.note("reset")
        self.ctx.reset()
        require(not self.cfg.hybrid or self._slot_stack() == list(range(self.cfg.max_requests)),
                lambda: f"Mamba slots after reset(): {self._slot_stack()}")
        self.live.clear()
        if self.prefix is not None:
            self.prefix.clear()
        self.queued.clear()
        self.scheduler.clear()
        self.chunked = None
        self.stats["resets"] += 1


    # ------------------------------------------------------------------ writes
    def _rewind(self, active: List[Tracked], choice: int) -> None:
        """Speculative steps: accept a chosen number of each decode request's drafts (the
        verification), set a hybrid's Mamba states up as its model would (the state after each
        token in the intermediate states), and ``rewind_kv_cache`` the rest; check the blocks it
        released (a decode row's blocks past its kept tokens, in row order)."""
        ctx, cfg = self.ctx, self.cfg
        bs = cfg.block_size
        # Each decode row accepts between none and all of its own drafts.
        accepted = [-1 if t.prefill else (choice + 7 * t.rid + t.query_start) % len(t.query)
                    for t in active]
        self.note(f"rewind(accepted={accepted})")
        P = ctx.paused_request_count
        counts, table = ctx.kv_block_counts_host, ctx.block_table_host
        held = [table[P + i, :counts[P + i]].tolist() for i in range(len(active))]
        if cfg.hybrid:
            self._speculative_mamba(active, accepted)
        released = ctx.rewind_kv_cache(torch.tensor(accepted)).tolist()
        expected = []
        for t, a, blocks in zip(active, accepted, held):
            if a < 0:
                t.cached = t.query_start + len(t.query)
                continue
            t.cached = t.query_start + 1 + a
            t.generated += t.drafts[:a]
            keep = math.ceil(t.cached / bs)
            expected += blocks[keep:]
            t.blocks = t.blocks[:keep]
            self.stats["accepted_drafts"] += a
            self.stats["rejected_drafts"] += len(t.drafts) - a
        require(released == expected, lambda: f"rewind_kv_cache released {released}, expected "
                f"{expected} (the blocks past each decode row's kept tokens)")
        self.stats["rewound_blocks"] += len(released)
        lengths = ctx.get_active_sequence_lengths().tolist()
        require(lengths == [t.cached for t in active], lambda: f"after the rewind the active "
                f"lengths are {lengths}, expected {[t.cached for t in active]}")

    def _rewind_tokens(self, active: List[Tracked], choice: int) -> None:
        """``rewind_tokens``: at one step in three, decode rows drop a chosen number of their
        generated tokens (this step's and earlier ones, up to a block and a half; the prompt
        kept); check the blocks it released (each row's blocks past its kept tokens, in row
        order) and the lengths."""
        if choice % 3:
            return
        ctx, bs = self.ctx, self.cfg.block_size
        counts = []
        for t in active:
            most = 0 if t.prefill or t.chunking else min(t.cached - max(len(t.prompt), 1),
                                                        bs + bs // 2)
            counts.append(0 if most <= 0 else (choice + 5 * t.rid + t.cached) % (most + 1))
        self.note(f"rewind_tokens({counts})")
        P = ctx.paused_request_count
        table, held_counts = ctx.block_table_host, ctx.kv_block_counts_host
        held = [table[P + i, :held_counts[P + i]].tolist() for i in range(len(active))]
        released = ctx.rewind_tokens(counts).tolist()
        expected = []
        for t, n, blocks in zip(active, counts, held):
            if n:
                t.cached -= n
                del t.generated[t.cached - len(t.prompt):]
                keep = math.ceil(t.cached / bs)
                expected += blocks[keep:]
                t.blocks = t.blocks[:keep]
                self.stats["rewound_tokens"] += n
        require(released == expected, lambda: f"rewind_tokens released {released}, expected "
                f"{expected} (the blocks past each row's kept tokens)")
        self.stats["rewound_blocks"] += len(released)
        lengths = ctx.get_active_sequence_lengths().tolist()
        require(lengths == [t.cached for t in active], lambda: f"after rewind_tokens the "
                f"active lengths are {lengths}, expected {[t.cached for t in active]}")

    def _speculative_mamba(self, active: List[Tracked], accepted: List[int]) -> None:
        """What a hybrid's Mamba layers leave after a speculative step: each decode request's
        intermediate state after its accepted tokens holds the pattern the rewind must restore;
        its other intermediate states and its current state (after all ``1 + k`` tokens) are
        poisoned."""
        ctx, cfg = self.ctx, self.cfg
        rows = [(t, a) for t, a in zip(active, accepted) if a >= 0]
        if not rows:
            return
        for t, a in rows:
            t.mamba_len = t.query_start + 1 + a
        patterns = self.mamba_pattern(*self.mamba_keys([t for t, _ in rows])[:2])
        slots = torch.tensor([t.slot for t, _ in rows])
        steps = torch.tensor([a for _, a in rows])
        for layer, number in enumerate(cfg.mamba_layers):
            current = ctx.mamba_states_cache(number)
            intermediate = ctx.mamba_states_cache(number, intermediate=True)
            for state, inter, pattern in zip(current, intermediate, patterns):
                inter[slots] = _POISON
                inter[slots, steps] = torch.from_numpy(pattern[:, layer]).to(inter.dtype)
                state[slots] = _POISON

    def _write_kv(self, active: List[Tracked], layout: int) -> None:
        ctx, cfg = self.ctx, self.cfg
        n = ctx.padded_active_token_count
        positions = np.concatenate([t.query_start + np.arange(len(t.query)) for t in active])
        uids = np.concatenate([self.kv_uids(t, t.query_start + np.arange(len(t.query)))
                               for t in active])
        extra = 3 if layout == 2 else 0
        for layer, number in enumerate(cfg.attention_layers):
            real = torch.from_numpy(self.pattern(uids, positions, layer))
            shape = (n + extra,) + tuple(real.shape[1:])
            data = torch.full(shape, -1.0)       # padding tokens: into the dummy block
            data[:len(uids)] = real
            if extra:
                data[n:] = -2.0                  # rows beyond the step: must not be written
            if cfg.mla:
                latent = data if layout == 1 else data.unsqueeze(1)
                ctx.append_key_value_cache(number, latent, None)
            else:
                key, value = data[:, 0], data[:, 1]
                if layout != 1:
                    key, value = key.unsqueeze(1), value.unsqueeze(1)
                ctx.append_key_value_cache(number, key.contiguous(), value.contiguous())


    def _poison_mamba(self) -> None:
        """Fill every Mamba state with a value no pattern has (``torch.empty`` may be zeros)."""
        if self.cfg.hybrid:
            for number in self.cfg.mamba_layers:
                for states in self.ctx.mamba_states_cache(number):
                    states.fill_(_POISON)


    def _step_mamba(self, rows: List[Tracked], P: int, active: List[Tracked]) -> None:
        """Check the step's Mamba metadata and that new requests start from zero state, then
        write every active request's next pattern through ``scatter_mamba_states`` at the
        step's batch indices (padding entries -1 get poisoned rows that must be skipped)."""
        ctx, cfg = self.ctx, self.cfg
        self._check_mamba_metadata(rows, P, active)
        self._check_mamba_states(active, "after initialize_attention_state", True)
        meta = ctx.mamba_metadata
        groups = [g for g in (meta.batch_indices_decode, meta.batch_indices_prefill,
                              meta.batch_indices_chunked_prefill) if g is not None]
        index = torch.cat(groups) if groups else torch.empty(0, dtype=torch.int32)
        # The metadata was checked: the valid entries are the active requests, in order.
        valid = (index >= 0).numpy()
        require(int(valid.sum()) == len(active), "the batch indices do not cover the active rows")
        for t in active:
            t.mamba_writes += 1
            t.mamba_len = t.query_start + len(t.query)
        patterns = self.mamba_pattern(*self.mamba_keys(active)[:2])
        src = []
        for shape, pattern in zip((cfg.conv_shape, cfg.ssm_shape), patterns):
            data = torch.full((len(index), len(cfg.mamba_layers), *shape), _POISON)
            data[torch.from_numpy(valid)] = torch.from_numpy(pattern)
            src.append(data)
        for layer, number in enumerate(cfg.mamba_layers):
            # (The next check() reads every state back; update_requests must not touch them.)
            ctx.scatter_mamba_states(number, index, src[0][:, layer], src[1][:, layer])

