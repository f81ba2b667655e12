"""rope_kv_append into an FP8 cache: the kernel quantizes what it left in ``key`` (the rotated
key in key's dtype) and the value, bit-exact against ``quantize_ref``, with per-KV-head scales,
under ``TRITON_INTERPRET=1`` on a CPU or compiled on a GPU.

The rotation itself is ``test_rope_kv_append.py``'s business; here every byte of the
NaN-poisoned buffer is checked: written slots equal ``quantize_ref`` of the kernel's ``key``
and of ``value``, everything else (other layer, padding tokens' targets) is untouched.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import byte_view
from test_rope_kv_append import (
    BLOCK_SIZE,
    DEVICE,
    LAYER,
    LAYERS,
    MAX_POS,
    Case,
    _inputs,
    _kwargs,
    _targets,
)

from dynctx.kernels.fp8 import FP8_FORMATS, quantize_ref
from dynctx.kernels.rope_kv_append import rope_kv_append, rope_kv_append_ref

pytestmark = pytest.mark.interpreter

CASES = [pytest.param(case, id=name) for name, case in {
    "neox_fp32": Case(n=7),
    "fp16_gptj_padding": Case(dtype=torch.float16, layout="gptj", padding=2, n=7),
    "partial_rotary_tail": Case(dim=24, rot=8),
    "fused_qkv_cos_sin": Case(storage="fused_qkv", table="cos_sin"),
    "key_only_mla": Case(query=False, layout="mla"),
}.items()]
FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]


def run(case: Case, kv_dtype, backend: str):
    generator = torch.Generator().manual_seed(7)
    base, views = _inputs(case, generator)
    # Values past the format's range once scaled: the saturation edge.
    base.mul_(40)
    positions = torch.randint(0, MAX_POS, (case.n,), generator=generator).to(DEVICE)
    num_blocks, block_ids, slots = _targets(case, generator)
    buffer = torch.full((2, LAYERS, num_blocks, BLOCK_SIZE, case.heads_kv, case.dim),
                        float("nan"), device=DEVICE).to(kv_dtype)
    before = buffer.clone()
    query, key, value = views(base)
    query = query if case.query else None
    fmax = FP8_FORMATS[kv_dtype].max
    # Head 0 of K and head 1 of V saturate their values past 20 (inputs reach 40).
    key_scale = torch.tensor([20 / fmax, 0.5][:case.heads_kv], device=DEVICE)
    value_scale = torch.stack([torch.tensor([0.03, 20 / fmax][:case.heads_kv])] * 2, 1)[:, 0]
    rope_kv_append(query, key, value, positions, buffer[0, LAYER], buffer[1, LAYER], block_ids,
                   slots, **_kwargs(case), key_scale=key_scale, value_scale=value_scale,
                   backend=backend)
    return buffer, before, key, value, block_ids, slots, key_scale, value_scale


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cache_holds_the_quantized_rotated_key_and_value(case, kv_dtype, backend):
    buffer, before, key, value, block_ids, slots, ks, vs = run(case, kv_dtype, backend)

    def squeeze(t):
        return t[:, 0] if t.dim() == 4 else t

    keep = (block_ids >= 0) & (slots >= 0)
    blocks, slots_kept = block_ids[keep], slots[keep]
    expected = before.clone()
    expected[0, LAYER, blocks, slots_kept] = quantize_ref(squeeze(key)[:case.n][keep],
                                                          ks[:, None], kv_dtype)
    expected[1, LAYER, blocks, slots_kept] = quantize_ref(squeeze(value)[:case.n][keep],
                                                          vs[:, None], kv_dtype)
    assert torch.equal(byte_view(buffer), byte_view(expected))
    fmax = FP8_FORMATS[kv_dtype].max
    written = buffer[:, LAYER, blocks, slots_kept].float()
    assert (written.abs() == fmax).any(), "the case never reached the saturation edge"


def test_reference_rotates_then_quantizes():
    case = Case(n=5)
    generator = torch.Generator().manual_seed(1)
    base, views = _inputs(case, generator)
    query, key, value = views(base)
    positions = torch.randint(0, MAX_POS, (case.n,), generator=generator)
    num_blocks, block_ids, slots = _targets(case, generator)
    buffer = torch.zeros(2, num_blocks, BLOCK_SIZE, case.heads_kv, case.dim).to(
        torch.float8_e4m3fn)
    scales = torch.full((case.heads_kv,), 0.01)
    rotated_key = key.clone()
    rope_kv_append_ref(query.clone(), rotated_key, value, positions, buffer[0], buffer[1],
                       block_ids, slots, **_kwargs(case), key_scale=scales, value_scale=scales)
    assert torch.equal(byte_view(buffer[0][block_ids, slots]),
                       byte_view(quantize_ref(rotated_key[:case.n], scales[:, None],
                                              torch.float8_e4m3fn)))
    assert not torch.equal(rotated_key, key), "the reference did not rotate"


def test_fp8_cache_without_scales_is_refused():
    case = Case(n=3)
    generator = torch.Generator().manual_seed(2)
    base, views = _inputs(case, generator)
    query, key, value = views(base)
    positions = torch.zeros(case.n, dtype=torch.int64, device=DEVICE)
    num_blocks, block_ids, slots = _targets(case, generator)
    buffer = torch.zeros(2, num_blocks, BLOCK_SIZE, case.heads_kv, case.dim,
                         device=DEVICE).to(torch.float8_e4m3fn)
    snapshot = base.clone()
    with pytest.raises(ValueError, match="needs key_scale and value_scale"):
        rope_kv_append(query, key, value, positions, buffer[0], buffer[1], block_ids, slots,
                       **_kwargs(case), backend="triton")
    assert torch.equal(base, snapshot), "a refused call rotated query/key"


def test_tune_case_checks_every_config_of_an_fp8_key():
    from kernel_test_utils import check_tune_case

    from dynctx.kernels import autotune
    from dynctx.kernels.rope_kv_append import rope_kv_append_tune_key

    tuning = autotune.get_tuning("rope_kv_append")
    key = rope_kv_append_tune_key(num_tokens=5, num_q_heads=2, num_k_heads=2, head_dim=16,
                                  rot_dim=16, layout="neox", table="freqs",
                                  dtype=torch.float16, kv_dtype=torch.float8_e4m3fn)
    assert key["kv_dtype"] == "float8_e4m3fn"
    assert any(k.get("kv_dtype") == "float8_e4m3fn" for k in tuning.presets())
    # One config per tile shape (warps change no result under the interpreter).
    configs, seen = [], set()
    for config in tuning.configs(key):
        if torch.cuda.is_available() or config.meta not in seen:
            seen.add(config.meta)
            configs.append(config)
    check_tune_case(tuning, key, configs=configs)
