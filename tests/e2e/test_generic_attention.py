"""Sliding windows and attention sinks in the torch paged attention, against a dense
per-request reference; the other backends refuse them."""

from __future__ import annotations

import pytest
import torch
from test_torch_paged_attention import CASES, make_case

from dynctx.models.paged_attention import PagedAttention, paged_attention_torch


def dense_reference(query, key_cache, value_cache, q_lens, kv_lens, block_table, scale,
                    window=None, sinks=None):
    """One request and one query at a time: the keys at ``pos - window < j <= pos``, a softmax
    whose denominator also holds ``exp(sinks[h])``."""
    out = torch.zeros_like(query, dtype=torch.float32)
    group = query.shape[1] // key_cache.shape[2]
    bs = key_cache.shape[1]
    start = 0
    for q_len, kv_len, row in zip(q_lens, kv_lens, block_table.tolist()):
        k = torch.stack([key_cache[row[p // bs], p % bs] for p in range(kv_len)]).float()
        v = torch.stack([value_cache[row[p // bs], p % bs] for p in range(kv_len)]).float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        for j in range(q_len):
            pos = kv_len - q_len + j
            low = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", query[start + j].float(),
                                  k[low:pos + 1]) * scale
            if sinks is not None:
                scores = torch.cat((scores, sinks.float()[:, None]), dim=-1)
            probs = scores.softmax(-1)[:, :pos + 1 - low]
            out[start + j] = torch.einsum("hk,khd->hd", probs, v[low:pos + 1])
        start += q_len
    return out


# Windows narrower than most requests (1: the token itself; 5 and 16 across block boundaries),
# and one wider than every request (the full mask).
WINDOWS = [1, 5, 16, 1000]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["torch", "torch_static"])
@pytest.mark.parametrize("window", WINDOWS + [None])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_window_and_sinks_match_dense(case, backend, window, with_sinks):
    bs, dim, heads, kv_heads = 16, 8, 4, 2
    q_lens, kv_lens = case["q_lens"], case["kv_lens"]
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        q_lens, kv_lens, padded_requests=case["padded_requests"],
        padded_tokens=case["padded_tokens"], bs=bs, heads=heads, kv_heads=kv_heads, dim=dim,
        dtype=torch.float32)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(7)) if with_sinks \
        else None
    scale = 0.3
    expected = dense_reference(query, key_cache, value_cache, q_lens, kv_lens,
                               table[:len(q_lens)], scale, window, sinks)
    real = sum(q_lens)
    attention = PagedAttention(num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                               block_size=bs, device="cpu", backend=backend)
    # torch_static: bounds above the real maxima, as a graph's static bounds are.
    extra = 3 if backend == "torch_static" else 0
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table,
                   max_seqlen_q=max(q_lens) + extra, max_seqlen_k=max(kv_lens) + extra,
                   num_tokens=query.shape[0], num_decode_requests=case["num_decode"])
    out = attention(query, key_cache, value_cache, softmax_scale=scale, window=window,
                    sinks=sinks)
    torch.testing.assert_close(out[:real], expected[:real], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    # The same plan serves a full layer after a windowed one (masks are per window).
    full = attention(query, key_cache, value_cache, softmax_scale=scale)
    torch.testing.assert_close(full[:real], dense_reference(
        query, key_cache, value_cache, q_lens, kv_lens, table[:len(q_lens)], scale)[:real],
        atol=1e-5, rtol=1e-5)


def test_a_narrow_window_changes_the_output():
    """The window is not ignored: a window of 5 over 40 keys differs from full attention."""
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        [1, 20], [40, 20], padded_requests=2, padded_tokens=21, bs=16, heads=4, kv_heads=2,
        dim=8, dtype=torch.float32)
    common = dict(max_seqlen_q=20, max_seqlen_k=40, num_decode_requests=1)
    full = paged_attention_torch(query, key_cache, value_cache, cu_q, kv, table, **common)
    windowed = paged_attention_torch(query, key_cache, value_cache, cu_q, kv, table, window=5,
                                     **common)
    assert not torch.allclose(full[:21], windowed[:21])


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)],
                         ids=["fp16", "bf16"])
