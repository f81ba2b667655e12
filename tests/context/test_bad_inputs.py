"""Bad inputs to the context, as one table: each case names the state it starts from, the call,
the error type, and a pattern the message must match (naming the argument). After the error the
observable state (host rows, allocator, device mirrors, token arrays, attention metadata, the KV
buffer's bytes) is exactly what it was.

Checks whose data is on the host cost nothing and are always on. Checks that would need a
device readback on the decode path (NaN/inf logits, sampled token ids outside the vocabulary)
belong under the context's ``validate`` option, which these tests switch on where the
constructor offers it; token ids are checked against ``vocab_size`` where the constructor
offers that.

A case's ``gap`` note records what the context did before it raised as the table says (the
gaps this table found and that were then fixed); every case runs as a plain test.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from helpers import add, assert_same, make_ctx, snapshot

from dynctx.context import (
    DynamicInferenceContext,
    DynamicInferenceRequest,
    MaxSequenceLengthOverflowError,
    SamplingParams,
    TensorStateDeallocatedError,
    TokenOverflowError,
)

VOCAB = 50                      # the vocabulary of these tests: logits are [.., VOCAB]
NAN, INF = float("nan"), float("inf")
_CTOR = inspect.signature(DynamicInferenceContext.__init__).parameters


def new_ctx(**overrides) -> DynamicInferenceContext:
    """``make_ctx`` (2 layers, 2 heads of 8, block 4, 64 tokens, 8 requests) with the
    validation options on where the constructor offers them."""
    if "validate" in _CTOR:
        overrides.setdefault("validate", True)
    if "vocab_size" in _CTOR:
        overrides.setdefault("vocab_size", VOCAB)
    return make_ctx(**overrides)


def req(rid: int, length: int = 3, gen: int = 8, tokens=None,
        **sampling) -> DynamicInferenceRequest:
    """A request whose prompt token ids lie inside the vocabulary."""
    if tokens is None:
        tokens = torch.tensor([(rid * 7 + i) % VOCAB for i in range(length)])
    return DynamicInferenceRequest(
        request_id=rid, prompt_tokens=tokens,
        sampling_params=SamplingParams(num_tokens_to_generate=gen, **sampling))


def with_tokens(tokens) -> DynamicInferenceRequest:
    """Request 9 whose remaining prompt is ``tokens`` as given (bypassing the request's own
    checks, so that the context's checks are what is tested)."""
    r = req(9)
    r.remaining_prompt_tokens = tokens
    return r


def with_params(params) -> DynamicInferenceRequest:
    """Request 9 whose ``sampling_params`` is ``params`` as given."""
    r = req(9)
    r.sampling_params = params
    return r


def state_prefill(**overrides):
    """Requests 1 (3 tokens) and 2 (5 tokens) added; the step's metadata built."""
    ctx = new_ctx(**overrides)
    add(ctx, req(1, 3))
    add(ctx, req(2, 5))
    ctx.initialize_attention_state()
    return ctx


def state_decode():
    """After one step: a decode-only step of requests 1 and 2 (metadata built)."""
    ctx = state_prefill()
    ctx.update_requests(torch.tensor([True, True]), torch.tensor([4, 5]))
    ctx.initialize_attention_state()
    return ctx


def state_between():
    """After ``update_requests`` and before the next ``initialize_attention_state``."""
    ctx = state_prefill()
    n = ctx.padded_active_token_count
    kv = torch.arange(n * 16, dtype=torch.float32).reshape(n, 1, 2, 8)
    for layer in (1, 2):
        ctx.append_key_value_cache(layer, kv, kv)
    ctx.update_requests(torch.tensor([True, True]), torch.tensor([4, 5]))
    return ctx


def state_chunked():
    """Request 3's first chunk (8 of 20 tokens) is in; the chunked id is set (no step yet)."""
    ctx = new_ctx()
    add(ctx, req(1, 3))
    r = req(3, 20)
    add(ctx, r, chunk_length=8)
    ctx.chunked_prefill_request_id = 3
    return ctx


def state_mla():
    ctx = new_ctx(cache_mla_latent=True, kv_lora_rank=8, qk_pos_emb_head_dim=4)
    add(ctx, req(1, 3))
    add(ctx, req(2, 5))
    ctx.initialize_attention_state()
    return ctx


def state_deallocated():
    ctx = state_prefill()
    ctx.deallocate_all_tensors()
    return ctx


STATES = {"prefill": state_prefill, "decode": state_decode, "between": state_between,
          "chunked": state_chunked, "mla": state_mla, "deallocated": state_deallocated}


def n_of(ctx) -> int:
    return ctx.padded_active_token_count


def kv(ctx, n=None, heads=2, dim=8, dtype=torch.float32, device="cpu", mid=1):
    n = n_of(ctx) if n is None else n
    shape = (n, heads, dim) if mid is None else (n, mid, heads, dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def logits(ctx, rows=None, vocab=VOCAB, dtype=torch.float32, device="cpu", poison=None):
    """``[1, rows, vocab]`` logits; ``poison`` goes into the first request's last-token row."""
    rows = n_of(ctx) if rows is None else rows
    out = torch.randn(1, rows, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    if poison is not None:
        out[0, ctx.cu_query_lengths()[0][1].item() - 1, 3] = poison
    return out.to(device)


def tokens(*values, dtype=torch.int64, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


def emb(positions=64, rot=8, device="cpu"):
    return torch.zeros(positions, 1, 1, rot, device=device)




def case(id, state, call, error, match, gap=None):
    """One bad input; ``gap`` records what the context did before it raised (history)."""
    return pytest.param(state, call, error, match, id=id)


CASES = [
    # ---------------------------------------------------------------- add_request: lengths
    case("add/chunk_length=0", "prefill", lambda c: c.add_request(req(9, 4), 0),
         ValueError, "chunk_length"),
    case("add/chunk_length=-1", "prefill", lambda c: c.add_request(req(9, 4), -1),
         ValueError, "chunk_length"),
    case("add/chunk_length-huge", "prefill", lambda c: c.add_request(req(9, 4), 10 ** 12),
         ValueError, "chunk_length"),
    case("add/chunk_length-float", "prefill", lambda c: c.add_request(req(9, 4), 2.0),
         ValueError, "chunk_length"),
    case("add/chunk_length-bool", "prefill", lambda c: c.add_request(req(9, 4), True),
         ValueError, "chunk_length"),
    case("add/num_tokens_to_generate=-1", "prefill", lambda c: c.add_request(req(9, 4, gen=-1)),
         ValueError, "num_tokens_to_generate"),
    case("add/num_tokens_to_generate=None", "prefill",
         lambda c: c.add_request(req(9, 4, gen=None)), ValueError, "num_tokens_to_generate"),
    # A generation budget beyond max_sequence_length is accepted (as in Megatron-Core; the
    # engine refuses it at admission), but the output length must fit its int32 field.
    case("add/num_tokens_to_generate-huge", "prefill",
         lambda c: c.add_request(req(9, 4, gen=10 ** 12)), ValueError,
         "num_tokens_to_generate"),
    case("add/prompt-longer-than-max_sequence_length", "prefill",
         lambda c: c.add_request(req(9, 65, gen=0)), MaxSequenceLengthOverflowError,
         "max_sequence_length"),
    case("add/prompt-longer-than-max_tokens", "prefill",
         lambda c: c.add_request(req(9, 60, gen=1)), TokenOverflowError, "max_tokens"),
    case("add/prompt-empty", "prefill",
         lambda c: c.add_request(with_tokens(torch.tensor([], dtype=torch.int64))),
         ValueError, "prompt"),
    # ---------------------------------------------------------------- add_request: prompt tokens
    case("add/prompt-float-dtype", "prefill",
         lambda c: c.add_request(with_tokens(torch.tensor([1.0, 2.0]))), TypeError, "prompt"),
    case("add/prompt-2d", "prefill",
         lambda c: c.add_request(with_tokens(torch.tensor([[1, 2]]))), ValueError, "prompt"),
    case("add/prompt-on-meta", "prefill",
         lambda c: c.add_request(with_tokens(torch.tensor([1, 2], device="meta"))),
         ValueError, "prompt"),
    case("add/prompt-token-negative", "prefill",
         lambda c: c.add_request(req(9, tokens=torch.tensor([3, -1]))), ValueError, "prompt"),
    case("add/prompt-token-outside-vocab", "prefill",
         lambda c: c.add_request(req(9, tokens=torch.tensor([3, VOCAB]))), ValueError,
         "(?i)prompt.*vocab"),
    # ---------------------------------------------------------------- add_request: the request
    case("add/not-a-request", "prefill", lambda c: c.add_request(42), TypeError, "req"),
    # An AttributeError on .num_tokens_to_generate before.
    case("add/sampling_params-None", "prefill", lambda c: c.add_request(with_params(None)),
         TypeError, r"request 9: sampling_params must be a SamplingParams, got NoneType"),
    case("add/sampling_params-dict", "prefill",
         lambda c: c.add_request(with_params({"num_tokens_to_generate": 4})), TypeError,
         r"sampling_params must be a SamplingParams, got dict"),
    case("add/duplicate-id", "prefill", lambda c: c.add_request(req(1)), ValueError,
         "request_id=1"),
    case("add/request_id=-1", "prefill", lambda c: c.add_request(req(-1)), ValueError,
         "request_id", gap="request_id -1 is accepted although -1 marks free rows and 'no "
         "chunked prefill' (chunked_prefill_request_id); negative ids should be rejected"),
    case("add/request_id-beyond-int32", "prefill", lambda c: c.add_request(req(2 ** 40)),
         ValueError, "request_id", gap="raises numpy's OverflowError AFTER allocating the "
         "blocks: one block leaks and the row is half written"),
    case("add/request_id-str", "prefill",
         lambda c: c.add_request(req("a", tokens=torch.tensor([1, 2]))), TypeError,
         "request_id", gap="raises numpy's ValueError AFTER allocating the blocks (leak)"),
    case("add/request_id-float", "prefill",
         lambda c: c.add_request(req(3.5, tokens=torch.tensor([1, 2]))), TypeError,
         "request_id", gap="accepted: the int32 row says 3 while the live-id set holds 3.5"),
    case("add/top_k-beyond-int32", "prefill", lambda c: c.add_request(req(9, top_k=2 ** 40)),
         ValueError, "top_k", gap="raises numpy's OverflowError AFTER allocating the blocks "
         "(leak); metadata values must be checked against their dtypes before reserving"),
    case("add/termination_id-beyond-int64", "prefill",
         lambda c: c.add_request(req(9, termination_id=2 ** 70)), ValueError, "termination_id",
         gap="raises OverflowError AFTER allocating the blocks (leak)"),
    case("add/temperature-nan", "prefill",
         lambda c: c.add_request(req(9, temperature=NAN)), ValueError, "temperature",
         gap="SamplingParams accepts temperature=nan (nan < 0 is False) and so does add_request"),
    case("add/top_n_logprobs-negative", "prefill",
         lambda c: c.add_request(req(9, top_n_logprobs=-1)), ValueError, "top_n_logprobs",
         gap="top_n_logprobs=-1 is accepted by SamplingParams and add_request"),
    case("add/continuation-without-chunked-id", "prefill",
         lambda c: c.add_request(_continued(req(9, 12), 4), 4), ValueError, "continuation"),
    case("add/new-request-while-chunked-pending", "chunked", lambda c: c.add_request(req(9)),
         ValueError, "chunked"),
    # ---------------------------------------------------------------- update_requests
    case("update/mask-wrong-length", "prefill",
         lambda c: c.update_requests(tokens(1, 1, 1, dtype=torch.bool), tokens(4, 5)),
         ValueError, "active_requests_mask"),
    # Float masks of exactly 0 and 1 are accepted (Megatron-Core's tests pass them).
    case("update/mask-float-fraction", "prefill",
         lambda c: c.update_requests(tokens(1.0, 0.5, dtype=torch.float32), tokens(4, 5)),
         ValueError, r"active_requests_mask.*\[0\.5\]"),
    case("update/mask-value-2", "prefill",
         lambda c: c.update_requests(tokens(1, 2), tokens(4, 5)), ValueError,
         "active_requests_mask"),
    case("update/mask-value-negative", "prefill",
         lambda c: c.update_requests(tokens(1, -1), tokens(4, 5)), ValueError,
         "active_requests_mask"),
    case("update/mask-2d", "prefill",
         lambda c: c.update_requests(torch.ones(1, 2, dtype=torch.bool), tokens(4, 5)),
         ValueError, "active_requests_mask"),
    case("update/mask-on-meta", "prefill",
         lambda c: c.update_requests(tokens(1, 1, dtype=torch.bool, device="meta"), tokens(4, 5)),
         ValueError, "active_requests_mask"),
    case("update/mask-list", "prefill", lambda c: c.update_requests([1, 1], tokens(4, 5)),
         TypeError, "active_requests_mask"),
    case("update/new_tokens-wrong-length", "prefill",
         lambda c: c.update_requests(tokens(1, 1), tokens(4)), ValueError, "new_tokens"),
    case("update/new_tokens-float", "prefill",
         lambda c: c.update_requests(tokens(1, 1), tokens(4.0, 5.0, dtype=torch.float32)),
         TypeError, "new_tokens"),
    case("update/new_tokens-bool", "prefill",
         lambda c: c.update_requests(tokens(1, 1), tokens(1, 0, dtype=torch.bool)),
         TypeError, "new_tokens"),
    case("update/new_tokens-2d", "prefill",
         lambda c: c.update_requests(tokens(1, 1), torch.tensor([[4, 5]])), ValueError,
         "new_tokens"),
    case("update/new_tokens-on-meta", "prefill",
         lambda c: c.update_requests(tokens(1, 1), tokens(4, 5, device="meta")), ValueError,
         "new_tokens"),
    case("update/new_tokens-list", "prefill", lambda c: c.update_requests(tokens(1, 1), [4, 5]),
         TypeError, "new_tokens"),
    case("update/new_tokens-negative", "decode",
         lambda c: c.update_requests(tokens(1, 1), tokens(4, -1)), ValueError, "new_tokens"),
    case("update/new_tokens-outside-vocab", "decode",
         lambda c: c.update_requests(tokens(1, 1), tokens(4, VOCAB)), ValueError, "new_tokens"),
    # ---------------------------------------------------------------- append_key_value_cache
    case("append/layer_number=0", "prefill",
         lambda c: c.append_key_value_cache(0, kv(c), kv(c)), ValueError, "layer_number"),
    case("append/layer_number-too-big", "prefill",
         lambda c: c.append_key_value_cache(3, kv(c), kv(c)), ValueError, "layer_number"),
    case("append/layer_number=-1", "prefill",
         lambda c: c.append_key_value_cache(-1, kv(c), kv(c)), ValueError, "layer_number"),
    case("append/layer_number-float", "prefill",
         lambda c: c.append_key_value_cache(1.0, kv(c), kv(c)), ValueError, "layer_number"),
    case("append/key-fp16", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c, dtype=torch.float16), kv(c)), ValueError,
         "key"),
    case("append/value-fp16", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c), kv(c, dtype=torch.float16)), ValueError,
         "value"),
    case("append/key-on-meta", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c, device="meta"), kv(c)), ValueError, "key"),
    case("append/value-on-meta", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c), kv(c, device="meta")), ValueError,
         "value"),
    case("append/key-too-few-tokens", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c, n=7), kv(c, n=7)), ValueError, "key"),
    case("append/key-wrong-heads", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c, heads=3), kv(c, heads=3)), ValueError,
         "key"),
    case("append/value-wrong-head-dim", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c), kv(c, dim=4)), ValueError, "value"),
    case("append/key-dim1-not-1", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c, mid=2), kv(c, mid=2)), ValueError, "key"),
    case("append/key-list", "prefill",
         lambda c: c.append_key_value_cache(1, [[0.0]], kv(c)), TypeError, "key"),
    case("append/value-None", "prefill",
         lambda c: c.append_key_value_cache(1, kv(c), None), TypeError, "value"),
    case("append/outside-a-step", "between",
         lambda c: c.append_key_value_cache(1, kv(c), kv(c)), RuntimeError,
         "initialize_attention_state", gap="after update_requests (before the next "
         "initialize_attention_state) the append writes with the previous step's token "
         "arrays: it silently overwrites cached K/V of live requests; refuse it (host flag)"),
    case("append/mla-latent-fp16", "mla",
         lambda c: c.append_key_value_cache(1, torch.zeros(n_of(c), 1, 12).half(), None),
         ValueError, "key"),
    case("append/mla-latent-wrong-dim", "mla",
         lambda c: c.append_key_value_cache(1, torch.zeros(n_of(c), 1, 11), None), ValueError,
         "key", gap="the message names the kernel's kv_latent/k_rope split, not the argument "
         "'key' (the latent [n, 1, kv_lora_rank + qk_pos_emb_head_dim])"),
    case("append/mla-latent-4d", "mla",
         lambda c: c.append_key_value_cache(1, torch.zeros(n_of(c), 1, 2, 6), None), ValueError,
         "key", gap="the message names the kernel's kv_latent, not the argument 'key'"),
    case("key_value_cache/layer_number=0", "prefill", lambda c: c.key_value_cache(0),
         ValueError, "layer_number"),
    # ---------------------------------------------------------------- rotary embeddings
    case("rope/query-int", "prefill",
         lambda c: c.apply_rotary_emb_query(kv(c, dtype=torch.int64), emb(), None), ValueError,
         "query"),
    case("rope/query-too-few-tokens", "prefill",
         lambda c: c.apply_rotary_emb_query(kv(c, n=3), emb(), None), ValueError, "query"),
    case("rope/query-on-meta", "prefill",
         lambda c: c.apply_rotary_emb_query(kv(c, device="meta"), emb(), None), ValueError,
         "query", gap="the message says 'positions is on cpu, expected meta' (the kernel's "
         "view), not that the argument query is on the wrong device"),
    case("rope/query_emb-on-meta", "prefill",
         lambda c: c.apply_rotary_emb_query(kv(c), emb(device="meta"), None), ValueError,
         "query_emb", gap="the message names the kernel's 'freqs', not the argument query_emb"),
    case("rope/query_emb-shorter-than-positions", "prefill",
         lambda c: c.apply_rotary_emb_query(kv(c), emb(positions=2), None), ValueError,
         "query_emb", gap="IndexError from the torch reference (and an unchecked read on the "
         "GPU); the host knows the step's largest position, so the check is free"),
    case("rope/key-int", "prefill",
         lambda c: c.apply_rotary_emb_key(kv(c, dtype=torch.int64), emb(), None), ValueError,
         "key"),
    case("rope/key_emb-shorter-than-positions", "prefill",
         lambda c: c.apply_rotary_emb_key(kv(c), emb(positions=2), None), ValueError,
         "key_emb", gap="IndexError from the torch reference; free host check as for query_emb"),
    # ---------------------------------------------------------------- last_token_logits
    case("last_token_logits/rows+1", "prefill",
         lambda c: c.last_token_logits(logits(c, rows=n_of(c) + 1)), ValueError, "logits"),
    case("last_token_logits/int", "prefill",
         lambda c: c.last_token_logits(logits(c, dtype=torch.int64)), ValueError, "logits"),
    case("last_token_logits/on-meta", "prefill",
         lambda c: c.last_token_logits(logits(c, device="meta")), ValueError, "logits"),
    case("last_token_logits/batch-2", "prefill",
         lambda c: c.last_token_logits(logits(c).expand(2, -1, -1)), ValueError, "logits"),
    case("last_token_logits/1d", "prefill",
         lambda c: c.last_token_logits(torch.zeros(VOCAB)), ValueError, "logits"),
    case("last_token_logits/list", "prefill", lambda c: c.last_token_logits([[0.0]]), TypeError,
         "logits"),
    case("last_token_logits/outside-a-step", "between",
         lambda c: c.last_token_logits(logits(c)), RuntimeError, "initialize_attention_state"),
    case("last_token_logits/nan", "decode",
         lambda c: c.last_token_logits(logits(c, poison=NAN)), ValueError,
         "logits.*(?i:nan|finite)"),
    case("last_token_logits/inf", "decode",
         lambda c: c.last_token_logits(logits(c, poison=INF)), ValueError,
         "logits.*(?i:inf|finite)"),
    # ---------------------------------------------------------------- calculate_log_probs
    case("log_probs/new_tokens-wrong-length", "prefill",
         lambda c: c.calculate_log_probs(logits(c), tokens(1, 2, 3)), ValueError, "new_tokens"),
    case("log_probs/new_tokens-float", "prefill",
         lambda c: c.calculate_log_probs(logits(c), tokens(1.0, 2.0, dtype=torch.float32)),
         TypeError, "new_tokens"),
    case("log_probs/new_tokens-on-meta", "prefill",
         lambda c: c.calculate_log_probs(logits(c), tokens(1, 2, device="meta")), ValueError,
         "new_tokens"),
    case("log_probs/new_tokens-list", "prefill",
         lambda c: c.calculate_log_probs(logits(c), [1, 2]), TypeError, "new_tokens"),
    case("log_probs/logits-fewer-rows", "prefill",
         lambda c: c.calculate_log_probs(logits(c, rows=4), tokens(1, 2)), ValueError, "logits"),
    case("log_probs/logits-int", "decode",
         lambda c: c.calculate_log_probs(logits(c, dtype=torch.int64), tokens(1, 2)),
         ValueError, "logits"),
    case("log_probs/logits-on-meta", "decode",
         lambda c: c.calculate_log_probs(logits(c, device="meta"), tokens(1, 2)), ValueError,
         "logits"),
    case("log_probs/new_tokens-outside-vocab", "decode",
         lambda c: c.calculate_log_probs(logits(c), tokens(1, VOCAB)), ValueError, "new_tokens"),
    case("log_probs/new_tokens-negative", "decode",
         lambda c: c.calculate_log_probs(logits(c), tokens(1, -1)), ValueError, "new_tokens"),
    case("log_probs/prompt-tokens-outside-logits-vocab", "prefill",
         lambda c: c.calculate_log_probs(logits(c, vocab=8), tokens(1, 2)), ValueError,
         "(?i)vocab"),
    case("log_probs/nan", "decode",
         lambda c: c.calculate_log_probs(logits(c, poison=NAN), tokens(1, 2)), ValueError,
         "logits.*(?i:nan|finite)"),
    case("log_probs/inf", "decode",
         lambda c: c.calculate_log_probs(logits(c, poison=INF), tokens(1, 2)), ValueError,
         "logits.*(?i:inf|finite)"),
    # ---------------------------------------------------------------- step queries
    case("current_input_and_position_ids/negative", "prefill",
         lambda c: c.current_input_and_position_ids(num_warmup_tokens=-1), ValueError,
         "num_warmup_tokens"),
    case("current_input_and_position_ids/huge", "prefill",
         lambda c: c.current_input_and_position_ids(num_warmup_tokens=10 ** 9), ValueError,
         "num_warmup_tokens"),
    case("cu_query_lengths/outside-a-step", "between", lambda c: c.cu_query_lengths(),
         RuntimeError, "initialize_attention_state"),
]

