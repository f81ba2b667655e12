"""The context on ``kernel_backend="triton"`` gives what it gives on ``"torch"``, whatever the
layout of the tensors a model hands it.

A short workload (chunked prefill, decode, memory pressure that pauses and resumes requests,
finished requests) runs twice through the public API only: once on the Triton kernels (under
``TRITON_INTERPRET=1`` on a CPU) with every tensor argument passed as a strided, offset or
transposed view (``sampled[:, 0]`` as ``new_tokens``, logits as a transposed buffer, q/k/v with
padded heads...), once on the torch references with contiguous copies of the same values. Every
output and the context's observable state after every call must agree: bit for bit for data
movement (metadata, block tables, K/V appends, gathers, compaction), within the rope and
log-softmax tolerances of ``tests/tolerances.py`` for arithmetic. A hybrid model does the same
with Mamba state gather and scatter at strided slot ids, and an MLA model with the latent cache
and the MLA-layout rope.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import BLOCK, GIB, add, make_ctx, request
from sizing_warning import built
from tolerances import LOG_SOFTMAX_TOLERANCE, assert_rope_close
from triton_marks import needs_triton

from dynctx.context import DynamicInferenceContext, MambaInferenceStateConfig
from dynctx.kernels import backend
from dynctx.kernels.rope import make_rope_tables

pytestmark = [
    pytest.mark.interpreter,
    needs_triton,
]

# Compiled Triton on a GPU, the interpreter on a CPU (the Triton backend needs one of them).
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not backend.triton_interpreting()
                      else "cpu")
VOCAB = 160  # above every prompt token of helpers.request (100 + id + position)
HEADS, DIM = 2, 8
FREQS, COS_SIN = make_rope_tables(128, DIM, False, device=DEVICE)
KINDS = ("offset", "strided", "transposed")


def as_view(values: torch.Tensor, kind: str) -> torch.Tensor:
    """``values`` copied into a non-contiguous (or offset) layout of a NaN/0x5A-poisoned buffer."""
    shape = tuple(values.shape)
    if kind == "offset":
        buffer = torch.empty(values.numel() + 5, dtype=values.dtype, device=values.device)
        view = buffer[3:3 + values.numel()].view(shape)
    elif kind == "strided":
        buffer = torch.empty([2 * s + 1 for s in shape], dtype=values.dtype,
                             device=values.device)
        view = buffer[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
    elif kind == "transposed" and values.dim() >= 2:
        buffer = torch.empty(shape[::-1], dtype=values.dtype, device=values.device)
        view = buffer.permute(*range(values.dim() - 1, -1, -1))
    else:  # a 1-D tensor has no transpose: take it as a column of a wider matrix
        buffer = torch.empty(values.numel(), 3, dtype=values.dtype, device=values.device)
        view = buffer[:, 1].view(shape)
    if buffer.is_floating_point():
        buffer.fill_(float("nan"))
    else:
        buffer.view(torch.uint8).fill_(0x5A)
    view.copy_(values)
    assert not view.is_contiguous() or view.storage_offset() > 0
    return view


def exact(name: str, got, want) -> None:
    if isinstance(got, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(got.nan_to_num(-999.0) if got.is_floating_point() else got,
                           want.nan_to_num(-999.0) if want.is_floating_point() else want), \
            f"{name}: triton\n{got}\ntorch\n{want}"
    elif isinstance(got, np.ndarray):
        assert np.array_equal(got, want), f"{name}: triton {got} torch {want}"
    else:
        assert got == want, f"{name}: triton {got} torch {want}"


def observable_state(ctx: DynamicInferenceContext) -> dict:
    """What the public API shows of the request rows (device views read back as host copies)."""
    P, T = ctx.paused_request_count, ctx.total_request_count
    state = dict(counts=(P, T, ctx.active_token_count, ctx.get_active_request_count()),
                 ids=ctx.host_request_ids()[:T].copy(),
                 block_table=ctx.block_table_host[:T].copy(),
                 kv_block_counts=ctx.kv_block_counts_host[:T].copy(),
                 device_block_table=ctx.request_to_kv_block_ids.clone(),
                 paused_tokens=None if ctx.paused_tokens is None else ctx.paused_tokens.clone())
    for name, tensor in ctx.request_metadata.items():
        state[f"metadata.{name}"] = tensor[:T].clone()
    return state


def step_state(ctx: DynamicInferenceContext) -> dict:
    """What ``initialize_attention_state`` published for the step."""
    n = ctx.padded_active_token_count
    input_ids, position_ids = ctx.current_input_and_position_ids()
    state = dict(n=n, input_ids=input_ids.clone(), position_ids=position_ids.clone(),
                 cu_query_lengths=ctx.cu_query_lengths()[0].clone(),
                 cu_kv_lengths=ctx.cu_kv_lengths()[0].clone(),
                 decode=ctx.num_decode_requests)
    for name in ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                 "token_to_block_idx", "token_to_position_in_request",
                 "token_to_local_position_within_kv_block"):
        state[name] = getattr(ctx, name)[:n].clone()
    return state


def compare(label: str, triton_state: dict, torch_state: dict) -> None:
    assert triton_state.keys() == torch_state.keys(), label
    for key in triton_state:
        exact(f"{label}: {key}", triton_state[key], torch_state[key])


class Twin:
    """The same workload on two contexts: Triton fed views, torch fed contiguous copies."""

    def __init__(self, make):
        self.triton, self.torch = make("triton"), make("torch")
        self.calls = 0
        # The request object of the chunked prefill in progress, one per context.
        self.chunked: dict[str, object] = {}

    def both(self, method: str, *args, views: dict | None = None, **kwargs):
        """Call ``method`` on both contexts; on the Triton one, positional tensor args and the
        keyword args named in ``views`` are replaced by views of the kinds given."""
        views = views or {}
        torch_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        torch_kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in kwargs.items()}
        triton_args = [as_view(a, views[i]) if i in views else
                       (a.clone() if isinstance(a, torch.Tensor) else a)
                       for i, a in enumerate(args)]
        triton_kwargs = {k: as_view(v, views[k]) if k in views else
                         (v.clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in kwargs.items()}
        self.calls += 1
        got = getattr(self.triton, method)(*triton_args, **triton_kwargs)
        want = getattr(self.torch, method)(*torch_args, **torch_kwargs)
        return got, want, triton_args, torch_args

    def kind(self, offset: int = 0) -> str:
        return KINDS[(self.calls + offset) % len(KINDS)]


def _attention_layers(twin: Twin, gen: torch.Generator, step: int) -> None:
    """One layer ropes (the three rope entry points in turn, one per step: the interpreter
    runs rope slowly), both layers append K/V; every tensor argument is a view."""
    ctx = twin.torch
    n = ctx.padded_active_token_count

    def qkv():
        return [torch.randn(n, 1, heads, DIM, generator=gen).to(DEVICE)
                for heads in (3, HEADS, HEADS)]

    rope_layer, plain_layer = (1, 2) if step % 2 else (2, 1)
    query, key, value = qkv()
    variant = step % 3
    if variant == 0:
        got_q, want_q, _, _ = twin.both("apply_rotary_emb_query", query, FREQS, None,
                                        views={0: twin.kind(), 1: twin.kind(1)})
        got_k, want_k, _, _ = twin.both("apply_rotary_emb_key", key, FREQS, None,
                                        views={0: twin.kind(1), 1: twin.kind(2)})
        got, want = (got_q, got_k), (want_q, want_k)
    elif variant == 1:
        got, want, _, _ = twin.both("apply_rotary_emb_and_append_key_value_cache", rope_layer,
                                    query, key, value, rotary_pos_emb=FREQS,
                                    views={1: twin.kind(), 2: twin.kind(1), 3: twin.kind(2),
                                           "rotary_pos_emb": twin.kind()})
    else:
        got, want, _, _ = twin.both("apply_fused_qk_rotary_emb", query, key, COS_SIN, None,
                                    views={0: twin.kind(), 1: twin.kind(1), 2: twin.kind(2)})
    for name, g, w in zip(("query", "key"), got, want):
        assert_rope_close(g[:n], w[:n], 1.0, f"step {step}: rotated {name}")
    if variant != 1:
        # The rotated key, as each context left it, goes into its cache.
        twin.triton.append_key_value_cache(rope_layer, as_view(got[1], twin.kind()),
                                           as_view(value, twin.kind(1)))
        twin.torch.append_key_value_cache(rope_layer, want[1].clone(), value.clone())
        twin.calls += 1
    _, key, value = qkv()
    twin.both("append_key_value_cache", plain_layer, key, value,
              views={1: twin.kind(), 2: twin.kind(1)})
    # The slots the step's real tokens wrote (padding tokens share the dummy block's slot 0,
    # which holds any one of their rows; the rest of the cache was never written).
    real = ctx.active_token_count
    blocks = ctx.token_to_block_idx[:real]
    slots = ctx.token_to_local_position_within_kv_block[:real]
    for layer in (1, 2):
        (k_got, v_got), (k_want, v_want) = (twin.triton.key_value_cache(layer),
                                            twin.torch.key_value_cache(layer))
        assert_rope_close(k_got[blocks, slots], k_want[blocks, slots], 1.0,
                          f"step {step}: K cache of layer {layer}")
        exact(f"step {step}: V cache of layer {layer}", v_got[blocks, slots],
              v_want[blocks, slots])


def _logits_and_update(twin: Twin, gen: torch.Generator, step: int, finish: set) -> None:
    ctx = twin.torch
    n, A = ctx.padded_active_token_count, ctx.get_active_request_count()
    logits = (torch.randn(1, n, VOCAB, generator=gen) * 3).to(DEVICE)
    got, want, _, _ = twin.both("last_token_logits", logits, views={0: twin.kind()})
    exact(f"step {step}: last_token_logits", got, want)

    sampled = torch.randint(0, VOCAB, (A, 2), generator=gen).to(DEVICE)
    triton_tokens = sampled[:, 0]  # the strided column the issue reports
    assert triton_tokens.stride() == (2,)
    for only_last in (False, True):
        got = twin.triton.calculate_log_probs(as_view(logits, twin.kind()), triton_tokens,
                                              only_last_token_logits=only_last)
        want = twin.torch.calculate_log_probs(logits.clone(), triton_tokens.contiguous(),
                                              only_last_token_logits=only_last)
        twin.calls += 1
        assert [len(r) for r in got[0]] == [len(r) for r in want[0]]
        torch.testing.assert_close(torch.tensor(sum(got[0], [])), torch.tensor(sum(want[0], [])),
                                   **LOG_SOFTMAX_TOLERANCE)
        torch.testing.assert_close(got[1], want[1], **LOG_SOFTMAX_TOLERANCE)

    ids = ctx.host_request_ids()[ctx.paused_request_count:ctx.total_request_count]
    mask = torch.tensor([int(i) not in finish for i in ids], dtype=torch.bool, device=DEVICE)
    got = twin.triton.update_requests(as_view(mask, twin.kind()), triton_tokens)
    want = twin.torch.update_requests(mask.clone(), triton_tokens.contiguous())
    twin.calls += 1
    exact(f"step {step}: newly paused ids", got, want)
    exact(f"step {step}: evicted ids", twin.triton.evicted_request_ids,
          twin.torch.evicted_request_ids)
    compare(f"step {step}: after update_requests", observable_state(twin.triton),
            observable_state(twin.torch))


def _add(twin: Twin, rid: int, length: int, gen: int, chunk: int | None = None) -> None:
    for name, ctx in (("triton", twin.triton), ("torch", twin.torch)):
        req = request(rid, length, gen)
        add(ctx, req, chunk)
        if chunk is not None:
            ctx.chunked_prefill_request_id = rid
            twin.chunked[name] = req
    twin.calls += 1


def _continue_chunk(twin: Twin, chunk: int) -> None:
    for name, ctx in (("triton", twin.triton), ("torch", twin.torch)):
        req = twin.chunked[name]
        if chunk == req.remaining_prompt_length:
            ctx.chunked_prefill_request_id = -1
        add(ctx, req, chunk)


def test_context_workload_triton_views_match_torch():
    """Chunked prefill, decode, pauses under memory pressure, resumes and finishes: every output
    and the observable state agree after every call."""
    twin = Twin(lambda backend: make_ctx(kernel_backend=backend, device=str(DEVICE),
                                         buffer_size_gb=11 * BLOCK / GIB,
                                         paused_buffer_size_gb=4 * BLOCK / GIB))
    gen = torch.Generator().manual_seed(0)
    _add(twin, 1, 3, 12)
    _add(twin, 2, 10, 12, chunk=6)
    paused_seen = resumed_seen = 0
    # step -> (requests to add, chunk continuation, request ids finishing)
    # Step 1 pauses request 1 and step 3 request 2 (their next block is not there); finishing
    # 3 and 4 then frees enough blocks for both to resume at step 5.
    plan = {1: ([(3, 5, 9)], 4, set()), 3: ([(4, 7, 3)], None, set()),
            4: ([], None, {3}), 5: ([], None, {4})}
    for step in range(7):
        adds, chunk, finish = plan.get(step, ([], None, set()))
        if chunk is not None:
            _continue_chunk(twin, chunk)
        for rid, length, gen_tokens in adds:
            _add(twin, rid, length, gen_tokens)
        if twin.torch.get_active_request_count() == 0:
            break
        for ctx in (twin.triton, twin.torch):
            ctx.initialize_attention_state()
        compare(f"step {step}: initialize_attention_state", step_state(twin.triton),
                step_state(twin.torch))
        compare(f"step {step}: before the forward", observable_state(twin.triton),
                observable_state(twin.torch))
        paused_before = twin.torch.paused_request_count
        _attention_layers(twin, gen, step)
        _logits_and_update(twin, gen, step, finish)
        paused_seen = max(paused_seen, twin.torch.paused_request_count)
        resumed_seen += twin.torch.paused_request_count < paused_before
    assert paused_seen, "the workload never paused a request: it tests less than it claims"
    assert resumed_seen, "no paused request ever resumed"


LAYERS = ("M", "*")
CONV, SSM = (6, 4), (2, 3, 5)


def _make_hybrid(backend: str) -> DynamicInferenceContext:
    block_bytes = 4 * 2 * 1 * 4 * 2 * 8
    mamba_bytes = 4 * (24 + 30)
    return built(lambda: DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
        max_sequence_length=64, buffer_size_gb=20 * (block_bytes + mamba_bytes) / GIB,
        paused_buffer_size_gb=4 * (block_bytes + mamba_bytes) / GIB, block_size_tokens=4,
        max_tokens=32, max_requests=8, unified_memory_level=0, device=DEVICE,
        kernel_backend=backend,
        mamba_inference_state_config=MambaInferenceStateConfig(LAYERS, CONV, SSM)))


def test_hybrid_mamba_states_at_strided_slots_match_torch():
    """gather/scatter_mamba_states with slot ids as a strided column and states as views:
    the Mamba state cache agrees bit for bit, and no slot outside the given ones changes."""
    twin = Twin(_make_hybrid)
    gen = torch.Generator().manual_seed(1)
    for rid, length in ((1, 3), (2, 5), (3, 2)):
        _add(twin, rid, length, 4)
    for step in range(3):
        for ctx in (twin.triton, twin.torch):
            ctx.initialize_attention_state()
        compare(f"step {step}: hybrid step", step_state(twin.triton), step_state(twin.torch))
        A = twin.torch.get_active_request_count()
        slots = twin.torch.mamba_metadata.request_to_mamba_state_idx[
            twin.torch.paused_request_count:twin.torch.total_request_count]
        exact("mamba slots", twin.triton.mamba_metadata.request_to_mamba_state_idx,
              twin.torch.mamba_metadata.request_to_mamba_state_idx)
        # Slot ids as the first column of a [A, 2] table, and one padding slot (-1) appended.
        table = torch.stack([torch.cat([slots, slots.new_tensor([-1])]),
                             torch.full((A + 1,), 99, dtype=slots.dtype, device=DEVICE)], dim=1)
        strided_slots = table[:, 0]
        conv = torch.randn(A + 1, *CONV, generator=gen).to(DEVICE)
        ssm = torch.randn(A + 1, *SSM, generator=gen).to(DEVICE)
        before = [t.clone().view(torch.int32) for t in twin.triton.mamba_states_cache(1)]
        twin.triton.scatter_mamba_states(1, strided_slots, as_view(conv, twin.kind()),
                                         as_view(ssm, twin.kind(1)))
        twin.torch.scatter_mamba_states(1, strided_slots.contiguous(), conv.clone(), ssm.clone())
        owned = slots.long()
        others = torch.ones(before[0].shape[0], dtype=torch.bool, device=DEVICE)
        others[owned] = False
        for got, want, old, name in zip(twin.triton.mamba_states_cache(1),
                                        twin.torch.mamba_states_cache(1), before, ("conv", "ssm")):
            exact(f"step {step}: {name} states after scatter", got[owned], want[owned])
            # Slots no request owns (never written: any bytes) keep their bytes.
            assert torch.equal(got.view(torch.int32)[others], old[others]), \
                f"step {step}: scatter wrote {name} states of a slot no request owns"
        got = twin.triton.gather_mamba_states(1, strided_slots)
        want = twin.torch.gather_mamba_states(1, strided_slots.contiguous())
        twin.calls += 1
        for g, w, name in zip(got, want, ("conv", "ssm")):
            exact(f"step {step}: gathered {name}", g, w)
        assert torch.equal(got[0][:A], conv[:A]) and torch.equal(got[1][:A], ssm[:A])
        n = twin.torch.padded_active_token_count
        key, value = (torch.randn(n, 1, HEADS, DIM, generator=gen).to(DEVICE) for _ in range(2))
        twin.both("append_key_value_cache", 2, key, value, views={1: twin.kind(), 2: twin.kind(1)})
        real = twin.torch.active_token_count
        blocks = twin.torch.token_to_block_idx[:real]
        slots = twin.torch.token_to_local_position_within_kv_block[:real]
        for got, want, name in zip(twin.triton.key_value_cache(2), twin.torch.key_value_cache(2),
                                   "KV"):
            exact(f"step {step}: {name} cache", got[blocks, slots], want[blocks, slots])
        sampled = torch.randint(0, VOCAB, (A, 2), generator=gen).to(DEVICE)
        mask = torch.ones(A, dtype=torch.bool, device=DEVICE)
        twin.triton.update_requests(mask, sampled[:, 0])
        twin.torch.update_requests(mask.clone(), sampled[:, 0].contiguous())
        compare(f"step {step}: hybrid update", observable_state(twin.triton),
                observable_state(twin.torch))


def test_mla_latent_cache_and_rope_from_views_match_torch():
    """MLA: the latent append (``append_key_value_cache`` with the concatenated latent) and the
    MLA-layout rope of the rope key, from views, against torch on contiguous copies."""
    rank, rope_dim = 8, 4
    twin = Twin(lambda backend: make_ctx(kernel_backend=backend, device=str(DEVICE),
                                         cache_mla_latent=True, kv_lora_rank=rank,
                                         qk_pos_emb_head_dim=rope_dim))
    freqs, _ = make_rope_tables(128, rope_dim, False, device=DEVICE)
    mla = SimpleNamespace(rotary_interleaved=False, multi_latent_attention=True)
    gen = torch.Generator().manual_seed(2)
    for rid, length in ((1, 6), (2, 3)):
        _add(twin, rid, length, 4)
    for step in range(3):
        for ctx in (twin.triton, twin.torch):
            ctx.initialize_attention_state()
        compare(f"step {step}: MLA step", step_state(twin.triton), step_state(twin.torch))
        n, A = twin.torch.padded_active_token_count, twin.torch.get_active_request_count()
        k_rope = torch.randn(n, 1, 1, rope_dim, generator=gen).to(DEVICE)
        got, want, _, _ = twin.both("apply_rotary_emb_key", k_rope, freqs, mla,
                                    views={0: twin.kind(), 1: twin.kind(1)})
        assert_rope_close(got[:n], want[:n], 1.0, f"step {step}: MLA rope key")
        latent = torch.cat([torch.randn(n, 1, rank, generator=gen).to(DEVICE),
                            want[:, :, 0].clone()], dim=-1)
        twin.both("append_key_value_cache", 1, latent, None, views={1: twin.kind()})
        real = twin.torch.active_token_count
        blocks = twin.torch.token_to_block_idx[:real]
        slots = twin.torch.token_to_local_position_within_kv_block[:real]
        exact(f"step {step}: latent cache", twin.triton.key_value_cache(1)[0][blocks, slots],
              twin.torch.key_value_cache(1)[0][blocks, slots])
        sampled = torch.randint(0, VOCAB, (A, 2), generator=gen).to(DEVICE)
        mask = torch.ones(A, dtype=torch.bool, device=DEVICE)
        twin.triton.update_requests(mask, sampled[:, 0])
        twin.torch.update_requests(mask.clone(), sampled[:, 0].contiguous())
        compare(f"step {step}: MLA update", observable_state(twin.triton),
                observable_state(twin.torch))
