"""The torch paged attention (``"torch"`` and ``"torch_static"``) over an FP8 cache: equal to the
dense reference over the dequantized cache, with per-KV-head scales; the backends that do not
read dynctx's FP8 cache refuse it."""

from __future__ import annotations

import pytest
import torch
from test_torch_paged_attention import CASES, dense_reference, make_case

from dynctx.kernels.fp8 import dequantize_ref, quantize_ref
from dynctx.models.paged_attention import PagedAttention


def fp8_case(case, kv_dtype):
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        case["q_lens"], case["kv_lens"], padded_requests=case["padded_requests"],
        padded_tokens=case["padded_tokens"], bs=16, heads=4, kv_heads=2, dim=8,
        dtype=torch.float32)
    key_scale, value_scale = torch.tensor([0.01, 0.2]), torch.tensor([0.3, 0.004])
    key_q = quantize_ref(key_cache * 2, key_scale[:, None], kv_dtype)
    value_q = quantize_ref(value_cache, value_scale[:, None], kv_dtype)
    return (query, key_q, value_q, cu_q, kv, table, key_scale, value_scale,
            dequantize_ref(key_q, key_scale[:, None]),
            dequantize_ref(value_q, value_scale[:, None]))


@pytest.mark.parametrize("backend", ["torch", "torch_static"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", CASES)
def test_torch_versions_read_the_fp8_cache(case, kv_dtype, backend):
    query, key_q, value_q, cu_q, kv, table, ks, vs, key_deq, value_deq = fp8_case(case, kv_dtype)
    attention = PagedAttention(num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=16,
                               device="cpu", backend=backend)
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table,
                   max_seqlen_q=max(case["q_lens"]), max_seqlen_k=max(case["kv_lens"]),
                   num_tokens=query.shape[0], num_decode_requests=case["num_decode"])
    got = attention(query, key_q, value_q, key_scale=ks, value_scale=vs)
    want = dense_reference(query, key_deq, value_deq, case["q_lens"], case["kv_lens"], table,
                           8 ** -0.5)
    real = sum(case["q_lens"])
    torch.testing.assert_close(got[:real], want[:real], atol=2e-5, rtol=2e-5)
    assert not got[:real].isnan().any()


def test_scales_must_come_with_an_fp8_cache_only():
    case = CASES[0].values[0]
    query, key_q, value_q, cu_q, kv, table, ks, vs, key_deq, value_deq = fp8_case(
        case, torch.float8_e4m3fn)
    attention = PagedAttention(num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=16,
                               device="cpu", backend="torch")
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table,
                   max_seqlen_q=20, max_seqlen_k=40, num_tokens=query.shape[0],
                   num_decode_requests=3)
    with pytest.raises(ValueError, match="come with an FP8 cache"):
        attention(query, key_q, value_q)
    with pytest.raises(ValueError, match="come with an FP8 cache"):
        attention(query, key_deq, value_deq, key_scale=ks, value_scale=vs)
    with pytest.raises(ValueError, match="come with an FP8 cache"):
        attention(query, key_q, value_q, key_scale=ks)