# ---------------------------------------------------------------- calls while deallocated
_DEALLOCATED = {
    "add_request": lambda c: c.add_request(req(9)),
    "check_availability": lambda c: c.check_availability(req(9)),
    "initialize_attention_state": lambda c: c.initialize_attention_state(),
    "update_requests": lambda c: c.update_requests(tokens(1, 1), tokens(4, 5)),
    "append_key_value_cache": lambda c: c.append_key_value_cache(1, kv(c, n=64), kv(c, n=64)),
    "key_value_cache": lambda c: c.key_value_cache(1),
    "last_token_logits": lambda c: c.last_token_logits(torch.zeros(1, 64, VOCAB)),
    "calculate_log_probs": lambda c: c.calculate_log_probs(torch.zeros(1, 64, VOCAB),
                                                           tokens(1, 2)),
    "current_input_and_position_ids": lambda c: c.current_input_and_position_ids(),
    "reset": lambda c: c.reset(),
    "get_kvcache_utilization_stats": lambda c: c.get_kvcache_utilization_stats(),
    "get_active_sequence_lengths": lambda c: c.get_active_sequence_lengths(),
    "get_max_sequence_lengths": lambda c: c.get_max_sequence_lengths(),
    "request_ids": lambda c: c.request_ids,
    "request_to_kv_block_ids": lambda c: c.request_to_kv_block_ids,
    "request_metadata": lambda c: c.request_metadata,
}
_DEALLOCATED_GAPS = {
    "cu_query_lengths": (lambda c: c.cu_query_lengths(), "raises RuntimeError 'valid only "
                         "between initialize_attention_state() ...' instead"),
    "cu_kv_lengths": (lambda c: c.cu_kv_lengths(), "raises RuntimeError (attention state)"),
    "apply_rotary_emb_query": (lambda c: c.apply_rotary_emb_query(kv(c, n=64), emb(), None),
                               "TypeError: 'NoneType' object is not subscriptable"),
    "apply_rotary_emb_key": (lambda c: c.apply_rotary_emb_key(kv(c, n=64), emb(), None),
                             "TypeError: 'NoneType' object is not subscriptable"),
    "apply_fused_qk_rotary_emb": (
        lambda c: c.apply_fused_qk_rotary_emb(kv(c, n=64), kv(c, n=64), torch.zeros(64, 8), None),
        "TypeError: 'NoneType' object is not subscriptable"),
    "host_request_ids": (lambda c: c.host_request_ids(), "TypeError on None"),
    "kv_block_counts_host": (lambda c: c.kv_block_counts_host, "TypeError on None"),
    "block_table_host": (lambda c: c.block_table_host, "returns None"),
}
CASES += [case(f"deallocated/{name}", "deallocated", call, TensorStateDeallocatedError,
               "deallocated") for name, call in _DEALLOCATED.items()]
