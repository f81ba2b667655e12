"""paged_attention over an FP8 cache: the kernels dequantize (K scale folded into the softmax
scale, V scale into the output) and match attention over the dequantized cache.

Under ``TRITON_INTERPRET=1`` on a CPU (the interpreter reads fp8 exactly) or compiled on a GPU.
The traps of ``test_paged_attention.py`` stay set: stale slots hold NaN (NaN in fp8 too), unused
table entries are -1, padding queries are NaN and the output is poisoned.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, byte_view
from test_paged_attention import CASES, make_case, poisoned_out

from dynctx.kernels.fp8 import dequantize_ref, quantize_ref
from dynctx.kernels.paged_attention import paged_attention, paged_attention_ref
from dynctx.kernels.paged_attention_decode import (
    paged_attention_decode_configs,
    paged_attention_decode_tune_key,
)
from dynctx.kernels.paged_attention_tile import ATTENTION_TOLERANCE
from dynctx.kernels.paged_attention_varlen import (
    paged_attention_varlen_configs,
    paged_attention_varlen_tune_key,
)

pytestmark = pytest.mark.interpreter

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
QUERY_DTYPES = [pytest.param(torch.float32, id="q-fp32"), pytest.param(torch.float16, id="q-fp16")]


def fp8_case(q_lens, kv_lens, kv_dtype, query_dtype, *, kv_heads=2, heads=4, block_size=16,
             dim=8, padded_requests=None, padded_tokens=None, seed=0):
    """A paged step whose caches are quantized with per-KV-head scales (as strided views);
    returns the step, the scales and the dequantized fp32 caches."""
    padded_requests = padded_requests or len(q_lens) + 1
    padded_tokens = padded_tokens or sum(q_lens) + 2
    query, key_cache, value_cache, cu, kv, table = make_case(
        q_lens, kv_lens, padded_requests=padded_requests, padded_tokens=padded_tokens,
        block_size=block_size, heads=heads, kv_heads=kv_heads, dim=dim, dtype=torch.float32,
        seed=seed)
    # Values of a few units at scales far from 1, so that an unapplied scale shows.
    key_cache, value_cache = key_cache * 3, value_cache * 5
    both = torch.tensor([[0.02, 0.5, 0.003, 1.5][:kv_heads],
                         [0.04, 0.01, 2.0, 0.3][:kv_heads]], device=DEVICE)
    wide = torch.stack([both, both], -1)
    key_scale, value_scale = wide[0, :, 0], wide[1, :, 1]
    key_q = quantize_ref(key_cache, key_scale[:, None], kv_dtype)
    value_q = quantize_ref(value_cache, value_scale[:, None], kv_dtype)
    step = (query.to(query_dtype), key_q, value_q, cu, kv, table)
    dequantized = (dequantize_ref(key_q, key_scale[:, None]),
                   dequantize_ref(value_q, value_scale[:, None]))
    return step, key_scale, value_scale, dequantized


def check(q_lens, kv_lens, kv_dtype, query_dtype, *, config=None, num_decode_requests=0,
          **shape):
    step, key_scale, value_scale, (key_deq, value_deq) = fp8_case(
        q_lens, kv_lens, kv_dtype, query_dtype, **shape)
    query, key_q, value_q, cu, kv, table = step
    out = poisoned_out(query)
    before = out.clone()
    args = dict(max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens), out=out)
    got = paged_attention(query, key_q, value_q, cu, kv, table, **args, key_scale=key_scale,
                          value_scale=value_scale, config=config,
                          num_decode_requests=num_decode_requests, backend="triton")
    # Independent of how the kernels fold the scales: attention over the dequantized cache.
    expected = paged_attention_ref(query.float(), key_deq, value_deq, cu, kv, table)
    real = int(cu[len(q_lens)])
    assert not got[:real].isnan().any(), "a trap (NaN) reached a request's output"
    torch.testing.assert_close(got[:real].float(), expected[:real],
                               **ATTENTION_TOLERANCE[query_dtype])
    assert torch.equal(byte_view(got[real:]), byte_view(before[real:])), "padding rows written"
    # The torch backend (the reference with the scales) agrees too.
    torch_out = paged_attention(query, key_q, value_q, cu, kv, table,
                                max_seqlen_q=args["max_seqlen_q"],
                                max_seqlen_k=args["max_seqlen_k"], key_scale=key_scale,
                                value_scale=value_scale, backend="torch")
    torch.testing.assert_close(torch_out[:real].float(), expected[:real],
                               **ATTENTION_TOLERANCE[query_dtype])


@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("q_lens, kv_lens, padded_requests, padded_tokens", CASES)
def test_kernels_dequantize(q_lens, kv_lens, padded_requests, padded_tokens, kv_dtype,
                            query_dtype):
    check(q_lens, kv_lens, kv_dtype, query_dtype, padded_requests=padded_requests,
          padded_tokens=padded_tokens)


def test_mixed_step_with_decode_requests_apart():
    check([1, 1, 20, 7, 1], [5, 40, 20, 26, 1], torch.float8_e4m3fn, torch.float16,
          num_decode_requests=2, padded_requests=7, padded_tokens=36, seed=5)


def _one_per_meta(space):
    seen, chosen = set(), []
    for config in space:
        if torch.cuda.is_available() or config.meta not in seen:
            seen.add(config.meta)
            chosen.append(pytest.param(config, id=str(config)))
    return chosen


_DECODE_KEY = paged_attention_decode_tune_key(num_q_heads=4, num_kv_heads=2, head_dim=8,
                                              dtype=torch.float16, num_requests=2,
                                              max_seqlen_k=300, kv_dtype=torch.float8_e4m3fn)
_VARLEN_KEY = paged_attention_varlen_tune_key(num_q_heads=4, num_kv_heads=2, head_dim=8,
                                              dtype=torch.float16, num_tokens=80,
                                              kv_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("config", _one_per_meta(paged_attention_decode_configs(_DECODE_KEY)))
def test_every_decode_config(config):
    check([1, 1], [300, 70], torch.float8_e4m3fn, torch.float16, config=config, block_size=64,
          padded_requests=3, padded_tokens=3, seed=3)


@pytest.mark.parametrize("config", _one_per_meta(paged_attention_varlen_configs(_VARLEN_KEY)))
def test_every_varlen_config(config):
    check([70, 1, 3], [140, 9, 3], torch.float8_e5m2, torch.float16, config=config,
          block_size=32, padded_requests=4, padded_tokens=76, seed=4)


def test_tune_keys_name_the_cache_dtype_only_where_it_differs():
    plain = paged_attention_decode_tune_key(num_q_heads=4, num_kv_heads=2, head_dim=8,
                                            dtype=torch.bfloat16, num_requests=2,
                                            max_seqlen_k=300, kv_dtype=torch.bfloat16)
    assert "kv_dtype" not in plain
    assert _DECODE_KEY["kv_dtype"] == "float8_e4m3fn" == _VARLEN_KEY["kv_dtype"]


@pytest.mark.parametrize("scales, message", [
    (dict(), "needs key_scale and value_scale"),
    (dict(key_scale=torch.ones(3), value_scale=torch.ones(2)), "key_scale must be fp32 \\[2\\]"),
    (dict(key_scale=torch.ones(2), value_scale=torch.ones(2, dtype=torch.float64)),
     "value_scale must be fp32"),
])
def test_bad_scales_name_the_argument(scales, message):
    step, *_ = fp8_case([1], [5], torch.float8_e4m3fn, torch.float32)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=message):
            paged_attention(*step, max_seqlen_q=1, max_seqlen_k=5, backend=backend,
                            **{k: v.to(DEVICE) for k, v in scales.items()})


def test_scales_refused_for_a_cache_in_the_query_dtype():
    query, key_cache, value_cache, cu, kv, table = make_case(
        [1], [5], padded_requests=1, padded_tokens=1, block_size=16, heads=2, kv_heads=2,
        dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="key_scale/value_scale are for an FP8 cache"):
        paged_attention(query, key_cache, value_cache, cu, kv, table, max_seqlen_q=1,
                        max_seqlen_k=5, key_scale=torch.ones(2), value_scale=torch.ones(2))
