"""``PagedAttention(backend="flashinfer")`` against a stand-in FlashInfer module on a CPU.

FlashInfer runs on CUDA only, so the stand-in below does what its
``BatchPrefillWithPagedKVCacheWrapper`` documents: ``plan`` takes the ragged query indptr, the
page indptr, the page indices and the last page's length per request (NHD layout), ``run``
computes causal attention of each request's queries over its pages, reading an FP8 cache upcast
to the query's dtype and refusing a cache whose dtype is not the planned ``kv_data_type``. What
this checks is ours: the plan built from the context's metadata (padded requests dropped), the
wrapper planned with the cache's dtype, and the per-KV-head FP8 scales applied around the kernel.
The real kernel is unverified here (named in the note of the change)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_torch_paged_attention import CASES, dense_reference, make_case
from test_torch_paged_attention_fp8 import fp8_case

from dynctx.models import paged_attention as paged_attention_module
from dynctx.models.paged_attention import PagedAttention


class StandInPrefillWrapper:
    """FlashInfer's paged prefill wrapper, as documented, in torch."""

    plans: list = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD"):
        assert kv_layout == "NHD"
        self.planned = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim, page_size, *, causal, sm_scale, q_data_type,
             kv_data_type):
        self.planned = dict(qo_indptr=qo_indptr.tolist(), indptr=paged_kv_indptr.tolist(),
                            indices=paged_kv_indices.tolist(),
                            last=paged_kv_last_page_len.tolist(), heads=num_qo_heads,
                            kv_heads=num_kv_heads, page_size=page_size, causal=causal,
                            scale=sm_scale, kv_dtype=kv_data_type)
        StandInPrefillWrapper.plans.append(self.planned)

    def run(self, q: torch.Tensor, kv: tuple) -> torch.Tensor:
        p = self.planned
        key_cache, value_cache = kv
        if key_cache.dtype != p["kv_dtype"] or value_cache.dtype != p["kv_dtype"]:
            raise ValueError(f"cache {key_cache.dtype} is not the planned {p['kv_dtype']}")
        assert p["causal"] and q.is_contiguous() and q.shape[0] == p["qo_indptr"][-1]
        group = p["heads"] // p["kv_heads"]
        out = torch.empty_like(q)
        for i in range(len(p["qo_indptr"]) - 1):
            pages = p["indices"][p["indptr"][i]:p["indptr"][i + 1]]
            kv_len = (len(pages) - 1) * p["page_size"] + p["last"][i]
            k = key_cache[pages].flatten(0, 1)[:kv_len].to(q.dtype).float()
            v = value_cache[pages].flatten(0, 1)[:kv_len].to(q.dtype).float()
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            start, end = p["qo_indptr"][i], p["qo_indptr"][i + 1]
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * p["scale"]
            pos = torch.arange(kv_len - (end - start), kv_len)[:, None]
            scores = scores.masked_fill(torch.arange(kv_len)[None, :] > pos, float("-inf"))
            out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out


@pytest.fixture
def stand_in_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = StandInPrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(paged_attention_module, "flashinfer_available", lambda device: True)
    StandInPrefillWrapper.plans = []
    return StandInPrefillWrapper


def planned_attention(case, cu_q, kv, table, num_tokens):
    attention = PagedAttention(num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=16,
                               device="cpu", backend="flashinfer")
    assert attention.backend == "flashinfer"
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table,
                   max_seqlen_q=max(case["q_lens"]), max_seqlen_k=max(case["kv_lens"]),
                   num_tokens=num_tokens, num_decode_requests=case["num_decode"])
    return attention


@pytest.mark.parametrize("case", CASES)
def test_flashinfer_plan_and_run_over_the_params_dtype_cache(case, stand_in_flashinfer):
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        case["q_lens"], case["kv_lens"], padded_requests=case["padded_requests"],
        padded_tokens=case["padded_tokens"], bs=16, heads=4, kv_heads=2, dim=8,
        dtype=torch.float32)
    attention = planned_attention(case, cu_q, kv, table, query.shape[0])
    got = attention(query, key_cache, value_cache)
    want = dense_reference(query, key_cache, value_cache, case["q_lens"], case["kv_lens"],
                           table, 8 ** -0.5)
    real = sum(case["q_lens"])
    torch.testing.assert_close(got[:real], want[:real], atol=2e-5, rtol=2e-5)
    # Padded requests (kv length 0) are not planned; one plan serves every layer of the step.
    (plan,) = stand_in_flashinfer.plans
    assert len(plan["qo_indptr"]) - 1 == len(case["kv_lens"])
    assert plan["kv_dtype"] == torch.float32
    attention(query, key_cache, value_cache)
    assert len(stand_in_flashinfer.plans) == 1


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", CASES)
def test_flashinfer_reads_the_fp8_cache_with_per_head_scales(case, kv_dtype, stand_in_flashinfer):
    query, key_q, value_q, cu_q, kv, table, ks, vs, key_deq, value_deq = fp8_case(case, kv_dtype)
    attention = planned_attention(case, cu_q, kv, table, query.shape[0])
    got = attention(query, key_q, value_q, key_scale=ks, value_scale=vs)
    want = dense_reference(query, key_deq, value_deq, case["q_lens"], case["kv_lens"], table,
                           8 ** -0.5)
    real = sum(case["q_lens"])
    torch.testing.assert_close(got[:real], want[:real], atol=2e-5, rtol=2e-5)
    assert [plan["kv_dtype"] for plan in stand_in_flashinfer.plans] == [kv_dtype]


def test_flash_attn_still_refuses_the_fp8_cache():
    case = CASES[0].values[0]
    query, key_q, value_q, cu_q, kv, table, ks, vs, _, _ = fp8_case(case, torch.float8_e4m3fn)
    attention = PagedAttention(num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=16,
                               device="cpu", backend="torch")
    attention.backend = "flash_attn"   # resolution needs CUDA; the refusal comes before any call
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table,
                   max_seqlen_q=max(case["q_lens"]), max_seqlen_k=max(case["kv_lens"]),
                   num_tokens=query.shape[0], num_decode_requests=case["num_decode"])
    with pytest.raises(NotImplementedError, match="flash_attn.*FP8"):
        attention(query, key_q, value_q, key_scale=ks, value_scale=vs)