CASES += [case(f"deallocated/{name}", "deallocated", call, TensorStateDeallocatedError,
               "deallocated", gap=f"while deallocated: {what}")
          for name, (call, what) in _DEALLOCATED_GAPS.items()]


def _continued(r: DynamicInferenceRequest, done: int) -> DynamicInferenceRequest:
    """``r`` as if its first ``done`` prompt tokens had been added as a chunk."""
    r.remaining_prompt_tokens = r.remaining_prompt_tokens[done:]
    r.finished_chunk_token_count = done
    return r


@pytest.mark.parametrize("state,call,error,match", CASES)
def test_bad_input_raises_and_leaves_the_state(state, call, error, match):
    ctx = STATES[state]()
    device = ctx.is_tensor_state_allocated
    before = snapshot(ctx, device=device)
    with pytest.raises(error, match=match):
        call(ctx)
    assert_same(before, snapshot(ctx, device=device))


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(max_sequence_length=0), "max_sequence_length", id="max_sequence_length=0"),
    pytest.param(dict(max_sequence_length=-8), "max_sequence_length", id="max_sequence_length<0"),
    pytest.param(dict(block_size_tokens=0), "block_size_tokens", id="block_size_tokens=0"),
    pytest.param(dict(block_size_tokens=2.5), "block_size_tokens", id="block_size_tokens-float"),
    pytest.param(dict(max_requests=-1), "max_requests", id="max_requests<0"),
    pytest.param(dict(max_tokens=-5), "max_tokens", id="max_tokens<0"),
    pytest.param(dict(kv_channels=0), "kv_channels", id="kv_channels=0"),
    pytest.param(dict(num_attention_heads=-2), "num_attention_heads", id="heads<0"),
    pytest.param(dict(buffer_size_gb=0), "buffer_size_gb", id="buffer_size_gb=0"),
    pytest.param(dict(buffer_size_gb=float("nan")), "buffer_size_gb", id="buffer_size_gb-nan",
                 ),
    pytest.param(dict(paused_buffer_size_gb=-1.0), "paused_buffer_size_gb", id="paused<0"),
    pytest.param(dict(cache_mla_latent=True, kv_lora_rank=0, qk_pos_emb_head_dim=4),
                 "kv_lora_rank", id="kv_lora_rank=0"),
])
def test_bad_constructor_lengths(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_ctx(**kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    # True and 0.0 passed ``in (None, 0, 1)``.
    pytest.param(dict(unified_memory_level=True), ValueError,
                 r"unified_memory_level=True must be 0 or 1", id="unified_memory_level-bool"),
    pytest.param(dict(unified_memory_level=0.0), ValueError,
                 r"unified_memory_level=0.0 must be 0 or 1", id="unified_memory_level-float"),
    # The kernels' check named ``backend=``, not the constructor's argument.
    pytest.param(dict(kernel_backend="nope"), ValueError,
                 r"kernel_backend='nope' is not a kernel backend; expected one of "
                 r"\('auto', 'triton', 'torch'\)", id="kernel_backend-name"),
    pytest.param(dict(kernel_backend=3), ValueError, r"kernel_backend=3 is not a kernel backend",
                 id="kernel_backend-int"),
    # torch's own errors named neither the argument nor the value.
    pytest.param(dict(device="nope"), ValueError, r"device='nope' is not a torch device",
                 id="device-str"),
    pytest.param(dict(device=[0]), TypeError, r"device=\[0\] must be a torch.device, a str",
                 id="device-list"),
    # Entries of the wrong shape stopped at "not enough values to unpack"; an int at
    # "'int' object is not iterable".
    pytest.param(dict(request_metadata_types=[("temperature", torch.float32)]), TypeError,
                 r"request_metadata_types\[0\]=\('temperature', torch.float32\) must be a "
                 r"\(label, torch.dtype, on_device\) tuple", id="metadata-pair"),
    pytest.param(dict(request_metadata_types=3), TypeError,
                 r"request_metadata_types=3 must be a list", id="metadata-int"),
    pytest.param(dict(request_metadata_types=[("bogus", torch.float32, True)]), ValueError,
                 r"request_metadata_types\[0\]=.*the label must name a SamplingParams field",
                 id="metadata-label"),
    # An AttributeError on .layer_type_list.
    pytest.param(dict(mamba_inference_state_config="hybrid"), TypeError,
                 r"mamba_inference_state_config must be a MambaInferenceStateConfig or None, "
                 r"got str", id="mamba-config-str"),
    # Accepted; the first step's metrics update then failed on .log.
    pytest.param(dict(metrics_writer=3), TypeError,
                 r"metrics_writer=3 must be None or have a callable log\(dict\)",
                 id="metrics_writer"),
    # Accepted without CUDA graphs (the ladder returned before its checks).
    pytest.param(dict(cuda_graph_mixed_prefill_count="x"), TypeError,
                 r"cuda_graph_mixed_prefill_count='x' must be an int", id="mixed_prefill_count"),
    # True == 1 passed; 'no' was reported as True.
    pytest.param(dict(context_parallel_size=True), NotImplementedError,
                 r"context_parallel_size=True is not supported", id="context_parallel-bool"),
    pytest.param(dict(persist_cuda_graphs="no"), NotImplementedError,
                 r"persist_cuda_graphs='no': CUDA graphs are not supported", id="persist-str"),
])
def test_bad_constructor_options_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_ctx(**kwargs)


