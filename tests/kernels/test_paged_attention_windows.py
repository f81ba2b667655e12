"""paged_attention with sliding windows and attention sinks: the Triton kernels (split-KV
decode and its merge, varlen prefill) against the torch reference.

Same traps as ``test_paged_attention.py`` (NaN in stale slots, -1 table entries, NaN padding
queries, a poisoned output), and one more: the keys that lie outside the window of every query
of a request are NaN and their block-table entries -1, as a windowed KV group leaves them once
it has released those blocks, so a kernel that reads one of them gives NaN. Windows are shorter
than the prompts (a window that is ignored gives other numbers); sinks are large enough to take
a visible share of the softmax. Run under ``TRITON_INTERPRET=1`` on a CPU (``-m interpreter``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, assert_raises_naming
from test_paged_attention import (
    DECODE_KEY,
    DTYPES,
    HEADS,
    VARLEN_KEY,
    _configs,
    check_against_reference,
    make_case,
    poisoned_out,
)

from dynctx.kernels import autotune
from dynctx.kernels.paged_attention import paged_attention, paged_attention_ref
from dynctx.kernels.paged_attention_decode import paged_attention_decode_configs
from dynctx.kernels.paged_attention_merge import (
    merge_attention_splits,
    merge_attention_splits_ref,
)
from dynctx.kernels.paged_attention_tile import ATTENTION_TOLERANCE
from dynctx.kernels.paged_attention_varlen import (
    paged_attention_varlen_configs,
    paged_attention_varlen_tune_key,
)

pytestmark = pytest.mark.interpreter


def sinks_for(heads, dtype=torch.float32, seed=0):
    """Per-head sink logits of the size of the scores (so they take a visible share)."""
    return (2 * torch.randn(heads, generator=torch.Generator().manual_seed(seed))).to(
        dtype).to(DEVICE)


def drop_outside_windows(case, q_lens, kv_lens, window):
    """``case`` with the keys before every query's window NaN and the table entries of the
    blocks wholly before it -1 (what a windowed group has released), and the case unchanged
    for the reference."""
    query, key_cache, value_cache, cu, kv, table = case
    key_cache, value_cache, table = key_cache.clone(), value_cache.clone(), table.clone()
    block_size = key_cache.shape[1]
    for request, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        first_seen = max(0, kv_len - q_len - window + 1)    # the first query's first key
        for position in range(first_seen):
            block = int(table[request, position // block_size])
            key_cache[block, position % block_size] = float("nan")
            value_cache[block, position % block_size] = float("nan")
        table[request, :first_seen // block_size] = -1
    return (query, key_cache, value_cache, cu, kv, table), case


# (query lengths, kv lengths, padded requests, padded tokens, window), block size 8.
CASES = [
    # decode: windows of 1 (its own key only), 5 (inside a block), 12 (across a block), and
    # one request shorter than its window; padded requests after them
    pytest.param([1, 1, 1], [30, 45, 7], 5, 4, 12, id="decode_w12"),
    pytest.param([1, 1], [30, 9], 3, 2, 1, id="decode_w1"),
    pytest.param([1, 1], [30, 17], 2, 2, 5, id="decode_w5"),
    # a whole prompt longer than its window, a chunk starting mid-sequence, decode requests
    # first (one query each through the varlen kernel when no decode count is given)
    pytest.param([1, 20, 7, 1], [26, 20, 33, 1], 6, 32, 6, id="mixed_w6"),
    # a chunk whose window starts mid-block, and a window longer than every request
    pytest.param([13], [40], 2, 16, 9, id="chunk_w9"),
    pytest.param([5, 1], [5, 11], 2, 6, 64, id="window_over_lengths"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", HEADS)
@pytest.mark.parametrize("q_lens, kv_lens, padded_requests, padded_tokens, window", CASES)
def test_windows_match_reference(q_lens, kv_lens, padded_requests, padded_tokens, window, heads,
                                 kv_heads, dtype):
    case = make_case(q_lens, kv_lens, padded_requests=padded_requests,
                     padded_tokens=padded_tokens, block_size=8, heads=heads, kv_heads=kv_heads,
                     dim=8, dtype=dtype, seed=window)
    dropped, reference = drop_outside_windows(case, q_lens, kv_lens, window)
    check_against_reference(dropped, q_lens, kv_lens, window=window, reference_case=reference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 6], ids=["sinks_alone", "sinks_and_window"])
def test_sinks_match_reference(window, dtype):
    q_lens, kv_lens = [1, 1, 20, 7], [26, 3, 20, 33]
    case = make_case(q_lens, kv_lens, padded_requests=6, padded_tokens=31, block_size=8, heads=4,
                     kv_heads=2, dim=8, dtype=dtype, seed=11)
    dropped, reference = drop_outside_windows(case, q_lens, kv_lens, window or 10_000)
    sinks = sinks_for(4, dtype)
    check_against_reference(dropped, q_lens, kv_lens, window=window, sinks=sinks,
                            reference_case=reference)
    # The leading decode requests through the split-KV kernel and its merge.
    check_against_reference(dropped, q_lens, kv_lens, window=window, sinks=sinks,
                            reference_case=reference, num_decode_requests=2)


def test_sinks_change_the_output_and_window_zero_is_none():
    q_lens, kv_lens = [1, 6], [12, 6]
    case = make_case(q_lens, kv_lens, padded_requests=2, padded_tokens=7, block_size=8, heads=2,
                     kv_heads=1, dim=8, dtype=torch.float32, seed=2)
    bounds = dict(max_seqlen_q=6, max_seqlen_k=12, num_decode_requests=1, backend="triton")
    plain = paged_attention(*case, **bounds)
    assert torch.equal(paged_attention(*case, window=0, **bounds), plain)
    torch.testing.assert_close(paged_attention(*case, window=12, **bounds), plain,
                               **ATTENTION_TOLERANCE[torch.float32])
    with_sinks = paged_attention(*case, sinks=sinks_for(2), **bounds)
    assert (with_sinks - plain).abs().max() > 1e-2
    # A sink of -inf takes nothing.
    minus_inf = torch.full((2,), float("-inf"), device=DEVICE)
    torch.testing.assert_close(paged_attention(*case, sinks=minus_inf, **bounds), plain,
                               **ATTENTION_TOLERANCE[torch.float32])


# Every config's meta-parameters with a window shorter than the requests and sinks: the decode
# case spans several splits of the window (the merge), the varlen case query tiles whose first
# rows' windows start tiles apart from their last rows'.
@pytest.mark.parametrize("config", _configs(paged_attention_decode_configs, DECODE_KEY))
def test_every_decode_config_with_window_and_sinks(config):
    q_lens, kv_lens, window = [1, 1], [400, 70], 290
    case = make_case(q_lens, kv_lens, padded_requests=3, padded_tokens=3, block_size=64, heads=4,
                     kv_heads=1, dim=8, dtype=torch.float16, seed=3)
    dropped, reference = drop_outside_windows(case, q_lens, kv_lens, window)
    check_against_reference(dropped, q_lens, kv_lens, config=config, window=window,
                            sinks=sinks_for(4, torch.float16), reference_case=reference)


@pytest.mark.parametrize("config", _configs(paged_attention_varlen_configs, VARLEN_KEY))
def test_every_varlen_config_with_window_and_sinks(config):
    q_lens, kv_lens, window = [70, 1, 3], [140, 9, 3], 40
    case = make_case(q_lens, kv_lens, padded_requests=4, padded_tokens=76, block_size=32,
                     heads=2, kv_heads=1, dim=8, dtype=torch.float16, seed=4)
    dropped, reference = drop_outside_windows(case, q_lens, kv_lens, window)
    check_against_reference(dropped, q_lens, kv_lens, config=config, window=window,
                            sinks=sinks_for(2, torch.float16), reference_case=reference)


def test_strided_views_with_window_and_sinks():
    """Query, caches, output and sinks as offset, strided views (the caches as one layer of a
    ``[2, layers, blocks, bs, H, D]`` buffer with a head dim strided by 2)."""
    q_lens, kv_lens, window = [1, 9, 1], [21, 14, 6], 5
    heads, kv_heads, dim = 4, 2, 8
    case = make_case(q_lens, kv_lens, padded_requests=4, padded_tokens=12, block_size=8,
                     heads=heads, kv_heads=kv_heads, dim=dim, dtype=torch.float32, seed=6)
    query, key_cache, value_cache, cu, kv, table = case
    big_query = torch.full((query.shape[0] + 1, 2 * heads, dim), float("nan"), device=DEVICE)
    big_query[1:, ::2] = query
    buffer = torch.full((2, 3, key_cache.shape[0], 8, 2 * kv_heads, dim), float("nan"),
                        device=DEVICE)
    buffer[0, 1, :, :, ::2] = key_cache
    buffer[1, 1, :, :, ::2] = value_cache
    big_table = torch.full((table.shape[0], table.shape[1] + 2), -1, dtype=torch.int32,
                           device=DEVICE)
    big_table[:, 1:-1] = table
    sinks = sinks_for(heads)
    big_sinks = torch.full((2 * heads + 1,), float("nan"), device=DEVICE)
    big_sinks[1::2] = sinks
    big_out = torch.empty(query.shape[0] + 2, 3 * heads, dim, device=DEVICE)
    big_out.view(torch.uint8).fill_(0xFF)
    out = big_out[2:, 1::3]
    before = big_out.clone()
    views = (big_query[1:, ::2], buffer[0, 1, :, :, ::2], buffer[1, 1, :, :, ::2], cu, kv,
             big_table[:, 1:-1])
    for decode in (0, 1):
        check_against_reference(views, q_lens, kv_lens, window=window, sinks=big_sinks[1::2],
                                reference_case=case, num_decode_requests=decode, out=out)
    written = torch.zeros(big_out.shape, dtype=torch.bool, device=DEVICE)
    written[2:2 + sum(q_lens), 1::3] = True
    assert torch.equal(big_out.view(torch.int32)[~written], before.view(torch.int32)[~written]), \
        "bytes around the output view were written"
    torch.testing.assert_close(out[:sum(q_lens)], paged_attention_ref(
        *case, window=window, sinks=sinks)[:sum(q_lens)], **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_splits", [3, 300])
def test_merge_with_sinks_matches_the_reference(num_splits):
    gen = torch.Generator().manual_seed(num_splits)
    requests, heads, dim = 2, 3, 16
    partial = torch.randn(requests, heads, num_splits, dim, generator=gen)
    lse = 3 * torch.randn(requests, heads, num_splits, generator=gen)
    lse[1, 0] = float("-inf")           # a head whose splits are all empty: the sink alone
    sinks = 3 * torch.randn(heads, generator=gen)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.full((2, heads, dim), float("nan"), device=DEVICE)
    merge_attention_splits(out, partial.to(DEVICE), lse.to(DEVICE), cu.to(DEVICE), block_d=dim,
                           sinks=sinks.to(DEVICE))
    expected = merge_attention_splits_ref(partial, lse, sinks)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[1, 0].cpu(), torch.zeros(dim))


def test_tuning_keys_name_the_window():
    """The varlen key names the window; its presets tune one windowed shape (the decode key
    takes the keys a query walks instead: the test below)."""
    assert VARLEN_KEY["window"] == 0
    windowed = paged_attention_varlen_tune_key(num_q_heads=4, num_kv_heads=2, head_dim=8,
                                               dtype=torch.float16, num_tokens=80, window=128)
    assert windowed == {**VARLEN_KEY, "dtype": "float16", "window": 128}
    presets = autotune.get_tuning("paged_attention_varlen").presets()
    assert any(p["window"] for p in presets) and any(not p["window"] for p in presets)


def test_windowed_decode_launches_only_the_splits_of_its_window(monkeypatch):
    """8,000 keys, a window of 128, splits of 128: one split per request, not 63."""
    from dynctx.kernels import paged_attention_decode as decode
    from dynctx.kernels.autotune import KernelConfig

    grids = []
    kernel = decode._paged_attention_decode_kernel

    class Recording:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(decode, "_paged_attention_decode_kernel", Recording())
    q_lens, kv_lens, window = [1], [8000], 128
    case = make_case(q_lens, kv_lens, padded_requests=1, padded_tokens=1, block_size=64, heads=2,
                     kv_heads=1, dim=8, dtype=torch.float32, seed=8)
    dropped, reference = drop_outside_windows(case, q_lens, kv_lens, window)
    config = KernelConfig.make(BLOCK_N=64, SPLIT_TOKENS=128, num_warps=4)
    check_against_reference(dropped, q_lens, kv_lens, config=config, window=window,
                            reference_case=reference)
    assert grids == [(1, 1, 1)]


def _bad_calls():
    query, key_cache, value_cache, cu, kv, table = make_case(
        [1, 1], [3, 5], padded_requests=2, padded_tokens=2, block_size=4, heads=4, kv_heads=2,
        dim=8, dtype=torch.float32)

    def call(**changes):
        return lambda: paged_attention(query, key_cache, value_cache, cu, kv, table,
                                       max_seqlen_q=1, max_seqlen_k=5, **changes)

    return [
        pytest.param(call(window=-1), "window=-1", id="negative_window"),
        pytest.param(call(window=True), "window=True", id="bool_window"),
        pytest.param(call(window=2.5), "window=2.5", id="float_window"),
        pytest.param(call(sinks=torch.zeros(3)), "sinks", id="sinks_shape"),
        pytest.param(call(sinks=torch.zeros(4, 1)), "sinks", id="sinks_2d"),
        pytest.param(call(sinks=torch.zeros(4, dtype=torch.int32)), "sinks", id="sinks_int"),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad_call, name", _bad_calls())
def test_bad_windows_and_sinks_name_the_argument(bad_call, name, backend, monkeypatch):
    assert_raises_naming(bad_call, name, backend, monkeypatch)


def test_a_refused_call_writes_nothing():
    case = make_case([1], [5], padded_requests=1, padded_tokens=1, block_size=4, heads=2,
                     kv_heads=1, dim=8, dtype=torch.float32)
    out = poisoned_out(case[0])
    before = out.clone()
    with pytest.raises(ValueError, match="window=-3"):
        paged_attention(*case, max_seqlen_q=1, max_seqlen_k=5, window=-3, out=out,
                        backend="triton")
    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))


def test_custom_op_takes_window_and_sinks():
    q_lens, kv_lens = [1, 7], [12, 7]
    case = make_case(q_lens, kv_lens, padded_requests=2, padded_tokens=8, block_size=4, heads=2,
                     kv_heads=1, dim=8, dtype=torch.float32, seed=9)
    sinks = sinks_for(2)
    expected = paged_attention_ref(*case, softmax_scale=0.25, window=3, sinks=sinks)
    got = torch.ops.dynctx.paged_attention(*case, 7, 12, 0.25, 2, 1, 3, sinks)
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCE[torch.float32])
