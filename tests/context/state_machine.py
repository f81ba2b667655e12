"""A model engine that drives ``DynamicInferenceContext`` and checks it after every action.

``ContextDriver`` plays the engine (docs/SEMANTICS.md §10-§11) against one small fp32 context and
keeps its own model of every request: prompt, generated tokens, the tokens of its pending query
and how many of its tokens have K/V in the cache. Each action takes its random choices as explicit
arguments, so that two front ends drive the same machine:

* ``tests/context/test_state_machine.py``: a hypothesis ``RuleBasedStateMachine`` (shrinking);
* ``bench/soak.py``: a seeded ``random.Random`` for many thousands of steps (no shrinking).

Actions: add a request (fitting, too long, too many tokens for one step, a duplicate id, while
paused requests exist), start a chunked prefill, admit the waiting queue (evicted and suspended
requests re-added with prompt = prompt + generated), one step (``initialize_attention_state``, a
known K/V pattern appended for every token and layer, logits checks, ``update_requests`` with a
random finish mask, then the chunked continuation), suspend + resume, and reset.

``check()`` asserts the invariants (raising ``Violation``): every block free or owned by exactly
one live request with nothing leaked; counts and rows consistent with the model; block counts ==
ceil(kv length / block size); the device mirrors equal the host; the cached K/V of every live
request (paused ones included) read back through ``key_value_cache`` equal the pattern (written
to and read from the attention layers ``*`` only, for hybrids).

Hybrids (``MachineConfig.layer_types``) also check the Mamba side: every live request owns
exactly one slot, the one it got when added (the top of the free stack), through compaction,
pause, resume and eviction; slots are distinct; free + live slots == max_requests; the step's
``mamba_metadata`` (slot map, decode / prefill / chunked batch indices, cu_seqlens, seq_idx,
device offsets) matches the model. Each step writes every active request's pattern (incarnation,
write count, layer) into its slot through ``scatter_mamba_states`` at the step's batch indices
(poisoned rows at the -1 padding entries must be skipped); every check reads every live request's
state back through ``mamba_states_cache`` (paused ones included), and a new request's state must
read zero after its first ``initialize_attention_state``. The driver follows the fixed engine:
nothing is added after a hybrid's continuation chunk in the same step.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from dynctx.context import (
    BlockOverflowError,
    DynamicInferenceContext,
    DynamicInferenceRequest,
    MambaInferenceStateConfig,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    SamplingParams,
    TensorStateDeallocatedError,
    TokenOverflowError,
)
from dynctx.context.dynamic_context import (
    FIELD_BLOCKS,
    FIELD_KV_OFFSET,
    FIELD_LAST_BLOCK,
    FIELD_LAST_OFFSET,
    FIELD_MAMBA_SLOT,
    FIELD_OUTPUT,
    FIELD_QUERY,
)

from helpers import FIELD_NAMES, GIB, assert_same, snapshot

VOCAB = 1000                 # token ids of prompts and samples lie in [0, VOCAB)
TERMINATION_BASE = 10 ** 6   # termination ids are never sampled
WAITING_LIMIT = 8            # rejected fitting requests wait (up to this many) and are re-tried
_EXACT = 2 ** 24             # integers below this are exact in fp32


HYBRID_LAYERS = ("M", "*", "-", "M", "*")  # Mamba layers 1 and 4, attention layers 2 and 5
_POISON = 0.5                # never a pattern value: states of free slots and padded scatter rows


class Violation(AssertionError):
    """An invariant of the context does not hold."""


def require(condition, message) -> None:
    if not condition:
        raise Violation(message() if callable(message) else message)


@dataclass(frozen=True)
class MachineConfig:
    """A small fp32 context. ``paused_blocks=None`` uses the default half split at
    ``unified_memory_level=0``; otherwise ``paused_buffer_size_gb`` is that many blocks.
    ``layer_types`` (``*`` attention, ``M`` Mamba, ``-`` MLP) makes it a hybrid with Mamba
    states of ``conv_shape`` and ``ssm_shape``; ``num_layers`` is then ignored."""

    name: str
    block_size: int = 4
    buffer_blocks: int = 16
    paused_blocks: Optional[int] = 4
    mla: bool = False
    max_sequence_length: int = 40
    max_tokens: int = 32
    max_requests: int = 8
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 4
    kv_lora_rank: int = 8
    rope_dim: int = 4
    layer_types: Optional[Tuple[str, ...]] = None
    conv_shape: Tuple[int, ...] = (3, 2)
    ssm_shape: Tuple[int, ...] = (2, 2, 3)

    @property
    def hybrid(self) -> bool:
        return self.layer_types is not None

    @property
    def total_layers(self) -> int:
        return len(self.layer_types) if self.hybrid else self.num_layers

    @property
    def attention_layers(self) -> List[int]:
        """Global 1-based numbers of the attention layers."""
        if not self.hybrid:
            return list(range(1, self.num_layers + 1))
        return [i + 1 for i, kind in enumerate(self.layer_types) if kind == "*"]

    @property
    def mamba_layers(self) -> List[int]:
        """Global 1-based numbers of the Mamba layers."""
        if not self.hybrid:
            return []
        return [i + 1 for i, kind in enumerate(self.layer_types) if kind == "M"]

    @property
    def mamba_bytes(self) -> int:
        return 4 * len(self.mamba_layers) * (math.prod(self.conv_shape)
                                             + math.prod(self.ssm_shape))

    @property
    def block_bytes(self) -> int:
        """Bytes per block, including the one request's Mamba state a hybrid budgets per block."""
        layers = len(self.attention_layers)
        if self.mla:
            return 4 * layers * self.block_size * (self.kv_lora_rank + self.rope_dim)
        return (4 * 2 * layers * self.block_size * self.num_heads * self.head_dim
                + self.mamba_bytes)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def make_context(self) -> DynamicInferenceContext:
        args = dict(params_dtype=torch.float32, num_layers=self.total_layers,
                    kv_channels=self.head_dim, num_attention_heads=self.num_heads,
                    max_sequence_length=self.max_sequence_length,
                    buffer_size_gb=self.buffer_blocks * self.block_bytes / GIB,
                    block_size_tokens=self.block_size, max_tokens=self.max_tokens,
                    max_requests=self.max_requests, unified_memory_level=0, device="cpu")
        if self.paused_blocks is not None:
            args["paused_buffer_size_gb"] = self.paused_blocks * self.block_bytes / GIB
        if self.mla:
            args.update(cache_mla_latent=True, kv_lora_rank=self.kv_lora_rank,
                        qk_pos_emb_head_dim=self.rope_dim)
        if self.hybrid:
            args["mamba_inference_state_config"] = MambaInferenceStateConfig(
                self.layer_types, self.conv_shape, self.ssm_shape)
        ctx = DynamicInferenceContext(**args)
        # A request that pauses alone must be able to resume, or no request could ever run.
        max_blocks = math.ceil(self.max_sequence_length / self.block_size)
        if ctx.block_allocator.active_count < max_blocks:
            raise ValueError(f"config {self.name}: {ctx.block_allocator.active_count} active "
                             f"blocks cannot hold one request of {max_blocks} blocks")
        return ctx