def test_half_precision_window_and_sinks(dtype, atol):
    q_lens, kv_lens = [1, 1, 12, 9], [30, 3, 12, 25]
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        q_lens, kv_lens, padded_requests=4, padded_tokens=32, bs=8, heads=6, kv_heads=2, dim=8,
        dtype=dtype)
    sinks = torch.linspace(-1, 2, 6).to(dtype)
    expected = dense_reference(query, key_cache, value_cache, q_lens, kv_lens, table, 0.35,
                               window=7, sinks=sinks)
    out = paged_attention_torch(query, key_cache, value_cache, cu_q, kv, table, max_seqlen_q=12,
                                max_seqlen_k=30, softmax_scale=0.35, num_decode_requests=2,
                                window=7, sinks=sinks)
    assert out.dtype == dtype
    torch.testing.assert_close(out[:sum(q_lens)].float(), expected[:sum(q_lens)], atol=atol,
                               rtol=atol)


@pytest.mark.parametrize("window, message", [(0, "window=0"), (-3, "window=-3"),
                                             (2.0, "window=2.0"), (True, "window=True")])
def test_bad_window_is_refused(window, message):
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        [3], [3], padded_requests=1, padded_tokens=3, bs=4, heads=2, kv_heads=1, dim=4,
        dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        paged_attention_torch(query, key_cache, value_cache, cu_q, kv, table, max_seqlen_q=3,
                              max_seqlen_k=3, window=window)
    with pytest.raises(ValueError, match=r"sinks must be a \[2\] tensor"):
        paged_attention_torch(query, key_cache, value_cache, cu_q, kv, table, max_seqlen_q=3,
                              max_seqlen_k=3, sinks=torch.zeros(3))


def test_other_backends_refuse_windows_and_sinks():
    """A backend without windows or sinks raises instead of ignoring them (no wrong tokens)."""
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        [3], [3], padded_requests=1, padded_tokens=3, bs=4, heads=2, kv_heads=1, dim=4,
        dtype=torch.float32)
    attention = PagedAttention(num_q_heads=2, num_kv_heads=1, head_dim=4, block_size=4,
                               device="cpu", backend="torch")
    # The refusal sits before any kernel is touched: a backend name set after construction
    # reaches it on a CPU (our Triton kernels compute both: tests/kernels).
    attention.backend = "flash_attn"
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=table, max_seqlen_q=3,
                   max_seqlen_k=3, num_tokens=3)
    with pytest.raises(NotImplementedError, match="'flash_attn' has no sliding windows:"):
        attention(query, key_cache, value_cache, window=2)
    with pytest.raises(NotImplementedError, match="sliding windows or attention sinks"):
        attention(query, key_cache, value_cache, window=2, sinks=torch.zeros(2))


@pytest.mark.parametrize("backend", ["torch", "torch_static"])
def test_released_blocks_before_the_window_are_never_read(backend):
    """A windowed KV group frees the blocks wholly before the window of every query: their
    table entries are -1 and their bytes another request's (NaN here). The output is the same
    as with them in place."""
    bs, heads, kv_heads, dim, window = 4, 4, 2, 8, 5
    q_lens, kv_lens = [1, 1, 6, 3], [23, 9, 6, 17]
    query, key_cache, value_cache, cu_q, kv, table = make_case(
        q_lens, kv_lens, padded_requests=5, padded_tokens=12, bs=bs, heads=heads,
        kv_heads=kv_heads, dim=dim, dtype=torch.float32, seed=3)
    expected = dense_reference(query, key_cache, value_cache, q_lens, kv_lens,
                               table[:len(q_lens)], 0.3, window)
    released_k, released_v, released_table = key_cache.clone(), value_cache.clone(), table.clone()
    dropped = 0
    for request, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        first_seen = max(0, kv_len - q_len - window + 1)
        for b in range(first_seen // bs):
            released_k[table[request, b]] = float("nan")
            released_v[table[request, b]] = float("nan")
            released_table[request, b] = -1
            dropped += 1
    assert dropped >= 5
    attention = PagedAttention(num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                               block_size=bs, device="cpu", backend=backend)
    attention.plan(cu_query_lengths=cu_q, kv_seq_lengths=kv, block_table=released_table,
                   max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens),
                   num_tokens=query.shape[0], num_decode_requests=2)
    out = attention(query, released_k, released_v, softmax_scale=0.3, window=window)
    real = sum(q_lens)
    torch.testing.assert_close(out[:real], expected[:real], atol=1e-5, rtol=1e-5)
