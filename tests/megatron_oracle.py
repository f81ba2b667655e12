"""Megatron-Core 0.16.1's ``DynamicInferenceContext`` as a CPU oracle, and a workload driver.

The driver's scheduling loop below is, on purpose, NOT dynctx's scheduler
(``engine/scheduler.py``, shared by ``Engine`` and the state-machine driver): it is a
deliberate replica of Megatron-Core's own engine loop (``DynamicInferenceEngine.
schedule_chunked_prefill`` and ``post_process_requests``, with their re-queue order), so that
the differential tests drive both contexts exactly as Megatron's engine would. Keep it a replica
of Megatron's code; do not replace it with the shared scheduler.

Two things are here, both used by the differential tests; the first, which
``bench/step_overhead.py`` uses too, lives in ``bench/megatron_cpu.py`` and is re-exported:

1. **Megatron on a CPU.** ``megatron_on_cpu()`` is a re-entrant context manager that, while
   held, makes ``torch.cuda.current_device()`` return ``"cpu"`` and turns
   ``torch.cuda.nvtx.range_push`` / ``range_pop`` into no-ops (a CPU build of torch raises on
   both). Nothing is patched at import time, and everything is restored on the last exit.
   Megatron's context reads ``torch.cuda.current_device()`` at call time (every
   ``update_requests`` that pauses or evicts builds ``arange`` tensors with it), so the patch must
   be held during every call, not only construction. ``make_megatron_context(**kwargs)`` returns a
   ``MegatronCPUContext``: a thin proxy that enters the patch around every method call of the
   wrapped context (attribute reads and writes go straight through), so tests need not hold
   anything, and our own context never runs under the patch.

   Nothing else is needed: with ``tensor_model_parallel_size=1``,
   ``pipeline_model_parallel_size=1``, ``unified_memory_level=0`` and no CUDA graphs, 0.16.1 does
   not touch ``parallel_state``, the unified-memory pool, the PP all-reduce or any CUDA API
   besides ``current_device``; its Triton KV-append kernel is imported but only used by
   ``append_key_value_cache``, which the driver does not call.

2. **The workload driver.** ``run_workload(ctx, workload, *, request_factory)`` plays the part
   of Megatron's engine and controller, written against the Megatron context API only, so the
   SAME driver drives either context (the request class comes in through ``request_factory``).
   Per step it:

   * admits arrivals into a FIFO waiting queue;
   * schedules with the chunked-prefill scheduler of ``DynamicInferenceEngine.
     schedule_chunked_prefill`` (docs/SEMANTICS.md §10), setting ``chunked_prefill_request_id`` and
     ``has_explicit_chunked_prefill_req`` on the context exactly as the engine does;
   * runs ``initialize_attention_state()`` and records the attention metadata;
   * "samples" one token per active row, a deterministic function of (request id, step), and
     builds the continue mask on the host (length reached, or a deterministic early stop), the
     way the controller would (docs/SEMANTICS.md §9: ``seq_len + 1 < output_len`` and
     ``token != termination_id``); the length half is cross-checked against the context's own
     ``get_active_sequence_lengths()`` / ``get_max_sequence_lengths()``;
   * calls ``update_requests(mask, tokens)`` (0.16.1's dict-or-None result, or the API text's
     Tensor of newly paused ids with the evicted ids in ``ctx.evicted_request_ids``, are both
     read) and post-processes like the engine: appends the
     sampled token to every active non-chunked request, drops finished ones, and re-queues
     evicted ones at the FRONT of the queue (behind an in-flight chunked prefill, as 0.16.1's
     engine does, with ``deque.extendleft`` order) with prompt = prompt + generated and the
     generation budget reduced (``DynamicInferenceRequestRecord.checkpoint``,
     docs/SEMANTICS.md §9.4).

   It returns one ``StepRecord`` per forward step. Each record also carries what the host
   KNOWS the context must show (``expected_*``: per-request query length, kv offset, input ids
   and positions, derived from the driver's own bookkeeping) and the block-ownership invariant
   check, so a record can be checked against the truth, not only against the other context.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "megatron_on_cpu",
    "patches_active",
    "MegatronCPUContext",
    "make_megatron_context",
    "megatron_request_factory",
    "make_request_factory",
    "RequestSpec",
    "Workload",
    "StepRecord",
    "OracleError",
    "run_workload",
    "check_block_invariants",
    "block_size_bytes",
    "gb_for_blocks",
    "base_config",
    "workload_basic",
    "workload_chunked",
    "workload_pressure",
    "workload_pressure_chunked",
    "generate_workload",
    "workload_long_prompts",
    "compare_records",
    "Difference",
    "sampled_token",
    "prompt_token",
    "summarize",
]


from megatron_cpu import (  # noqa: F401 (re-exported: the tests read them as mo.*)
    CPU_DEFAULTS,
    MegatronCPUContext,
    block_size_bytes,
    gb_for_blocks,
    import_megatron,
    make_megatron_context,
    make_request_factory,
    megatron_on_cpu,
    megatron_request_factory,
    patches_active,
)

# --------------------------------------------------------------------------------------------
# 2. Configurations and workloads
# --------------------------------------------------------------------------------------------


def base_config(*, total_blocks: int, paused_blocks: int, block_size_tokens: int = 16,
                max_requests: int = 16, max_tokens: int = 64, max_sequence_length: int = 256,
                num_layers: int = 2, kv_channels: int = 8, num_attention_heads: int = 2,
                params_dtype=torch.float32) -> dict:
    """Keyword arguments accepted by both contexts: ``total_blocks`` blocks in all (the dummy
    included) and an explicit paused budget of ``paused_blocks`` blocks."""
    shape = dict(params_dtype=params_dtype, num_layers=num_layers, kv_channels=kv_channels,
                 num_attention_heads=num_attention_heads, block_size_tokens=block_size_tokens)
    bb = block_size_bytes(**shape)
    return dict(
        shape,
        max_sequence_length=max_sequence_length,
        buffer_size_gb=gb_for_blocks(total_blocks, bb),
        paused_buffer_size_gb=gb_for_blocks(paused_blocks, bb),
        max_requests=max_requests,
        max_tokens=max_tokens,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        unified_memory_level=0,
    )


@dataclass(frozen=True)
class RequestSpec:
    request_id: int
    prompt_length: int
    num_tokens_to_generate: int
    arrival_step: int = 0


@dataclass(frozen=True)
class Workload:
    """A scripted workload. ``stop_per_mille``: chance (out of 1000, a deterministic hash of
    (request id, step)) that a decode step samples the termination token; 0 means requests run
    to their length. ``config``: the context keyword arguments the workload was designed for."""

    name: str
    config: dict
    requests: Tuple[RequestSpec, ...]
    stop_per_mille: int = 0
    max_steps: int = 2000
    vocab_size: int = 32000


def prompt_token(request_id: int, index: int, vocab: int = 32000) -> int:
    return (request_id * 7919 + index * 104729 + 13) % vocab


def sampled_token(request_id: int, step: int, vocab: int = 32000) -> int:
    """The "sampled" token of a request at a step: deterministic in (request id, step)."""
    return (request_id * 2654435761 + step * 40503 + 977) % vocab


def _early_stop(request_id: int, step: int, per_mille: int) -> bool:
    if per_mille <= 0:
        return False
    h = (request_id * 0x9E3779B1 ^ (step + 1) * 0x85EBCA77) & 0xFFFFFFFF
    h ^= h >> 15
    return (h * 0x2C1B3C6D & 0xFFFFFFFF) % 1000 < per_mille


def workload_basic() -> Workload:
    """Plenty of memory: staggered arrivals, finishes, decode + prefill mixes; no pressure."""
    cfg = base_config(total_blocks=129, paused_blocks=16)
    reqs = [
        RequestSpec(0, 10, 12, 0), RequestSpec(1, 3, 20, 0), RequestSpec(2, 17, 5, 0),
        RequestSpec(3, 31, 9, 1), RequestSpec(4, 1, 33, 2), RequestSpec(5, 16, 16, 2),
        RequestSpec(6, 15, 2, 4), RequestSpec(7, 8, 1, 5), RequestSpec(8, 40, 18, 6),
        RequestSpec(9, 22, 7, 9), RequestSpec(10, 1, 4, 14),  # a 1-token prefill, alone
    ]
    return Workload("basic", cfg, tuple(reqs), stop_per_mille=40)


def workload_chunked() -> Workload:
    """Prompts longer than the token budget: chunked prefill, continuation chunks, finishes of
    requests ahead of the chunked one (the swap-back path, docs/SEMANTICS.md §0.1)."""
    cfg = base_config(total_blocks=129, paused_blocks=16)
    reqs = [
        RequestSpec(0, 10, 3, 0), RequestSpec(1, 10, 1, 0), RequestSpec(2, 100, 6, 0),
        RequestSpec(3, 7, 2, 1), RequestSpec(4, 150, 4, 2), RequestSpec(5, 5, 9, 3),
        RequestSpec(6, 64, 3, 4), RequestSpec(7, 65, 2, 5), RequestSpec(8, 2, 1, 6),
    ]
    return Workload("chunked", cfg, tuple(reqs), stop_per_mille=0)


def workload_pressure() -> Workload:
    """A small buffer (32 usable blocks of 16 tokens, 8 of them the paused budget): requests
    grow past the active budget, get paused, and overflow the paused budget, so some are
    evicted and recomputed."""
    cfg = base_config(total_blocks=33, paused_blocks=8)
    reqs = [RequestSpec(i, 5 + (i * 7) % 20, 30 + (i * 13) % 40, i // 4) for i in range(14)]
    return Workload("pressure", cfg, tuple(reqs), stop_per_mille=0)


def workload_pressure_chunked() -> Workload:
    """Memory pressure with long prompts: pausing and eviction while a chunked prefill is in
    flight (0.16.1's engine queues evicted requests behind the chunked one)."""
    cfg = base_config(total_blocks=41, paused_blocks=10)
    reqs = [RequestSpec(i, [12, 70, 9, 20, 100, 15, 6, 45, 30, 11, 80, 3][i], 25 + (i * 11) % 30,
                        (i * 2) // 3) for i in range(12)]
    return Workload("pressure_chunked", cfg, tuple(reqs), stop_per_mille=8)


def workload_long_prompts(seed: int) -> Workload:
    """Random, under pressure, with prompts up to 160 tokens (three chunks at max_tokens 64):
    chunked prefills in flight while other requests pause (P > 0 when a middle chunk's update
    runs: the `row - P` fix, docs/SEMANTICS.md §0.2) and while requests are evicted."""
    wl = generate_workload(seed, n_requests=20, total_blocks=40, paused_blocks=8, max_prompt=160,
                           max_gen=60)
    return Workload(f"long-prompts-{seed}", wl.config, wl.requests, wl.stop_per_mille)


def generate_workload(seed: int, *, n_requests: int = 16, total_blocks: int = 40,
                      paused_blocks: int = 8, max_prompt: int = 90, max_gen: int = 50,
                      stop_per_mille: int = 10, arrival_span: int = 12) -> Workload:
    """A random (seeded) workload under memory pressure. Prompt + generation always fits
    ``max_sequence_length`` (256) and the whole buffer."""
    import random

    rng = random.Random(seed)
    cfg = base_config(total_blocks=total_blocks, paused_blocks=paused_blocks)
    bs = cfg["block_size_tokens"]
    usable = total_blocks - 1
    reqs = []
    for i in range(n_requests):
        p = rng.randint(1, max_prompt)
        g = rng.randint(1, max_gen)
        # A request must fit alone in the active budget, or it can never resume.
        while math.ceil((p + g) / bs) > usable - paused_blocks - 1:
            g = max(1, g // 2)
            p = max(1, p // 2)
        reqs.append(RequestSpec(i, p, g, rng.randint(0, arrival_span)))
    return Workload(f"random-{seed}", cfg, tuple(reqs), stop_per_mille=stop_per_mille)


# --------------------------------------------------------------------------------------------
# 3. The driver
# --------------------------------------------------------------------------------------------


class OracleError(AssertionError):
    """The driver found a context disagreeing with what the host knows to be true."""


@dataclass
class StepRecord:
    step: int
    # --- scheduling (this step, before the forward pass)
    added: List[Tuple[int, int]] = field(default_factory=list)  # (request id, chunk length)
    chunked_request_id: int = -1
    junk_token_forwarded: bool = False
    # --- forward pass (after initialize_attention_state)
    paused_ids_before: List[int] = field(default_factory=list)  # row order
    active_ids: List[int] = field(default_factory=list)  # row order
    active_token_count: int = 0
    padded_active_token_count: int = 0
    padded_active_request_count: int = 0
    num_prefill_requests: int = 0
    cu_query_lengths: List[int] = field(default_factory=list)  # real rows only
    cu_kv_lengths: List[int] = field(default_factory=list)  # real rows only
    kv_seq_lengths: List[int] = field(default_factory=list)  # real rows only
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    positions: List[int] = field(default_factory=list)  # token_to_pos_ids[:active_tokens]
    input_ids: List[int] = field(default_factory=list)  # token_to_input_ids[:active_tokens]
    query_lengths_by_id: Dict[int, int] = field(default_factory=dict)
    kv_offsets_by_id: Dict[int, int] = field(default_factory=dict)
    kv_lengths_by_id: Dict[int, int] = field(default_factory=dict)  # offset + query length
    positions_by_id: Dict[int, List[int]] = field(default_factory=dict)
    input_ids_by_id: Dict[int, List[int]] = field(default_factory=dict)
    total_avail_before: int = 0
    # --- what the host knows must hold at the forward pass
    expected_query_lengths_by_id: Dict[int, int] = field(default_factory=dict)
    expected_kv_offsets_by_id: Dict[int, int] = field(default_factory=dict)
    expected_positions_by_id: Dict[int, List[int]] = field(default_factory=dict)
    expected_input_ids_by_id: Dict[int, List[int]] = field(default_factory=dict)
    # --- update_requests
    sampled: Dict[int, int] = field(default_factory=dict)
    finished_ids: List[int] = field(default_factory=list)
    update_returned_none: bool = False
    update_return_form: str = ""  # "dict", "none" (megatron 0.16.1) or "tensor" (API text)
    context_emptied: bool = False
    newly_paused_ids: List[int] = field(default_factory=list)  # as returned
    evicted_ids: List[int] = field(default_factory=list)  # as returned
    newly_paused_truth: List[int] = field(default_factory=list)  # active before, paused after
    paused_ids_after: List[int] = field(default_factory=list)  # row order
    active_ids_after: List[int] = field(default_factory=list)  # row order
    total_avail_after: int = 0
    block_counts_by_id_after: Dict[int, int] = field(default_factory=dict)
    block_ids_by_id_after: Dict[int, List[int]] = field(default_factory=dict)


@dataclass
class _ReqState:
    spec: RequestSpec
    prompt: torch.Tensor  # current prompt (original, or prompt + generated after eviction)
    gen_budget: int  # tokens still to generate from this prompt
    generated: List[int] = field(default_factory=list)  # since the last checkpoint
    all_generated: List[int] = field(default_factory=list)
    request: Any = None
    evictions: int = 0
    done: bool = False
    in_context: bool = False


def _ints(t: torch.Tensor) -> List[int]:
    return [int(v) for v in t.detach().to("cpu").reshape(-1).tolist()]


def check_block_invariants(ctx) -> None:
    """Every used block is owned by exactly one live row, the dummy by none, and the free count
    is what is left (Megatron API names only). Raises ``OracleError``."""
    total = int(ctx.total_request_count)
    alloc = ctx.block_allocator
    counts = _ints(ctx.request_kv_block_counts[:total])
    table = ctx.request_to_kv_block_ids[:total].to("cpu")
    owned = []
    for row, n in enumerate(counts):
        ids = [int(v) for v in table[row, :n].tolist()]
        if any(b < 0 for b in ids):
            raise OracleError(f"row {row} has count {n} but block ids {ids}")
        rest = table[row, n:]
        if bool((rest != -1).any()):
            raise OracleError(f"row {row}: entries past its {n} blocks are not -1: {rest.tolist()}")
        owned.extend(ids)
    if len(set(owned)) != len(owned):
        raise OracleError(f"a block is owned twice: {sorted(owned)}")
    dummy = int(alloc.total_count) - 1
    if dummy in owned:
        raise OracleError("the dummy block is owned by a request")
    if len(owned) != (int(alloc.total_count) - 1) - int(alloc.total_avail):
        raise OracleError(
            f"{len(owned)} blocks owned but total_count-1-total_avail = "
            f"{int(alloc.total_count) - 1 - int(alloc.total_avail)}"
        )


def run_workload(ctx, workload: Workload, *, request_factory: Callable,
                 max_steps: Optional[int] = None, check_expectations: bool = True,
                 check_invariants: bool = True) -> List[StepRecord]:
    """Drive ``ctx`` through ``workload``; see the module docstring. Returns the step records.

    With ``check_expectations`` the driver raises ``OracleError`` the moment the context's
    per-request lengths, positions or input ids differ from what the host knows, or its
    length-based finish test disagrees with the host's; with ``check_invariants`` it checks
    block ownership after every update.
    """
    max_steps = workload.max_steps if max_steps is None else max_steps
    vocab = workload.vocab_size
    device = ctx.request_ids.device
    is_hybrid = bool(getattr(ctx, "is_hybrid_model", False))

    states: Dict[int, _ReqState] = {}
    for spec in workload.requests:
        prompt = torch.tensor([prompt_token(spec.request_id, i, vocab)
                               for i in range(spec.prompt_length)], dtype=torch.long)
        states[spec.request_id] = _ReqState(spec, prompt, spec.num_tokens_to_generate)
    pending = sorted(workload.requests, key=lambda s: (s.arrival_step, s.request_id))
    waiting: deque = deque()
    records: List[StepRecord] = []

    def new_request(st: _ReqState):
        st.request = request_factory(st.spec.request_id, st.prompt, st.gen_budget)
        return st.request

    for step in range(max_steps):
        while pending and pending[0].arrival_step <= step:
            spec = pending.pop(0)
            new_request(states[spec.request_id])
            waiting.append(spec.request_id)
        if not waiting and all(st.done for st in states.values()) and not pending:
            return records

        rec = StepRecord(step=step)

        # ---- schedule (DynamicInferenceEngine.schedule_chunked_prefill)
        can_schedule = True
        while waiting and can_schedule:
            can_schedule = False
            rid = waiting[0]
            req = states[rid].request
            continuing = int(ctx.chunked_prefill_request_id) >= 0
            remaining = len(req.remaining_prompt_tokens)
            fully = ctx.active_token_count + remaining <= ctx.max_tokens
            partially = ctx.active_token_count < ctx.max_tokens
            can_add, _, kv_ok = ctx.check_availability(req)
            can_add = continuing or can_add
            if can_add and kv_ok:
                if fully:
                    ctx.has_explicit_chunked_prefill_req = (
                        is_hybrid and int(ctx.chunked_prefill_request_id) == rid
                    )
                    ctx.chunked_prefill_request_id = -1
                    ctx.add_request(req)
                    states[rid].in_context = True
                    rec.added.append((rid, remaining))
                    req.remaining_prompt_tokens = req.remaining_prompt_tokens.new_empty(0)
                    waiting.popleft()
                    can_schedule = not ctx.has_explicit_chunked_prefill_req
                elif partially:
                    chunk = ctx.max_tokens - ctx.active_token_count
                    ctx.add_request(req, chunk_length=chunk)
                    states[rid].in_context = True
                    rec.added.append((rid, chunk))
                    ctx.chunked_prefill_request_id = rid
                    ctx.has_explicit_chunked_prefill_req = is_hybrid
                    req.remaining_prompt_tokens = req.remaining_prompt_tokens[chunk:]
                    req.finished_chunk_token_count += chunk

        if ctx.active_token_count == 0:
            if int(ctx.total_request_count) > 0:
                raise OracleError(f"step {step}: requests in the context but no active tokens")
            if waiting and not pending:
                raise OracleError(f"step {step}: request {waiting[0]} can never be scheduled")
            continue  # idle step: wait for arrivals

        chunked_id = int(ctx.chunked_prefill_request_id)
        rec.chunked_request_id = chunked_id

        # ---- forward pass metadata
        ctx.initialize_attention_state()
        ctx.current_input_and_position_ids()
        P, T = int(ctx.paused_request_count), int(ctx.total_request_count)
        A, n_tok = T - P, int(ctx.active_token_count)
        rec.paused_ids_before = _ints(ctx.request_ids[:P])
        rec.active_ids = _ints(ctx.request_ids[P:T])
        rec.active_token_count = n_tok
        rec.padded_active_token_count = int(ctx.padded_active_token_count)
        rec.padded_active_request_count = int(ctx.padded_active_request_count)
        rec.num_prefill_requests = int(ctx.num_prefill_requests)
        cu_q, max_q = ctx.cu_query_lengths()
        cu_kv, kv_lens, max_k = ctx.cu_kv_lengths()
        rec.cu_query_lengths = _ints(cu_q[: A + 1])
        rec.cu_kv_lengths = _ints(cu_kv[: A + 1])
        rec.kv_seq_lengths = _ints(kv_lens[:A])
        rec.max_seqlen_q, rec.max_seqlen_k = int(max_q), int(max_k)
        rec.positions = _ints(ctx.token_to_pos_ids[:n_tok])
        rec.input_ids = _ints(ctx.token_to_input_ids[:n_tok])
        q_lens = _ints(ctx.request_query_lengths[P:T])
        kv_offs = _ints(ctx.request_kv_length_offsets[P:T])
        rec.total_avail_before = int(ctx.block_allocator.total_avail)
        for i, rid in enumerate(rec.active_ids):
            rec.query_lengths_by_id[rid] = q_lens[i]
            rec.kv_offsets_by_id[rid] = kv_offs[i]
            rec.kv_lengths_by_id[rid] = q_lens[i] + kv_offs[i]
            lo, hi = rec.cu_query_lengths[i], rec.cu_query_lengths[i + 1]
            rec.positions_by_id[rid] = rec.positions[lo:hi]
            rec.input_ids_by_id[rid] = rec.input_ids[lo:hi]

        # What the host knows.
        added = dict(rec.added)
        for rid in rec.active_ids:
            st = states[rid]
            if rid in added:  # a prefill chunk (first, middle or last)
                chunk = added[rid]
                # The scheduler advanced finished_chunk_token_count past a non-final chunk.
                start = st.request.finished_chunk_token_count - (chunk if rid == chunked_id else 0)
                rec.expected_query_lengths_by_id[rid] = chunk
                rec.expected_kv_offsets_by_id[rid] = start
                rec.expected_positions_by_id[rid] = list(range(start, start + chunk))
                rec.expected_input_ids_by_id[rid] = _ints(st.prompt[start:start + chunk])
            elif rid == chunked_id or not st.generated:
                # A chunked prefill whose continuation was not scheduled: its junk token is
                # forwarded as a decode token (docs/SEMANTICS.md §10). Nothing to expect.
                rec.junk_token_forwarded = True
                continue
            else:  # decode: the last sampled token at its position
                kv = len(st.prompt) + len(st.generated) - 1
                rec.expected_query_lengths_by_id[rid] = 1
                rec.expected_kv_offsets_by_id[rid] = kv
                rec.expected_positions_by_id[rid] = [kv]
                rec.expected_input_ids_by_id[rid] = [st.generated[-1]]
        if check_expectations:
            _check_forward(rec)

        # ---- sample and build the mask (the controller)
        tokens, mask = [], []
        ctx_len_ok = _ints(
            torch.less(ctx.get_active_sequence_lengths() + 1, ctx.get_max_sequence_lengths())
        )
        for i, rid in enumerate(rec.active_ids):
            st = states[rid]
            tok = sampled_token(rid, step, vocab)
            tokens.append(tok)
            rec.sampled[rid] = tok
            if rid == chunked_id:
                mask.append(1)  # the context forces it anyway; it is not a real sample
                continue
            host_len_ok = len(st.generated) + 1 < st.gen_budget
            if check_expectations and bool(ctx_len_ok[i]) != host_len_ok:
                raise OracleError(
                    f"step {step}: request {rid}: context says seq_len+1 < max_len is "
                    f"{bool(ctx_len_ok[i])}, host says {host_len_ok}"
                )
            keep = host_len_ok and not _early_stop(rid, step, workload.stop_per_mille)
            mask.append(1 if keep else 0)
        mask_t = torch.tensor(mask, dtype=torch.uint8, device=device)
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)

        result = ctx.update_requests(mask_t, tokens_t)

        # ---- post-process (DynamicInferenceEngine.post_process_requests)
        # megatron-core 0.16.1 returns {"newly_paused_request_ids", "evict_request_ids"} (each
        # a tensor or None), or None when the context becomes empty. The API text
        # (docs/SEMANTICS.md §9) documents a Tensor of newly paused ids; a context that
        # returns that form reports its evicted ids in `evicted_request_ids`.
        rec.update_returned_none = result is None
        if result is None:
            rec.update_return_form, newly, evicted = "none", None, None
        elif isinstance(result, dict):
            rec.update_return_form = "dict"
            newly = result.get("newly_paused_request_ids")
            evicted = result.get("evict_request_ids")
        elif isinstance(result, torch.Tensor) and hasattr(ctx, "evicted_request_ids"):
            rec.update_return_form = "tensor"
            newly, evicted = result, ctx.evicted_request_ids
        else:
            raise OracleError(
                f"step {step}: update_requests returned {type(result).__name__}; expected "
                "megatron-core 0.16.1's dict {'newly_paused_request_ids', 'evict_request_ids'} "
                "or None, or a Tensor of newly paused ids with ctx.evicted_request_ids"
            )
        rec.newly_paused_ids = [] if newly is None else _ints(newly)
        rec.evicted_ids = [] if evicted is None else _ints(evicted)
        for i, rid in enumerate(rec.active_ids):
            st = states[rid]
            if rid == chunked_id:
                continue
            st.generated.append(rec.sampled[rid])
            st.all_generated.append(rec.sampled[rid])
            if mask[i] == 0:
                st.done = True
                st.in_context = False
                rec.finished_ids.append(rid)
        if rec.evicted_ids:
            waiting.extendleft(rec.evicted_ids)
            if int(ctx.chunked_prefill_request_id) != -1:
                cid = waiting[len(rec.evicted_ids)]
                del waiting[len(rec.evicted_ids)]
                waiting.appendleft(cid)
            for rid in rec.evicted_ids:
                st = states[rid]
                st.prompt = torch.cat([st.prompt, torch.tensor(st.generated, dtype=torch.long)])
                st.gen_budget -= len(st.generated)
                st.generated = []
                st.evictions += 1
                st.in_context = False
                new_request(st)

        P2, T2 = int(ctx.paused_request_count), int(ctx.total_request_count)
        rec.context_emptied = T2 == 0
        rec.paused_ids_after = _ints(ctx.request_ids[:P2])
        rec.active_ids_after = _ints(ctx.request_ids[P2:T2])
        before = set(rec.active_ids)
        rec.newly_paused_truth = [rid for rid in rec.paused_ids_after if rid in before]
        rec.total_avail_after = int(ctx.block_allocator.total_avail)
        counts = _ints(ctx.request_kv_block_counts[:T2])
        table = ctx.request_to_kv_block_ids[:T2].to("cpu")
        for row, rid in enumerate(rec.paused_ids_after + rec.active_ids_after):
            rec.block_counts_by_id_after[rid] = counts[row]
            rec.block_ids_by_id_after[rid] = [int(v) for v in table[row, : counts[row]].tolist()]
        if check_invariants:
            check_block_invariants(ctx)
            live = {rid for rid, st in states.items() if st.in_context}
            in_ctx = set(rec.paused_ids_after) | set(rec.active_ids_after)
            if in_ctx != live:
                raise OracleError(
                    f"step {step}: context holds {sorted(in_ctx)}, host expects {sorted(live)}"
                )
        records.append(rec)

    raise OracleError(f"workload {workload.name!r} did not finish in {max_steps} steps")


def _check_forward(rec: StepRecord) -> None:
    for name in ("query_lengths", "kv_offsets", "positions", "input_ids"):
        got = getattr(rec, f"{name}_by_id")
        want = getattr(rec, f"expected_{name}_by_id")
        if rec.junk_token_forwarded:
            got = {k: v for k, v in got.items() if k in want}
        if got != want:
            bad = {k: (got.get(k), want.get(k)) for k in set(got) | set(want)
                   if got.get(k) != want.get(k)}
            raise OracleError(f"step {rec.step}: {name} (got, expected) by request id: {bad}")
    if len(rec.positions) != rec.active_token_count:
        raise OracleError(f"step {rec.step}: {len(rec.positions)} positions for "
                          f"{rec.active_token_count} tokens")
    kv = [rec.kv_lengths_by_id[r] for r in rec.active_ids]
    if rec.kv_seq_lengths != kv:
        raise OracleError(f"step {rec.step}: kv_seq_lengths {rec.kv_seq_lengths} != {kv}")
    cum = [0]
    for v in kv:
        cum.append(cum[-1] + v)
    if rec.cu_kv_lengths != cum:
        raise OracleError(f"step {rec.step}: cu_kv_lengths {rec.cu_kv_lengths} != {cum}")


def summarize(records: Sequence[StepRecord]) -> dict:
    """Counts over a run: steps, pauses, evictions, chunked steps, the most paused at once."""
    return dict(
        steps=len(records),
        pause_events=sum(len(r.newly_paused_truth) for r in records),
        steps_with_paused=sum(1 for r in records if r.paused_ids_after),
        max_paused=max((len(r.paused_ids_after) for r in records), default=0),
        evictions=sum(len(r.evicted_ids) for r in records),
        chunked_steps=sum(1 for r in records if r.chunked_request_id != -1),
        chunked_with_paused=sum(
            1 for r in records if r.chunked_request_id != -1 and r.paused_ids_before
        ),
        evictions_during_chunked=sum(
            len(r.evicted_ids) for r in records if r.chunked_request_id != -1
        ),
        finish_ahead_of_chunked=sum(
            1 for r in records
            if r.chunked_request_id != -1 and r.finished_ids
            and r.chunked_request_id in r.active_ids_after
        ),
        junk_token_steps=sum(1 for r in records if r.junk_token_forwarded),
        finished=sum(len(r.finished_ids) for r in records),
        newly_paused_misreports=sum(
            1 for r in records if sorted(r.newly_paused_ids) != sorted(r.newly_paused_truth)
        ),
    )


# --------------------------------------------------------------------------------------------
# 4. Comparing two runs
# --------------------------------------------------------------------------------------------

#: Fields compared per step, matched by request id where they are per-request.
COMPARED_FIELDS = (
    "added", "chunked_request_id", "active_token_count", "padded_active_token_count",
    "padded_active_request_count", "num_prefill_requests", "max_seqlen_q", "max_seqlen_k",
    "query_lengths_by_id", "kv_offsets_by_id", "kv_lengths_by_id", "positions_by_id",
    "input_ids_by_id", "total_avail_before", "sampled", "finished_ids", "context_emptied",
    "newly_paused_ids", "evicted_ids", "paused_ids_after", "total_avail_after",
    "block_counts_by_id_after",
)
#: Row order (identical when both run the same compaction / pause / resume / evict moves).
ORDER_FIELDS = (
    "paused_ids_before", "active_ids", "active_ids_after", "cu_query_lengths",
    "cu_kv_lengths", "kv_seq_lengths", "positions", "input_ids",
)


@dataclass(frozen=True)
class Difference:
    step: int
    field: str
    ours: Any
    reference: Any

    def __str__(self):
        return f"step {self.step}: {self.field}: ours {self.ours!r} vs megatron {self.reference!r}"


def _norm(field_name: str, value):
    if field_name in ("newly_paused_ids", "paused_ids_after", "finished_ids"):
        return sorted(value)  # sets (order is compared by ORDER_FIELDS / paused rows)
    return value


def compare_records(ours: Sequence[StepRecord], reference: Sequence[StepRecord], *,
                    fields: Sequence[str] = COMPARED_FIELDS) -> List[Difference]:
    """Every difference between two runs of the same workload, step by step."""
    diffs: List[Difference] = []
    if [r.step for r in ours] != [r.step for r in reference]:
        diffs.append(Difference(-1, "steps", [r.step for r in ours],
                                [r.step for r in reference]))
    for a, b in zip(ours, reference):
        for name in fields:
            va, vb = _norm(name, getattr(a, name)), _norm(name, getattr(b, name))
            if va != vb:
                diffs.append(Difference(a.step, name, va, vb))
    return diffs