@pytest.mark.parametrize("flag", ["validate", "fused_rope_kv_append", "cache_mla_latent",
                                  "use_cuda_graphs_for_non_decode_steps",
                                  "materialize_only_last_token_logits",
                                  "use_flashinfer_fused_rope"])
def test_constructor_flags_are_bools(flag):
    """``"no"`` turned the flag on (a truthy str): validate's reads, the fused launch, MLA."""
    with pytest.raises(TypeError, match=f"{flag}='no' must be a bool"):
        make_ctx(**{flag: "no"})


def test_logits_without_vocabulary_columns_are_refused():
    """Without ``vocab_size`` to compare against, ``[1, n, 0]`` logits were accepted and gave
    ``[rows, 0]`` last-token logits, which no sampler can draw from."""
    ctx = make_ctx()
    add(ctx, req(1, 3))
    ctx.initialize_attention_state()
    before = snapshot(ctx, device=True)
    with pytest.raises(ValueError, match=r"logits has no vocabulary columns \(shape \(\d+, 0\)\)"):
        ctx.last_token_logits(torch.zeros(1, n_of(ctx), 0))
    assert_same(before, snapshot(ctx, device=True))


def test_the_table_runs_with_validate_and_vocab_size():
    """The read-back checks of the table need ``validate``, the id checks ``vocab_size``."""
    assert "validate" in _CTOR and "vocab_size" in _CTOR
    ctx = new_ctx()
    assert ctx.validate is True and ctx.vocab_size == VOCAB
    assert make_ctx().validate is False  # off by default: a decode step keeps its one sync


