"""mla_latent_append into an FP8 latent cache: both parts quantized in the kernel with their own
scale, bit-exact against ``quantize_ref``, under ``TRITON_INTERPRET=1`` or compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, bits, check_tune_case, token_layout

from dynctx.kernels import autotune
from dynctx.kernels.fp8 import FP8_FORMATS, quantize_ref
from dynctx.kernels.mla_latent import (
    mla_latent_append,
    mla_latent_append_configs,
    mla_latent_append_ref,
    mla_latent_append_tune_key,
)

pytestmark = pytest.mark.interpreter

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
RANK, ROPE = 24, 8


def build(kv_dtype, src_dtype, strided=False):
    gen = torch.Generator().manual_seed(0)
    bs, blocks = 8, 6
    buffer = torch.full((2, blocks + 2, bs, RANK + ROPE), float("nan"),
                        device=DEVICE).to(kv_dtype)
    block_ids, slots = token_layout("decode:2+prefill:13+pad:2", bs, blocks, gen)
    n = block_ids.numel()
    fmax = FP8_FORMATS[kv_dtype].max
    latent_scale = torch.tensor([0.02], device=DEVICE)
    rope_scale = torch.tensor([4 / fmax], device=DEVICE)    # rope values past 4 saturate
    latent = torch.randn(n, RANK, generator=gen) * torch.logspace(-3, 1, RANK)
    rope = torch.randn(n, ROPE, generator=gen) * 6
    if strided:
        latent = torch.cat([latent, torch.zeros(n, 5)], 1)[:, :RANK]
        rope = torch.stack([rope, rope], -1)[..., 0]
    pad = (block_ids == blocks - 1).nonzero().flatten()
    for tensor in (latent, rope):
        tensor[pad] = tensor[pad[:1]]
    return (buffer, latent.to(DEVICE, src_dtype), rope.to(DEVICE, src_dtype),
            block_ids.to(DEVICE), slots.to(DEVICE), latent_scale, rope_scale)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", FP8)
def test_kernel_quantizes_like_the_reference(kv_dtype, src_dtype, strided):
    buffer, latent, rope, block_ids, slots, ls, rs = build(kv_dtype, src_dtype, strided)
    expected = buffer.clone()
    mla_latent_append_ref(expected[1, 1:-1], latent, rope, block_ids, slots, latent_scale=ls,
                          rope_scale=rs)
    mla_latent_append(buffer[1, 1:-1], latent, rope, block_ids, slots, latent_scale=ls,
                      rope_scale=rs, backend="triton")
    assert torch.equal(bits(buffer), bits(expected))
    # Independently of the reference: a real token's row holds both parts, quantized apart.
    t = 0
    row = buffer[1, 1 + int(block_ids[t]), int(slots[t])]
    assert torch.equal(bits(row[:RANK]), bits(quantize_ref(latent[t], ls, kv_dtype)))
    assert torch.equal(bits(row[RANK:]), bits(quantize_ref(rope[t], rs, kv_dtype)))
    # The rope part reaches the saturation edge somewhere (|rope| up to 6 * N(0, 1) > 4).
    written = buffer[1, 1 + block_ids, slots, RANK:].float().abs()
    assert (written == FP8_FORMATS[kv_dtype].max).any()


KEY = mla_latent_append_tune_key(num_tokens=17, kv_lora_rank=RANK, rope_dim=ROPE,
                                 dtype=torch.float16, kv_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("config", [pytest.param(c, id=str(c))
                                    for c in mla_latent_append_configs(KEY)])
def test_every_config(config):
    buffer, latent, rope, block_ids, slots, ls, rs = build(torch.float8_e4m3fn, torch.float16)
    expected = buffer.clone()
    mla_latent_append_ref(expected[0, 1:-1], latent, rope, block_ids, slots, latent_scale=ls,
                          rope_scale=rs)
    mla_latent_append(buffer[0, 1:-1], latent, rope, block_ids, slots, latent_scale=ls,
                      rope_scale=rs, config=config, backend="triton")
    assert torch.equal(bits(buffer), bits(expected))


def test_tune_case_checks_and_runs():
    tuning = autotune.get_tuning("mla_latent_append")
    check_tune_case(tuning, KEY)


def test_fp8_cache_needs_both_scales():
    buffer, latent, rope, block_ids, slots, ls, rs = build(torch.float8_e4m3fn, torch.float16)
    before = bits(buffer).clone()
    with pytest.raises(ValueError, match="needs latent_scale and rope_scale"):
        mla_latent_append(buffer[0, 1:-1], latent, rope, block_ids, slots, latent_scale=ls,
                          backend="triton")
    with pytest.raises(ValueError, match="rope_scale must be fp32 \\[1\\]"):
        mla_latent_append(buffer[0, 1:-1], latent, rope, block_ids, slots, latent_scale=ls,
                          rope_scale=torch.ones(2, device=DEVICE), backend="triton")
    assert torch.equal(bits(buffer), before)
