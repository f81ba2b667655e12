"""The torch paged attention against a dense per-request reference."""

from __future__ import annotations

import math

import pytest
import torch

from dynctx.kernels.backend import HAS_TRITON, triton_interpreting
from dynctx.models.paged_attention import (
    PagedAttention,
    paged_attention_torch,
    resolve_attention_backend,
)


def dense_reference(query, key_cache, value_cache, q_lens, kv_lens, block_table, scale):
    """One request at a time: gather its K/V token by token, causal softmax, GQA by repeat."""
    out = torch.zeros_like(query, dtype=torch.float32)
    group = query.shape[1] // key_cache.shape[2]
    bs = key_cache.shape[1]
    start = 0
    for q_len, kv_len, row in zip(q_lens, kv_lens, block_table.tolist()):
        positions = range(kv_len)
        k = torch.stack([key_cache[row[p // bs], p % bs] for p in positions]).float()
        v = torch.stack([value_cache[row[p // bs], p % bs] for p in positions]).float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        for j in range(q_len):
            pos = kv_len - q_len + j
            q = query[start + j].float()                                   # [Hq, D]
            scores = torch.einsum("hd,khd->hk", q, k[:pos + 1]) * scale
            out[start + j] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[:pos + 1])
        start += q_len
    return out


def make_case(q_lens, kv_lens, *, padded_requests, padded_tokens, bs, heads, kv_heads, dim,
              dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(k / bs) for k in kv_lens) + 1
    num_blocks = sum(math.ceil(k / bs) for k in kv_lens) + 3
    # Stale slots hold NaN: nothing past a request's length may leak into its output.
    key_cache = torch.full((num_blocks, bs, kv_heads, dim), float("nan"), dtype=dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    block_table = torch.full((padded_requests, max_blocks), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()
    for r, kv in enumerate(kv_lens):
        for b in range(math.ceil(kv / bs)):
            block = free.pop()
            block_table[r, b] = block
            used = min(bs, kv - b * bs)
            key_cache[block, :used] = torch.randn(used, kv_heads, dim, generator=gen).to(dtype)
            value_cache[block, :used] = torch.randn(used, kv_heads, dim, generator=gen).to(dtype)
    query = torch.randn(padded_tokens, heads, dim, generator=gen).to(dtype)
    q = torch.zeros(padded_requests, dtype=torch.int32)
    kv = torch.zeros(padded_requests, dtype=torch.int32)
    q[:len(q_lens)] = torch.tensor(q_lens)
    kv[:len(kv_lens)] = torch.tensor(kv_lens)
    cu_q = torch.zeros(padded_requests + 1, dtype=torch.int32)
    cu_q[1:] = torch.cumsum(q, 0)
    return query, key_cache, value_cache, cu_q, kv, block_table


CASES = [
    # decode requests first (q = 1), then a fresh prefill, a chunk continuation, a 1-token prompt
    pytest.param(dict(q_lens=[1, 1, 1, 20, 7, 1], kv_lens=[5, 16, 33, 20, 40, 1],
                      padded_requests=8, padded_tokens=40, num_decode=3), id="mixed"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[17, 1, 64], padded_requests=4,
                      padded_tokens=4, num_decode=3), id="decode_only"),
    pytest.param(dict(q_lens=[33], kv_lens=[33], padded_requests=4, padded_tokens=64,
                      num_decode=0), id="one_prefill"),
    # decode rows of many key counts (several length groups, the last one taking the rest),
    # then two chunks starting mid-sequence
    pytest.param(dict(q_lens=[1] * 10 + [5, 16], kv_lens=[1, 3, 9, 16, 17, 30, 31, 50, 64, 99,
                                                           21, 40],
                      padded_requests=16, padded_tokens=40, num_decode=10), id="many_decode"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
def test_torch_paged_attention_matches_dense(case, heads, kv_heads, dtype, atol):
    bs, dim = 16, 8
    q_lens, kv_lens = case["q_lens"], case["kv_lens"]
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        q_lens, kv_lens, padded_requests=case["padded_requests"],
        padded_tokens=case["padded_tokens"], bs=bs, heads=heads, kv_heads=kv_heads, dim=dim,
        dtype=dtype)
    scale = dim ** -0.5
    expected = dense_reference(query, key_cache, value_cache, q_lens, kv_lens,
                               table[:len(q_lens)], scale)
    real = sum(q_lens)
    for num_decode in (case["num_decode"], 0):
        out = paged_attention_torch(query, key_cache, value_cache, cu_q, kv, table,
                                    max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens),
                                    num_decode_requests=num_decode)
        assert out.shape == query.shape and out.dtype == dtype
        torch.testing.assert_close(out[:real].float(), expected[:real], atol=atol, rtol=atol)
        # Padding tokens belong to no request: zeros.
        assert torch.equal(out[real:], torch.zeros_like(out[real:]))



@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 1)], ids=["gqa", "mqa"])
def test_torch_static_matches_dense(case, heads, kv_heads):
    """The padded torch version (what a captured forward runs), with bounds above the real
    maxima as a graph's static bounds are."""
    bs, dim = 16, 8
    q_lens, kv_lens = case["q_lens"], case["kv_lens"]
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        q_lens, kv_lens, padded_requests=case["padded_requests"],
        padded_tokens=case["padded_tokens"], bs=bs, heads=heads, kv_heads=kv_heads, dim=dim,
        dtype=torch.float32)
    expected = dense_reference(query, key_cache, value_cache, q_lens, kv_lens,
                               table[:len(q_lens)], dim ** -0.5)
    real = sum(q_lens)
    attention = PagedAttention(num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                               block_size=bs, device="cpu", backend="torch_static")
    assert attention.backend == "torch_static"
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table,
                   max_seqlen_q=max(q_lens) + 3, max_seqlen_k=table.shape[1] * bs,
                   num_tokens=query.shape[0], num_decode_requests=case["num_decode"])
    out = attention(query, key_cache, value_cache)
    torch.testing.assert_close(out[:real], expected[:real], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))


def test_plan_once_serves_every_layer():
    bs, dim = 16, 8
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        [1, 12], [30, 12], padded_requests=4, padded_tokens=16, bs=bs, heads=4, kv_heads=2,
        dim=dim, dtype=torch.float32)
    attention = PagedAttention(num_q_heads=4, num_kv_heads=2, head_dim=dim, block_size=bs,
                               device="cpu", backend="auto")
    assert attention.backend == "torch"
    with pytest.raises(RuntimeError, match="plan"):
        attention(query, key_cache, value_cache)
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table, max_seqlen_q=12,
                   max_seqlen_k=30, num_tokens=16, num_decode_requests=1)
    first = attention(query, key_cache, value_cache)
    second = attention(query * 2, key_cache, value_cache)
    expected = dense_reference(query * 2, key_cache, value_cache, [1, 12], [30, 12], table[:2],
                               dim ** -0.5)
    torch.testing.assert_close(second[:13], expected[:13], atol=1e-5, rtol=1e-5)
    assert not torch.equal(first, second)


def test_backend_resolution_on_cpu():
    assert resolve_attention_backend("auto", torch.device("cpu"), 16) == "torch"
    assert resolve_attention_backend("torch", torch.device("cpu"), 16) == "torch"
    for name in ("flashinfer", "flash_attn"):
        with pytest.raises(RuntimeError, match=name):
            resolve_attention_backend(name, torch.device("cpu"), 256)
    with pytest.raises(ValueError, match="not one of"):
        resolve_attention_backend("sdpa", torch.device("cpu"), 16)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_auto_takes_the_triton_kernels_on_cuda():
    # Resolution looks at the device type only: no CUDA device is needed to ask.
    for dtype in (torch.float32, torch.float16, torch.bfloat16, None):
        assert resolve_attention_backend("auto", torch.device("cuda"), 16, dtype) == "triton"
        assert resolve_attention_backend("triton", torch.device("cuda"), 16, dtype) == "triton"


@pytest.mark.skipif(triton_interpreting(), reason="the interpreter runs Triton on a CPU")
def test_triton_on_cpu_needs_the_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET|not installed"):
        resolve_attention_backend("triton", torch.device("cpu"), 16)