def test_numpy_integers_size_the_graph_ladder_as_ints():
    """``num_cuda_graphs=np.int64(2)`` was refused ("must be an int, got int64") where every
    other size takes numpy's integers; it now builds the ladder an int builds."""
    import numpy as np

    ladder = make_ctx(num_cuda_graphs=2).cuda_graph_batch_dimensions_list
    assert ladder and make_ctx(num_cuda_graphs=np.int64(2)).cuda_graph_batch_dimensions_list \
        == ladder
    with pytest.raises(TypeError, match=r"num_cuda_graphs=np.True_ must be an int"):
        make_ctx(num_cuda_graphs=np.bool_(True))


def test_valid_neighbours_of_the_bad_inputs_are_accepted():
    """The table's limits are tight: the closest valid inputs pass."""
    ctx = state_prefill()
    n = n_of(ctx)
    for layer in (1, 2):
        ctx.append_key_value_cache(layer, kv(ctx, mid=None), kv(ctx, mid=None))
        ctx.append_key_value_cache(layer, kv(ctx, n=n + 2), kv(ctx, n=n + 2))
    ctx.last_token_logits(logits(ctx))
    ctx.calculate_log_probs(logits(ctx), tokens(10, 11))
    ctx.current_input_and_position_ids(num_warmup_tokens=ctx.max_tokens)
    ctx.update_requests(tokens(1, 1), tokens(0, VOCAB - 1))
    room = ctx.max_tokens - ctx.active_token_count
    add(ctx, req(9, room + 1, gen=1), chunk_length=room)  # a chunk of exactly the room left
    assert ctx.active_token_count == ctx.max_tokens
    ctx2 = new_ctx()
    add(ctx2, req(5, 56, gen=8))  # prompt + gen == max_sequence_length
    assert math.ceil(56 / 4) == ctx2.kv_block_counts_host[0]
    # Without validate nothing reads back: -inf (masked tokens) and even NaN pass through.
    ctx3 = make_ctx()
    add(ctx3, req(1, 3))
    ctx3.initialize_attention_state()
    masked = logits(ctx3)
    masked[0, :, :5] = -INF
    assert torch.equal(ctx3.last_token_logits(masked), masked[0, [2]])