CONFIGS = {c.name: c for c in [
    MachineConfig("bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4),
    MachineConfig("bs8-half", block_size=8, buffer_blocks=24, paused_blocks=None),
    MachineConfig("bs4-paused0", block_size=4, buffer_blocks=14, paused_blocks=0),
    MachineConfig("mla-bs8-paused3", block_size=8, buffer_blocks=12, paused_blocks=3, mla=True),
    MachineConfig("bs4-half", block_size=4, buffer_blocks=24, paused_blocks=None),
    MachineConfig("mla-bs4-half", block_size=4, buffer_blocks=24, paused_blocks=None, mla=True),
    MachineConfig("hyb-bs4-paused4", block_size=4, buffer_blocks=16, paused_blocks=4,
                  layer_types=HYBRID_LAYERS),
    MachineConfig("hyb-bs8-half", block_size=8, buffer_blocks=24, paused_blocks=None,
                  layer_types=HYBRID_LAYERS, conv_shape=(4, 3), ssm_shape=(2, 3, 2)),
    MachineConfig("hyb-bs4-paused0", block_size=4, buffer_blocks=14, paused_blocks=0,
                  layer_types=("*", "M", "-"), conv_shape=(2, 2), ssm_shape=(1, 2, 2)),
]}
CI_CONFIGS = [CONFIGS[n] for n in ("bs4-paused4", "bs8-half", "bs4-paused0", "mla-bs8-paused3",
                                   "hyb-bs4-paused4", "hyb-bs8-half")]


def sample_token(rid: int, position: int) -> int:
    """The token the model 'samples' for request ``rid`` after ``position`` tokens."""
    return (rid * 131 + position * 17 + 7) % VOCAB


def expected_metadata(rid: int) -> Dict[str, float]:
    """Per-request sampling metadata, distinct per id, so that rows moving without their
    metadata are caught (exact in fp32)."""
    return dict(temperature=((rid % 7) + 1) / 4, top_k=rid % 50, top_p=(rid % 5) / 4,
                termination_id=TERMINATION_BASE + rid, return_log_probs=rid % 2 == 0,
                skip_prompt_log_probs=rid % 3 == 0, top_n_logprobs=rid % 3)


@dataclass(eq=False)
class Tracked:
    """The engine's view of one request incarnation (an eviction or suspend makes a new one)."""

    rid: int
    uid: int                      # keys the K/V pattern: a recompute writes new values
    prompt: List[int]
    gen: int
    req: DynamicInferenceRequest
    generated: List[int] = field(default_factory=list)
    query_start: int = 0          # position of the first token of the pending query
    query: List[int] = field(default_factory=list)  # token ids of the pending query
    cached: int = 0               # tokens whose K/V are in the cache
    prefill: bool = True          # the pending query is a prompt chunk
    chunking: bool = False        # a non-final chunk is in the context
    placeholder: bool = False     # the pending query is the junk token after a non-final chunk
    paused: bool = False
    blocks: List[int] = field(default_factory=list)  # block ids seen at the last check
    slot: int = -1                # hybrids: the Mamba slot it got when added (never changes)
    mamba_writes: int = 0         # hybrids: steps whose Mamba state pattern it holds
    continued: bool = False       # the pending query is a continuation chunk (added this step)

    def expected_blocks(self, block_size: int) -> int:
        if self.paused or self.placeholder:
            return math.ceil(self.cached / block_size)
        return math.ceil((self.query_start + len(self.query)) / block_size)


class ContextDriver:
    """The model engine (see the module docstring)."""

    def __init__(self, config: MachineConfig):
        self.cfg = config
        self.ctx = config.make_context()
        self.live: Dict[int, Tracked] = {}
        self.waiting: Deque[Tracked] = deque()
        self.chunked: Optional[Tracked] = None
        self.next_rid = 0
        self.next_uid = 0
        self.stats: Counter = Counter()
        self._generator = torch.Generator().manual_seed(1234)
        self.actions: List[str] = []
        self._poison_mamba()

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
        params = SamplingParams(num_tokens_to_generate=gen, **expected_metadata(rid))
        req = DynamicInferenceRequest(request_id=rid, sampling_params=params,
                                      prompt_tokens=torch.tensor(prompt, dtype=torch.int64))
        return Tracked(rid=rid, uid=uid, prompt=list(prompt), gen=gen, req=req)

    def _checkpoint(self, t: Tracked) -> Tracked:
        """What the engine re-queues after an eviction or a suspend: prompt + generated."""
        return self._new(t.prompt + t.generated, t.gen - len(t.generated), rid=t.rid)

    def _prompt(self, length: int, salt: int) -> List[int]:
        return [(salt * 7919 + i * 104729 + 13) % VOCAB for i in range(length)]

    def _active(self) -> List[Tracked]:
        return [t for t in self.live.values() if not t.paused]

    def _model_active_tokens(self) -> int:
        return sum(len(t.query) for t in self._active())

    def _model_free_blocks(self) -> int:
        bs = self.cfg.block_size
        owned = sum(t.expected_blocks(bs) for t in self.live.values())
        return self.ctx.block_allocator.total_count - 1 - owned

    def _rows(self) -> List[Tracked]:
        ids = self.ctx.host_request_ids().tolist()
        require(len(set(ids)) == len(ids), lambda: f"a request id sits in two rows: {ids}")
        require(set(ids) == set(self.live), lambda: f"context rows {sorted(ids)} != live "
                f"requests {sorted(self.live)}")
        return [self.live[i] for i in ids]

    # ------------------------------------------------------------------ adding
    def _expected_add_errors(self, t: Tracked, chunk: int, continuation: bool,
                             duplicate: bool) -> set:
        cfg, ctx = self.cfg, self.ctx
        errors = set()
        fin = t.req.finished_chunk_token_count
        # Only a prompt longer than max_sequence_length is refused; a longer generation budget
        # is accepted and the request finished when it reaches max_sequence_length.
        if fin + t.req.remaining_prompt_length > cfg.max_sequence_length:
            errors.add(MaxSequenceLengthOverflowError)
        tokens = self._model_active_tokens() - (1 if continuation else 0)
        if not continuation:
            if duplicate:
                errors.add(ValueError)
            if len(self.live) >= cfg.max_requests:
                errors.add(RequestOverflowError)
            if ctx.chunked_prefill_request_id != -1:
                errors.add(ValueError)
            if self._continuation_pending():
                errors.add(ValueError)  # a hybrid's continuation must stay the last row
        if tokens + chunk > cfg.max_tokens:
            errors.add(TokenOverflowError)
        bs = cfg.block_size
        if math.ceil((fin + chunk) / bs) - math.ceil(fin / bs) > self._model_free_blocks():
            errors.add(BlockOverflowError)
        return errors

    def _try_add(self, t: Tracked, chunk: int, *, continuation: bool = False,
                 duplicate: bool = False, pass_none: bool = False) -> bool:
        """``add_request(t, chunk)``; True if added. An expected rejection leaves the state."""
        ctx = self.ctx
        expected = self._expected_add_errors(t, chunk, continuation, duplicate)
        before = snapshot(ctx)
        remaining = t.req.remaining_prompt_length
        arg = None if pass_none and chunk == remaining else chunk
        paused = ctx.paused_request_count
        slots_before = self._slot_stack()
        try:
            ctx.add_request(t.req, arg)
        except Exception as error:  # noqa: BLE001 - any unexpected error is a violation
            require(type(error) in expected, lambda: f"add_request(id={t.rid}, chunk={arg}, "
                    f"prompt={len(t.prompt)}, gen={t.gen}) raised {error!r}; expected "
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
        require(not expected, lambda: f"add_request(id={t.rid}, chunk={arg}, prompt="
                f"{len(t.prompt)}, gen={t.gen}) succeeded; expected one of "
                f"{sorted(e.__name__ for e in expected)}")
        fin = t.req.finished_chunk_token_count
        t.req.remaining_prompt_tokens = t.req.remaining_prompt_tokens[chunk:]
        t.req.finished_chunk_token_count = fin + chunk
        t.query_start, t.query = fin, t.prompt[fin:fin + chunk]
        t.cached = fin
        t.prefill, t.placeholder, t.paused = True, False, False
        t.continued = continuation
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
                t.slot, t.mamba_writes = slot, 0
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
            # Hybrids: the scheduler stops after a continuation chunk (docs/SEMANTICS.md §10, fixed
            # version), so the request waits for the next step.
            self.stats["deferred_adds"] += 1
            if len(self.waiting) < WAITING_LIMIT:
                self.waiting.append(t)
            return False
        added = self._try_add(t, chunk, duplicate=kind == "duplicate", pass_none=choice % 2 == 0)
        if added and kind == "chunked":
            self.ctx.chunked_prefill_request_id = t.rid
            self.chunked, t.chunking = t, True
        if not added and kind in ("fit", "too_many_tokens") and len(self.waiting) < WAITING_LIMIT:
            self.waiting.append(t)  # the engine keeps it waiting (and chunks it if needed)
        return added

    def _continuation_pending(self) -> bool:
        """A hybrid's continuation chunk (the final one included) is in the context for the next
        step: the fixed engine adds nothing after it (its Mamba metadata takes the last active
        row as the continuation; see the xfail regression in test_state_machine.py)."""
        return self.cfg.hybrid and any(t.continued for t in self.live.values())

    def admit(self) -> int:
        """The engine's chunked scheduler over the waiting queue (FIFO, stop at the first that
        does not fit; a prompt longer than the room left is chunked and ends the admission)."""
        self.note("admit")
        ctx, cfg = self.ctx, self.cfg
        admitted = 0
        while self.waiting and ctx.chunked_prefill_request_id == -1 \
                and not self._continuation_pending():
            t = self.waiting[0]
            got = ctx.check_availability(t.req)
            remaining = t.req.remaining_prompt_length
            tokens = self._model_active_tokens()
            paused = any(x.paused for x in self.live.values())
            want = (len(self.live) < cfg.max_requests and not paused,
                    tokens + remaining <= cfg.max_tokens,
                    self._model_free_blocks() >= math.ceil(remaining / cfg.block_size))
            require(tuple(got) == want, lambda: f"check_availability(id={t.rid}, remaining="
                    f"{remaining}) = {got}, expected {want}")
            if not (want[0] and want[2]):
                break
            if want[1]:
                require(self._try_add(t, remaining), f"admission of {t.rid} failed")
                self.waiting.popleft()
                admitted += 1
                continue
            if tokens < cfg.max_tokens:
                require(self._try_add(t, cfg.max_tokens - tokens), f"chunk of {t.rid} failed")
                ctx.chunked_prefill_request_id = t.rid
                self.chunked, t.chunking = t, True
                self.waiting.popleft()
                admitted += 1
            break
        return admitted

    def _continue_chunk(self, choice: int) -> None:
        """The step after a non-final chunk starts with the next chunk (the protocol)."""
        ctx, cfg, t = self.ctx, self.cfg, self.chunked
        bs = cfg.block_size
        fin = t.req.finished_chunk_token_count
        remaining = t.req.remaining_prompt_length
        token_room = cfg.max_tokens - (self._model_active_tokens() - 1)
        block_room = (math.ceil(fin / bs) + self._model_free_blocks()) * bs - fin
        most = min(remaining, token_room, block_room)
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
        final = chunk == remaining
        self.note(f"continue {t.rid} with {chunk} of {remaining}")
        if final:
            ctx.chunked_prefill_request_id = -1
        require(self._try_add(t, chunk, continuation=True, pass_none=choice % 2 == 1),
                f"continuation of {t.rid} failed")
        if final:
            self.chunked, t.chunking = None, False

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
        if cfg.hybrid:
            self._step_mamba(rows, P, active)
        self._write_kv(active, layout)
        for t in active:
            t.cached = t.query_start + len(t.query)
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
        newly = ctx.update_requests(mask_tensor, torch.tensor(samples, dtype=torch.int64))
        self.stats["steps"] += 1

        finished = {t.rid for t, keep in zip(active, mask) if not keep and not t.chunking}
        reported = ctx.max_length_finished_request_ids.tolist()
        require(sorted(reported) == sorted(at_max_length), lambda: f"update_requests finished "
                f"{sorted(reported)} at max_sequence_length, expected {sorted(at_max_length)}")
        finished |= at_max_length
        self.stats["max_length_finished"] += len(at_max_length)
        eligible = set()
        for t, token in zip(active, samples):
            t.continued = False
            if t.rid in finished:
                del self.live[t.rid]
                continue
            t.query_start, t.query, t.prefill = t.cached, [token], False
            if t.chunking:
                t.placeholder = True  # the sampled token of a non-final chunk is junk
            else:
                t.generated.append(token)
                if t.cached % cfg.block_size == 0:
                    eligible.add(t.rid)  # its last block is full: it may pause
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
        requeue = []
        for rid in evicted:
            t = self.live.pop(rid)
            require(t is not self.chunked, "the chunked prefill request was evicted")
            requeue.append(self._checkpoint(t))
        self.waiting.extendleft(reversed(requeue))  # the engine re-queues them at the front
        self.stats["evictions"] += len(evicted)
        self.stats["pauses"] += len(newly)
        self.stats["resumes"] += len(old_paused - paused_now - set(evicted))
        for t in self.live.values():
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
        self.waiting.extendleft(reversed([self._checkpoint(t) for t in rows]))
        self.live.clear()
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
        self.waiting.clear()
        self.chunked = None
        self.stats["resets"] += 1

    # ------------------------------------------------------------------ K/V pattern
    def _inner(self) -> int:
        cfg = self.cfg
        return cfg.latent_dim if cfg.mla else 2 * cfg.num_heads * cfg.head_dim

    def pattern(self, uids: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
        """Exact fp32 values of (incarnation, position, attention layer (0-based index among the
        ``*`` layers), [K/V, head, dim] | latent dim): MHA ``[n, 2, H, D]``, MLA ``[n, latent]``."""
        cfg = self.cfg
        inner = self._inner()
        layers = len(cfg.attention_layers)
        per_uid = cfg.max_sequence_length * layers * inner
        base = ((uids % (_EXACT // per_uid)) * cfg.max_sequence_length + positions) \
            * layers + layer
        values = base[:, None] * inner + np.arange(inner)[None, :]
        values = values.astype(np.float32)
        if cfg.mla:
            return values
        return values.reshape(-1, 2, cfg.num_heads, cfg.head_dim)

    def _decode(self, value: float) -> str:
        cfg = self.cfg
        v = int(value)
        if value != v or v < 0:
            return f"{value} (not written by the pattern)"
        v //= self._inner()
        layers = len(cfg.attention_layers)
        layer, v = v % layers, v // layers
        pos, uid = v % cfg.max_sequence_length, v // cfg.max_sequence_length
        return f"{value} (uid {uid}, position {pos}, layer {cfg.attention_layers[layer]})"

    def _write_kv(self, active: List[Tracked], layout: int) -> None:
        ctx, cfg = self.ctx, self.cfg
        n = ctx.padded_active_token_count
        uids = np.concatenate([np.full(len(t.query), t.uid) for t in active])
        positions = np.concatenate([t.query_start + np.arange(len(t.query)) for t in active])
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

    def check_kv(self) -> None:
        """Every live request's cached K/V (positions < cached) equal the pattern."""
        ctx, cfg = self.ctx, self.cfg
        bs = cfg.block_size
        ids = ctx.host_request_ids().tolist()
        table = ctx.block_table_host
        uids, positions, blocks = [], [], []
        for row, rid in enumerate(ids):
            t = self.live[rid]
            pos = np.arange(t.cached)
            uids.append(np.full(t.cached, t.uid))
            positions.append(pos)
            blocks.append(table[row, pos // bs])
        if not ids:
            return
        uids, positions, blocks = map(np.concatenate, (uids, positions, blocks))
        if positions.size == 0:
            return
        require(np.all(blocks >= 0), "a cached position has no block")
        slots = positions % bs
        for layer, number in enumerate(cfg.attention_layers):
            expected = self.pattern(uids, positions, layer)
            k_cache, v_cache = ctx.key_value_cache(number)
            if cfg.mla:
                require(v_cache is None, "the MLA cache returned a V view")
                got = k_cache[blocks, slots].numpy()
            else:
                got = np.stack([k_cache[blocks, slots].numpy(), v_cache[blocks, slots].numpy()],
                               axis=1)
            bad = np.flatnonzero((got != expected).reshape(len(positions), -1).any(axis=1))
            if bad.size:
                i = bad[0]
                rid = next(t.rid for t in self.live.values() if t.uid == uids[i])
                raise Violation(
                    f"cached K/V of request {rid} (uid {uids[i]}) at position {positions[i]}, "
                    f"layer {number}, block {blocks[i]} slot {slots[i]} is "
                    f"{self._decode(got[i].reshape(-1)[0])}, expected "
                    f"{self._decode(expected[i].reshape(-1)[0])} ({bad.size} positions differ)")

    # ------------------------------------------------------------------ Mamba (hybrids)
    def _slot_stack(self) -> Optional[List[int]]:
        """The free Mamba slots, bottom to top of the stack (None for a non-hybrid)."""
        if not self.cfg.hybrid or not self.ctx.is_tensor_state_allocated:
            return None
        slots = self.ctx._mamba_slots
        return slots.free_slots[:slots.free_count].tolist()

    def _poison_mamba(self) -> None:
        """Fill every Mamba state with a value no pattern has (``torch.empty`` may be zeros)."""
        if self.cfg.hybrid:
            for number in self.cfg.mamba_layers:
                for states in self.ctx.mamba_states_cache(number):
                    states.fill_(_POISON)

    def mamba_pattern(self, uids: np.ndarray, writes: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Exact fp32 values of (incarnation, write count, Mamba layer (0-based index among the
        ``M`` layers), conv | ssm, element): conv ``[n, layers, *conv_shape]`` and ssm
        ``[n, layers, *ssm_shape]``."""
        cfg = self.cfg
        inner = max(math.prod(cfg.conv_shape), math.prod(cfg.ssm_shape))
        layers, span = len(cfg.mamba_layers), cfg.max_sequence_length + 1
        per_uid = span * layers * 2 * inner
        base = ((uids % (_EXACT // per_uid - 1)) * span + writes % span)[:, None] * layers \
            + np.arange(layers)[None, :]                                     # [n, layers]
        out = []
        for ssm, shape in enumerate((cfg.conv_shape, cfg.ssm_shape)):
            values = (base * 2 + ssm)[..., None] * inner + np.arange(math.prod(shape)) + 1
            out.append(values.astype(np.float32).reshape(len(uids), layers, *shape))
        return out[0], out[1]

    def _decode_mamba(self, value: float) -> str:
        cfg = self.cfg
        v = int(value)
        if value != v or v <= 0:
            return f"{value} (not written by the pattern)"
        v -= 1
        inner = max(math.prod(cfg.conv_shape), math.prod(cfg.ssm_shape))
        layers, span = len(cfg.mamba_layers), cfg.max_sequence_length + 1
        v //= inner
        kind, v = ("ssm", "conv")[v % 2 == 0], v // 2
        layer, v = v % layers, v // layers
        writes, uid = v % span, v // span
        return (f"{value} (uid {uid}, write {writes}, {kind} of layer "
                f"{cfg.mamba_layers[layer]})")

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
        writes = np.array([t.mamba_writes for t in live])
        fresh = writes == 0
        wants = self.mamba_pattern(np.array([t.uid for t in live]), writes)
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
        patterns = self.mamba_pattern(np.array([t.uid for t in active]),
                                      np.array([t.mamba_writes for t in active]))
        src = []
        for shape, pattern in zip((cfg.conv_shape, cfg.ssm_shape), patterns):
            data = torch.full((len(index), len(cfg.mamba_layers), *shape), _POISON)
            data[torch.from_numpy(valid)] = torch.from_numpy(pattern)
            src.append(data)
        for layer, number in enumerate(cfg.mamba_layers):
            # (The next check() reads every state back; update_requests must not touch them.)
            ctx.scatter_mamba_states(number, index, src[0][:, layer], src[1][:, layer])

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
            expect = {"token_to_input_ids": np.array(t.query), "token_to_pos_ids": pos,
                      "token_to_request_idx": np.full(q, P + i),
                      "token_to_block_idx": table[P + i, pos // bs],
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
        require(max_q >= q_lens.max() and (prefill > 0 or max_q == 1),
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

    # ------------------------------------------------------------------ invariants
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
                require(offset + q == t.cached and t.cached % bs == 0
                        and h[FIELD_LAST_OFFSET, row] == bs - 1,
                        lambda: f"paused {where}: offset {offset} + query {q} != cached "
                        f"{t.cached} or its last block is not full")
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
        require(np.unique(owned).size == owned.size, "a block is owned by two requests")
        require(np.unique(free).size == free.size, "the free stack holds a block twice")
        require(np.intersect1d(owned, free).size == 0, "a block is both owned and free")
        require(owned.size + free.size == alloc.total_count - 1, lambda: f"blocks leaked: "
                f"{owned.size} owned + {free.size} free != {alloc.total_count - 1}")
        dummy = alloc.dummy_block_idx
        require(dummy not in owned and dummy not in free, "the dummy block is in use")
        require(np.all(alloc.ref_counts[owned] == 1) and np.all(alloc.ref_counts[free] == 0),
                "reference counts disagree with ownership")
        stats = ctx.get_kvcache_utilization_stats()
        require(stats["allocated_blocks"] == owned.size and stats["paused_request_count"] == P
                and stats["total_request_count"] == T, lambda: f"utilization stats {stats}")

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
        if cfg.hybrid:
            self.check_mamba(rows, device)
        self.check_kv()
