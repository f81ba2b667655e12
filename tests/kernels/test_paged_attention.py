"""paged_attention: the Triton kernels (split-KV decode, varlen prefill) against the torch
reference.

Runs compiled on CUDA, or on a CPU under TRITON_INTERPRET=1 (set before pytest starts:
``TRITON_INTERPRET=1 python -m pytest -m interpreter tests/kernels/test_paged_attention.py``).
The interpreter has no bf16 arithmetic, so bf16 runs on CUDA only; fp32 and fp16 run on both.

Every case sets the traps of a paged cache: slots past a request's length (in its last block
and in unused blocks) hold NaN, unused block-table entries are -1, padding query rows are NaN,
and the output is poisoned with 0xFF bytes (a NaN) before the launch. Nothing of that may reach
a request's output, and padding rows of a caller's output keep their bytes.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_test_utils import DEVICE, assert_raises_naming, byte_view, check_tune_case

from dynctx.kernels import autotune
from dynctx.kernels.autotune import KernelConfig
from dynctx.kernels.paged_attention import paged_attention, paged_attention_ref
from dynctx.kernels.paged_attention_decode import (
    paged_attention_decode_configs,
    paged_attention_decode_default_config,
    paged_attention_decode_tune_key,
)
from dynctx.kernels.paged_attention_merge import (
    merge_attention_splits,
    merge_attention_splits_ref,
)
from dynctx.kernels.paged_attention_tile import ATTENTION_TOLERANCE, scaled_down_key
from dynctx.kernels.paged_attention_varlen import (
    paged_attention_varlen_configs,
    paged_attention_varlen_default_config,
    paged_attention_varlen_tune_key,
)

pytestmark = pytest.mark.interpreter

POISON = 0xFF
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16", marks=[
              pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="the interpreter has no bf16 arithmetic")])]


def make_case(q_lens, kv_lens, *, padded_requests, padded_tokens, block_size, heads, kv_heads,
              dim, dtype, seed=0):
    """A paged step: ``(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
    block_table)`` on DEVICE with every trap set (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    used_blocks = [math.ceil(k / block_size) for k in kv_lens]
    max_blocks = max(used_blocks, default=0) + 1
    num_blocks = sum(used_blocks) + 3
    key_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    block_table = torch.full((padded_requests, max_blocks), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for request, kv in enumerate(kv_lens):
        for b in range(used_blocks[request]):
            block = free.pop()
            block_table[request, b] = block
            used = min(block_size, kv - b * block_size)
            key_cache[block, :used] = torch.randn(used, kv_heads, dim, generator=gen)
            value_cache[block, :used] = torch.randn(used, kv_heads, dim, generator=gen)
    query = torch.full((padded_tokens, heads, dim), float("nan"))
    real = sum(q_lens)
    query[:real] = torch.randn(real, heads, dim, generator=gen)
    q = torch.zeros(padded_requests, dtype=torch.int32)
    kv = torch.zeros(padded_requests, dtype=torch.int32)
    q[:len(q_lens)] = torch.tensor(q_lens, dtype=torch.int32)
    kv[:len(kv_lens)] = torch.tensor(kv_lens, dtype=torch.int32)
    cu = torch.zeros(padded_requests + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q, 0)
    tensors = (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), cu, kv, block_table)
    return tuple(t.to(DEVICE) for t in tensors)


def poisoned_out(query):
    out = torch.empty_like(query)
    out.view(torch.uint8).fill_(POISON)
    return out


def check_against_reference(case, q_lens, kv_lens, *, config=None, num_requests=None,
                            num_decode_requests=0, window=0, sinks=None, reference_case=None,
                            out=None):
    """The kernels on ``case`` (into ``out``, poisoned, when given) against the reference on
    ``reference_case`` (default: ``case``)."""
    query, key_cache, value_cache, cu, kv, table = case
    out = poisoned_out(query) if out is None else out
    before = out.clone()
    got = paged_attention(query, key_cache, value_cache, cu, kv, table,
                          max_seqlen_q=max(q_lens, default=0), max_seqlen_k=max(kv_lens, default=0),
                          num_requests=num_requests, num_decode_requests=num_decode_requests,
                          window=window, sinks=sinks, out=out, config=config, backend="triton")
    assert got is out
    expected = paged_attention_ref(*(reference_case or case), num_requests=num_requests,
                                   window=window, sinks=sinks)
    real = int(cu[len(q_lens)])
    assert not got[:real].isnan().any(), "a trap (NaN) reached a request's output"
    torch.testing.assert_close(got[:real].float(), expected[:real].float(),
                               **ATTENTION_TOLERANCE[query.dtype])
    assert torch.equal(byte_view(got[real:]), byte_view(before[real:])), "padding rows written"


# (query lengths, kv lengths, padded requests, padded tokens), block size 16.
CASES = [
    # decode: a 1-token prompt, a full last block, a partial one; two padded requests
    pytest.param([1, 1, 1, 1], [1, 32, 45, 7], 6, 8, id="decode"),
    # decode with padded requests but no padding token: their first token is past the query
    pytest.param([1, 1], [17, 3], 4, 2, id="decode_tight"),
    # decode requests first, then a whole prompt, a chunk starting mid-sequence (mid-block),
    # a one-token prompt; padded requests and tokens after them
    pytest.param([1, 1, 20, 7, 1], [5, 40, 20, 26, 1], 7, 36, id="mixed"),
    # chunked prefill only: a chunk crossing a block boundary far into its sequence
    pytest.param([9], [50], 2, 12, id="chunk"),
]
HEADS = [pytest.param(4, 1, id="gqa4"), pytest.param(2, 2, id="mha")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", HEADS)
@pytest.mark.parametrize("q_lens, kv_lens, padded_requests, padded_tokens", CASES)
def test_matches_reference(q_lens, kv_lens, padded_requests, padded_tokens, heads, kv_heads,
                           dtype):
    case = make_case(q_lens, kv_lens, padded_requests=padded_requests,
                     padded_tokens=padded_tokens, block_size=16, heads=heads, kv_heads=kv_heads,
                     dim=8, dtype=dtype)
    check_against_reference(case, q_lens, kv_lens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_step_with_decode_requests_apart(dtype):
    # The two leading decode requests through the split-KV kernel, the rest through varlen.
    q_lens, kv_lens = [1, 1, 20, 7, 1], [5, 40, 20, 26, 1]
    case = make_case(q_lens, kv_lens, padded_requests=7, padded_tokens=36, block_size=16,
                     heads=4, kv_heads=1, dim=8, dtype=dtype, seed=5)
    check_against_reference(case, q_lens, kv_lens, num_decode_requests=2)


def test_head_dim_not_a_power_of_two_and_wide_groups():
    # head dim 40 (masked lanes up to 64), 6 query heads per KV head (masked up to 16)
    q_lens, kv_lens = [1, 5], [19, 5]
    case = make_case(q_lens, kv_lens, padded_requests=2, padded_tokens=6, block_size=8, heads=6,
                     kv_heads=1, dim=40, dtype=torch.float32)
    check_against_reference(case, q_lens, kv_lens)


def test_num_requests_limits_the_requests_attended():
    q_lens, kv_lens = [1, 1], [9, 12]
    case = make_case(q_lens, kv_lens, padded_requests=2, padded_tokens=2, block_size=16, heads=2,
                     kv_heads=1, dim=8, dtype=torch.float32)
    query = case[0]
    out = paged_attention(*case, max_seqlen_q=1, max_seqlen_k=12, num_requests=1,
                          backend="triton")
    torch.testing.assert_close(out[:1], paged_attention_ref(*case, num_requests=1)[:1])
    assert torch.equal(out[1:], torch.zeros_like(query[1:]))


def test_nothing_to_attend_returns_zeros():
    case = make_case([], [], padded_requests=2, padded_tokens=3, block_size=16, heads=2,
                     kv_heads=1, dim=8, dtype=torch.float32)
    out = paged_attention(*case, max_seqlen_q=0, max_seqlen_k=0, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("max_seqlen_q", [1, 2], ids=["decode", "varlen"])
def test_no_request_leaves_out_alone_on_every_call(max_seqlen_q):
    """``num_requests=0`` with positive lengths and tokens: nothing is attended, on the first
    call and on repeats of the same key (no plan of an empty step replays anything): ``out``
    comes back with its bytes, an allocated one as zeros."""
    q_lens, kv_lens = [1, 1], [4, 9]
    case = make_case(q_lens, kv_lens, padded_requests=2, padded_tokens=2, block_size=16,
                     heads=2, kv_heads=1, dim=8, dtype=torch.float32)
    for _ in range(3):
        out = poisoned_out(case[0])
        before = out.clone()
        got = paged_attention(*case, max_seqlen_q=max_seqlen_q, max_seqlen_k=9, num_requests=0,
                              out=out, backend="triton")
        assert got is out and torch.equal(byte_view(out), byte_view(before))
        got = paged_attention(*case, max_seqlen_q=max_seqlen_q, max_seqlen_k=9, num_requests=0,
                              backend="triton")
        assert torch.equal(got, torch.zeros_like(case[0]))


# Every config's meta-parameters (num_warps and num_stages cannot change a result under the
# interpreter, so it runs one config per meta-parameter set; CUDA runs every config). The
# decode case spans several splits of the small split sizes (the merge) and several tiles of
# every tile size; the varlen case has more queries than the largest BLOCK_M.
def _configs(configs, key):
    space = configs(key)
    if torch.cuda.is_available():
        return [pytest.param(c, id=str(c)) for c in space]
    seen, chosen = set(), []
    for config in space:
        if config.meta not in seen:
            seen.add(config.meta)
            chosen.append(pytest.param(config, id=str(config)))
    return chosen


DECODE_KEY = paged_attention_decode_tune_key(num_q_heads=4, num_kv_heads=2, head_dim=8,
                                             dtype=torch.float32, num_requests=2, max_seqlen_k=300)
VARLEN_KEY = paged_attention_varlen_tune_key(num_q_heads=4, num_kv_heads=2, head_dim=8,
                                             dtype=torch.float32, num_tokens=80)


@pytest.mark.parametrize("config", _configs(paged_attention_decode_configs, DECODE_KEY))
def test_every_decode_config(config):
    q_lens, kv_lens = [1, 1], [300, 70]
    case = make_case(q_lens, kv_lens, padded_requests=3, padded_tokens=3, block_size=64, heads=4,
                     kv_heads=1, dim=8, dtype=torch.float16, seed=3)
    check_against_reference(case, q_lens, kv_lens, config=config)


@pytest.mark.parametrize("config", _configs(paged_attention_varlen_configs, VARLEN_KEY))
def test_every_varlen_config(config):
    q_lens, kv_lens = [70, 1, 3], [140, 9, 3]
    case = make_case(q_lens, kv_lens, padded_requests=4, padded_tokens=76, block_size=32,
                     heads=2, kv_heads=1, dim=8, dtype=torch.float16, seed=4)
    check_against_reference(case, q_lens, kv_lens, config=config)


def test_default_configs_are_in_search_space():
    for requests in (1, 8, 256):
        for context in (1, 1000, 16384, 100000):
            for heads, kv_heads, dim in ((32, 8, 128), (8, 8, 256), (64, 1, 64)):
                key = paged_attention_decode_tune_key(
                    num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                    dtype=torch.bfloat16, num_requests=requests, max_seqlen_k=context)
                assert paged_attention_decode_default_config(key) in \
                    paged_attention_decode_configs(key)
                key = paged_attention_varlen_tune_key(num_q_heads=heads, num_kv_heads=kv_heads,
                                                      head_dim=dim, dtype=torch.float16,
                                                      num_tokens=requests * 3)
                assert paged_attention_varlen_default_config(key) in \
                    paged_attention_varlen_configs(key)
    assert paged_attention_decode_tune_key(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                           dtype=torch.bfloat16, num_requests=5,
                                           max_seqlen_k=3000) == {
        "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
        "num_requests": 8, "max_seqlen_k": 4096}


@pytest.mark.parametrize("name", ["paged_attention_decode", "paged_attention_varlen"])
def test_tune_cases_check_at_scaled_down_presets(name):
    tuning = autotune.get_tuning(name)
    keys = []
    for key in tuning.presets():
        small = scaled_down_key(key)
        assert tuning.configs(small) == tuning.configs(key)
        if small not in keys:
            keys.append(small)
    for small in keys:
        check_tune_case(tuning, small)


def test_custom_op_matches_reference():
    q_lens, kv_lens = [1, 4], [6, 4]
    case = make_case(q_lens, kv_lens, padded_requests=2, padded_tokens=5, block_size=16, heads=2,
                     kv_heads=1, dim=8, dtype=torch.float32)
    expected = paged_attention_ref(*case, softmax_scale=0.25)
    torch.testing.assert_close(torch.ops.dynctx.paged_attention(*case, 4, 6, 0.25, 2), expected)
    torch.testing.assert_close(torch.ops.dynctx.paged_attention(*case, 4, 6, 0.25, 2, 1), expected)


def _bad_calls():
    query, key_cache, value_cache, cu, kv, table = make_case(
        [1, 1], [3, 5], padded_requests=2, padded_tokens=2, block_size=4, heads=4, kv_heads=2,
        dim=8, dtype=torch.float32)

    def call(**changes):
        args = dict(query=query, key_cache=key_cache, value_cache=value_cache,
                    cu_query_lengths=cu, kv_seq_lengths=kv, block_table=table)
        kwargs = dict(max_seqlen_q=1, max_seqlen_k=5)
        for name, value in changes.items():
            (args if name in args else kwargs)[name] = value
        return lambda: paged_attention(*args.values(), **kwargs)

    return [
        pytest.param(call(query=query[0]), "query", id="query_2d"),
        pytest.param(call(query=query.long()), "query", id="query_int"),
        pytest.param(call(key_cache=key_cache.half()), "key_cache", id="cache_dtype"),
        pytest.param(call(value_cache=value_cache[:, :2]), "value_cache", id="cache_shape"),
        pytest.param(call(query=torch.zeros(2, 3, 8)), "num_q_heads", id="heads_not_multiple"),
        pytest.param(call(query=torch.zeros(2, 4, 4)), "head dim", id="head_dim_mismatch"),
        pytest.param(call(cu_query_lengths=cu.long()), "cu_query_lengths", id="cu_int64"),
        pytest.param(call(cu_query_lengths=cu[:2]), "cu_query_lengths", id="cu_short"),
        pytest.param(call(kv_seq_lengths=kv[:1], num_requests=2), "kv_seq_lengths",
                     id="kv_short"),
        pytest.param(call(block_table=table[0]), "block_table", id="table_1d"),
        pytest.param(call(max_seqlen_k=999), "max_seqlen_k", id="seqlen_over_table"),
        pytest.param(call(max_seqlen_q=-1), "max_seqlen_q", id="negative_seqlen_q"),
        pytest.param(call(num_requests=-1), "num_requests", id="negative_requests"),
        pytest.param(call(out=torch.zeros(3, 4, 8)), "out", id="out_shape"),
        pytest.param(call(num_decode_requests=3), "num_decode_requests", id="decode_over_requests"),
        pytest.param(call(max_seqlen_q=2, num_decode_requests=1,
                          config=paged_attention_varlen_default_config(VARLEN_KEY)), "config",
                     id="config_with_both_kernels"),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad_call, name", _bad_calls())
def test_bad_arguments_name_the_argument(bad_call, name, backend, monkeypatch):
    assert_raises_naming(bad_call, name, backend, monkeypatch)


@pytest.mark.parametrize("num_splits", [3, 257, 600])
def test_merge_of_many_splits_matches_the_reference(num_splits):
    """The merge walks the splits in chunks (256 at head dim 16): across a chunk boundary, with
    empty splits (lse -inf) inside chunks and a whole chunk of them, it matches the reference."""
    gen = torch.Generator().manual_seed(num_splits)
    requests, heads, dim = 2, 1, 16
    partial = torch.randn(requests, heads, num_splits, dim, generator=gen)
    lse = 3 * torch.randn(requests, heads, num_splits, generator=gen)
    lse[0, :, ::7] = float("-inf")
    lse[1, :, : min(num_splits - 1, 256)] = float("-inf")
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.full((3, heads, dim), float("nan"))
    merge_attention_splits(out.to(DEVICE), partial.to(DEVICE), lse.to(DEVICE), cu.to(DEVICE),
                           block_d=dim)
    expected = merge_attention_splits_ref(partial, lse)
    torch.testing.assert_close(out[:2].cpu(), expected, atol=1e-6, rtol=1e-6)
    assert out[2].isnan().all(), "a row past the requests was written"


def test_decode_over_more_than_256_splits():
    # 33,000 keys in splits of 128: 258 splits, merged in two chunks.
    q_lens, kv_lens = [1], [33000]
    case = make_case(q_lens, kv_lens, padded_requests=1, padded_tokens=1, block_size=256,
                     heads=2, kv_heads=1, dim=16, dtype=torch.float32, seed=3)
    config = KernelConfig.make(BLOCK_N=128, SPLIT_TOKENS=128, num_warps=4)
    assert config in paged_attention_decode_configs({})
    check_against_reference(case, q_lens, kv_lens, config=config)


# ---------------------------------------------------------------- the launcher's own paths
# (cases bench/mutation.py's survivors showed untested: CONTRIBUTING.md "Mutation testing")
def _small_case(q_lens, kv_lens, seed=7):
    return make_case(q_lens, kv_lens, padded_requests=len(kv_lens), padded_tokens=sum(q_lens),
                     block_size=16, heads=4, kv_heads=1, dim=8, dtype=torch.float32, seed=seed)


def test_every_request_may_be_named_decode():
    q_lens, kv_lens = [1, 1, 1], [5, 20, 33]
    check_against_reference(_small_case(q_lens, kv_lens), q_lens, kv_lens,
                            num_decode_requests=3)


def test_a_decode_config_serves_one_token_prompts_beside_decode_requests():
    """``max_seqlen_q`` 1: every request runs the decode kernel, so one kernel's config is
    fine whatever ``num_decode_requests`` counts (here one decode row, one 1-token prompt)."""
    q_lens, kv_lens = [1, 1], [17, 1]
    config = paged_attention_decode_default_config(DECODE_KEY)
    check_against_reference(_small_case(q_lens, kv_lens), q_lens, kv_lens, config=config,
                            num_decode_requests=1)


def test_the_torch_backend_writes_into_out():
    q_lens, kv_lens = [1, 6], [9, 6]
    case = _small_case(q_lens, kv_lens)
    out = poisoned_out(case[0])
    got = paged_attention(*case, max_seqlen_q=6, max_seqlen_k=9, num_decode_requests=1, out=out,
                          backend="torch")
    assert got is out
    assert torch.equal(out, paged_attention_ref(*case))


def test_repeat_launches_replay_a_plan_and_torch_never_does(monkeypatch):
    """The second identical Triton call replays the first one's plan (and allocates its own
    ``out``); ``backend="torch"`` after it runs the reference, and only it does."""
    import importlib

    from dynctx.kernels.launch_plan import clear_plans, plan_caches

    module = importlib.import_module("dynctx.kernels.paged_attention")   # not the function
    calls = []
    monkeypatch.setattr(module, "paged_attention_ref",
                        lambda *a, **k: (calls.append(1), paged_attention_ref(*a, **k))[1])
    q_lens, kv_lens = [1, 1], [30, 7]
    case = _small_case(q_lens, kv_lens)
    expected = paged_attention_ref(*case)
    clear_plans()
    plans = plan_caches()["paged_attention"]
    results, hits = [], []
    for backend in ("triton", "triton", "torch"):
        before = plans.hits
        results.append(paged_attention(*case, max_seqlen_q=1, max_seqlen_k=30, backend=backend))
        hits.append(plans.hits - before)
    assert hits[:2] == [0, 1] and calls == [1]
    assert results[0] is not results[1]
    for got in results:
        torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("q_lens", [[1], [2]], ids=["decode", "varlen"])
def test_a_grid_over_cudas_limit_is_refused(q_lens):
    """65536 KV heads: a grid axis of 65536 programs, over CUDA's 65535 (axis 1 of the decode
    grid, axis 2 of the varlen one), refused before the launch."""
    heads = 65536
    query = torch.zeros(sum(q_lens), heads, 16, device=DEVICE)
    cache = torch.zeros(1, 2, heads, 16, device=DEVICE)
    cu = torch.tensor([0, sum(q_lens)], dtype=torch.int32, device=DEVICE)
    kv = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="over CUDA's limit of 65535"):
        paged_attention(query, cache, cache, cu, kv, table, max_seqlen_q=max(q_lens),
                        max_seqlen_k=2, backend="triton")


def test_a_request_whose_splits_are_all_empty_merges_to_zeros():
    partial = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(1))
    lse = torch.randn(2, 1, 4, generator=torch.Generator().manual_seed(2))
    lse[1] = float("-inf")   # no key in any split (a request without keys)
    out = torch.full((2, 1, 16), float("nan"))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    merge_attention_splits(out.to(DEVICE), partial.to(DEVICE), lse.to(DEVICE), cu.to(DEVICE),
                           block_d=16)
    torch.testing.assert_close(out.cpu(), merge_attention_splits_ref(partial, lse))
    assert torch.equal(out[1].cpu(), torch.zeros(1, 16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("max_seqlen_q, window", [(2, 0), (1, 2)], ids=["varlen", "decode_window"])
def test_a_length_just_over_the_table_is_refused_after_a_planned_call(max_seqlen_q, window,
                                                                      backend):
    """A block table of 1 column of 4-token blocks holds 4 keys: ``max_seqlen_k=5`` is refused
    by name, also right after a call of the same plan key (the prefill lengths share one class,
    and so do decode lengths whose window walks the same keys), whose plan must not replay it."""
    gen = torch.Generator().manual_seed(3)
    key, value = (torch.randn(2, 4, 1, 8, generator=gen).to(DEVICE) for _ in range(2))
    query = torch.randn(max_seqlen_q, 2, 8, generator=gen).to(DEVICE)
    cu = torch.tensor([0, max_seqlen_q], dtype=torch.int32, device=DEVICE)
    kv = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[1]], dtype=torch.int32, device=DEVICE)
    args = (query, key, value, cu, kv, table)   # (distinct tensors: a plan is kept)
    got = paged_attention(*args, max_seqlen_q=max_seqlen_q, max_seqlen_k=4, window=window,
                          backend=backend)
    torch.testing.assert_close(got, paged_attention_ref(*args, window=window),
                               **ATTENTION_TOLERANCE[torch.float32])
    with pytest.raises(ValueError, match=r"max_seqlen_k=5 must be in \[0, 4\]"):
        paged_attention(*args, max_seqlen_q=max_seqlen_q, max_seqlen_k=5, window=window,
                        backend=backend)
