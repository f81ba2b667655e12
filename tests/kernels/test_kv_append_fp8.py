"""kv_append into an FP8 cache: the kernel quantizes (saturating, round to nearest even),
bit-exact against ``quantize_ref``, under ``TRITON_INTERPRET=1`` on a CPU or compiled on a GPU.

The interpreter's own fp32 -> fp8 conversion is wrong (kernels/fp8.py), so these tests are
what shows that the kernels' explicit rounding makes it exact.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, bits, token_layout

from dynctx.kernels.fp8 import FP8_FORMATS, dequantize_ref, quantize_ref
from dynctx.kernels.kv_append import (
    kv_append,
    kv_append_configs,
    kv_append_ref,
    kv_append_tune_key,
)

pytestmark = pytest.mark.interpreter

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
SOURCES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
           pytest.param(torch.bfloat16, id="bf16")]
LAYERS, LAYER, GUARD = 2, 1, 1


def edge_values(kv_dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties), values just
    past the largest, infinities and signed zeros (in units of the scale)."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    values = values[values.isfinite()].sort().values
    fmax = FP8_FORMATS[kv_dtype].max
    return torch.cat([values, (values[1:] + values[:-1]) / 2,
                      torch.tensor([fmax * 1.01, -fmax * 1.5, 1e30, float("inf"),
                                    float("-inf"), -0.0, 0.0])])


def build(kv_dtype, src_dtype, heads=3, dim=40, tokens="decode:3+prefill:21+pad:3",
          seed=0, layout="contig"):
    gen = torch.Generator().manual_seed(seed)
    bs, blocks = 8, 8
    buffer = torch.full((2, LAYERS, blocks + 2 * GUARD, bs, heads, dim), float("nan"),
                        device=DEVICE).to(kv_dtype)
    block_ids, slots = token_layout(tokens, bs, blocks, gen)
    n = block_ids.numel()
    # Per head scales of different sizes; values spread over the format's range and its edges.
    key_scale = torch.tensor([0.5, 0.013, 3.0, 1.0][:heads], device=DEVICE)
    value_scale = torch.tensor([0.07, 2.0, 0.25, 1.0][:heads], device=DEVICE)
    spread = torch.logspace(-6, 3, n * heads * dim)
    key = torch.randn(n, heads, dim, generator=gen) * spread[torch.randperm(spread.numel(),
                                                                            generator=gen)
                                                             ].view(n, heads, dim)
    edges = edge_values(kv_dtype)
    take = min(edges.numel(), key.numel())
    key.view(-1)[:take] = edges[:take] * key_scale.repeat_interleave(dim).repeat(n)[:take]
    value = torch.randn(n, heads, dim, generator=gen) * 50
    if layout == "strided":
        # K from a packed QKV row, V with a strided head dim; the scales as a strided view.
        qkv = torch.zeros(n, 2 * heads + 1, dim)
        qkv[:, heads + 1:] = key
        key = qkv[:, heads + 1:]
        wide = torch.zeros(n, heads, 2 * dim)
        wide[..., ::2] = value
        value = wide[..., ::2]
        key_scale = torch.stack([key_scale, key_scale], 1)[:, 0]
    pad = (block_ids == blocks - 1).nonzero().flatten()
    for tensor in (key, value):
        tensor[pad] = tensor[pad[:1]] if pad.numel() else tensor[pad]
    key, value = (t.to(DEVICE, src_dtype) for t in (key, value))
    return buffer, key, value, block_ids.to(DEVICE), slots.to(DEVICE), key_scale, value_scale


def caches(buffer):
    inner = slice(GUARD, buffer.shape[2] - GUARD)
    return buffer[0, LAYER, inner], buffer[1, LAYER, inner]


def check(kv_dtype, src_dtype, config=None, **case):
    buffer, key, value, block_ids, slots, ks, vs = build(kv_dtype, src_dtype, **case)
    expected = buffer.clone()
    kv_append_ref(*caches(expected), key, value, block_ids, slots, key_scale=ks, value_scale=vs)
    kv_append(*caches(buffer), key, value, block_ids, slots, key_scale=ks, value_scale=vs,
              config=config, backend="triton")
    # The whole buffer: written rows, NaN-poisoned rows, the other layer and the guard blocks.
    assert torch.equal(bits(buffer), bits(expected))
    return expected, key, value, block_ids, slots, ks, vs


@pytest.mark.parametrize("src_dtype", SOURCES)
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("layout", ["contig", "strided"])
def test_kernel_quantizes_like_the_reference(kv_dtype, src_dtype, layout):
    check(kv_dtype, src_dtype, layout=layout)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("config", [pytest.param(c, id=str(c)) for c in kv_append_configs(
    kv_append_tune_key(num_tokens=27, num_heads=3, head_dim=40, dtype=torch.float16,
                       kv_dtype=torch.float8_e4m3fn))])
def test_every_config(kv_dtype, config):
    check(kv_dtype, torch.float16, config=config)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_a_replayed_launch_reads_the_calls_own_scales(kv_dtype):
    """A second call of the same shapes replays the first's launch plan (kernels/launch_plan.py):
    it quantizes with its own scales, here other values in other tensors."""
    from dynctx.kernels.kv_append import _PLANS

    check(kv_dtype, torch.float16)
    buffer, key, value, block_ids, slots, ks, vs = build(kv_dtype, torch.float16, seed=1)
    ks, vs = ks.flip(0) * 2, vs.flip(0) / 4
    expected = buffer.clone()
    kv_append_ref(*caches(expected), key, value, block_ids, slots, key_scale=ks, value_scale=vs)
    hits = _PLANS.hits
    kv_append(*caches(buffer), key, value, block_ids, slots, key_scale=ks, value_scale=vs,
              backend="triton")
    assert _PLANS.hits == hits + 1
    assert torch.equal(bits(buffer), bits(expected))


@pytest.mark.parametrize("kv_dtype", FP8)
def test_reference_saturates_and_rounds_to_nearest(kv_dtype):
    """Independently of the kernel: what ``quantize_ref`` stores reads back within half a
    spacing of the format, saturates at its largest value and never makes inf or NaN."""
    fmt = FP8_FORMATS[kv_dtype]
    scale = torch.tensor([0.25])
    x = torch.cat([edge_values(kv_dtype), torch.randn(4000) * 300]) * scale
    q = quantize_ref(x, scale, kv_dtype)
    back = dequantize_ref(q, scale)
    assert back.isfinite().all()
    assert back.abs().max().item() == fmt.max * scale.item()
    inside = (x / scale).abs() <= fmt.max
    # Half a spacing: 2**-(mantissa + 1) relative for normals, half the subnormal step below.
    tiny = 2.0 ** fmt.min_exponent
    bound = torch.maximum(x.abs() * 2.0 ** -(fmt.mantissa_bits + 1),
                          torch.tensor(tiny * 2.0 ** -(fmt.mantissa_bits + 1)) * scale)
    assert ((back - x).abs()[inside] <= bound[inside] * (1 + 1e-6)).all()
    # Ties go to the even neighbour: 1 + half a step rounds down to 1, 1 + 3 halves up to 1 + 2.
    step = 2.0 ** -fmt.mantissa_bits
    ties = torch.tensor([1 + step / 2, 1 + 1.5 * step]) * scale
    assert dequantize_ref(quantize_ref(ties, scale, kv_dtype), scale).tolist() == \
        [1.0 * scale.item(), (1 + 2 * step) * scale.item()]


def test_ref_stores_what_token_by_token_quantization_gives():
    expected, key, value, block_ids, slots, ks, vs = check(torch.float8_e4m3fn, torch.float32)
    k_cache, v_cache = caches(expected)
    for t, (block, slot) in enumerate(zip(block_ids.tolist(), slots.tolist())):
        if block == k_cache.shape[0] - 1:
            continue    # padding tokens share the dummy slot
        for h in range(key.shape[1]):
            assert torch.equal(bits(k_cache[block, slot, h]),
                               bits(quantize_ref(key[t, h], ks[h], torch.float8_e4m3fn)))
            assert torch.equal(bits(v_cache[block, slot, h]),
                               bits(quantize_ref(value[t, h], vs[h], torch.float8_e4m3fn)))


def _scales(heads=3):
    return torch.ones(heads), torch.ones(heads)


@pytest.mark.parametrize("mutate, name", [
    (lambda a: a.update(key_scale=None), "key_scale"),
    (lambda a: a.update(value_scale=torch.ones(2)), "value_scale"),
    (lambda a: a.update(key_scale=torch.ones(3, dtype=torch.float16)), "key_scale"),
    (lambda a: a.update(key=a["key"].to(torch.float8_e5m2)), "key dtype"),
])
def test_bad_fp8_arguments_raise_before_writing(mutate, name):
    buffer, key, value, block_ids, slots, ks, vs = build(torch.float8_e4m3fn, torch.float16)
    before = bits(buffer).clone()
    args = dict(key=key, value=value, key_scale=ks, value_scale=vs)
    mutate(args)
    k_cache, v_cache = caches(buffer)
    with pytest.raises(ValueError, match=name):
        kv_append(k_cache, v_cache, args["key"], args["value"], block_ids, slots,
                  key_scale=args["key_scale"], value_scale=args["value_scale"], backend="triton")
    assert torch.equal(bits(buffer), before)


def test_scales_refused_for_a_cache_that_is_not_fp8():
    cache = torch.zeros(2, 4, 3, 8)
    key = torch.zeros(1, 3, 8)
    index = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="key_scale/value_scale are for an FP8 cache"):
        kv_append(cache, cache.clone(), key, key, index, index, key_scale=torch.ones(3),
                  value_scale=torch.ones(3), backend="torch")
