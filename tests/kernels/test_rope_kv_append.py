"""rope_kv_append: the Triton kernel against ``fused_qk_rope_ref`` followed by a KV append.

Run: TRITON_INTERPRET=1 python -m pytest -q -m interpreter tests/kernels/test_rope_kv_append.py

Tolerance: the rotated query/key and the key written to the cache are checked as in
``test_rope.py`` (one ulp of the dtype of the fp32 reference plus 8 fp32 eps: the GPU rounds to
nearest even, the interpreter truncates to bf16). On top, the key cache must hold exactly the
bits the kernel left in ``key``, the value cache exactly ``value``'s bits, and every other byte
of the NaN-poisoned ``[2, L, blocks, bs, H, D]`` buffer (other layer, unused blocks and slots,
padding tokens' targets) must be bit-identical after the launch.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from kernel_test_utils import (
    assert_only_views_written,
    assert_rotated_heads,
    byte_view,
    preset_configs,
)
from tolerances import assert_rope_close

from dynctx.kernels import autotune
from dynctx.kernels.backend import triton_interpreting
from dynctx.kernels.rope import LAYOUTS, TABLES, fused_qk_rope, make_rope_tables
from dynctx.kernels.rope_kv_append import rope_kv_append, rope_kv_append_ref

pytestmark = pytest.mark.interpreter

# the package exports the launcher under the module's own name: reach the module itself
module = importlib.import_module("dynctx.kernels.rope_kv_append")

DEVICE = "cpu" if triton_interpreting() or not torch.cuda.is_available() else "cuda"
MAX_POS = 64
LAYERS, LAYER, BLOCK_SIZE = 2, 1, 4


@dataclasses.dataclass(frozen=True)
class Case:
    n: int = 5
    guard_rows: int = 2
    heads_q: int = 3
    heads_kv: int = 2
    dim: int = 16
    rot: int = 16
    layout: str = "neox"
    table: str = "freqs"
    dtype: torch.dtype = torch.float32
    mscale: float = 1.0
    storage: str = "contiguous"
    padding: int = 0
    query: bool = True
    index_dtype: torch.dtype = torch.int64


CASES = [pytest.param(case, id=name) for name, case in {
    "zero_tokens": Case(n=0),
    "one_token": Case(n=1),
    "odd_7_tokens": Case(n=7),
    "interleaved": Case(layout="gptj"),
    "mla_layout": Case(layout="mla"),
    "mla_layout_interleaved": Case(layout="mla_gptj", table="cos_sin"),
    "cos_sin_neox": Case(table="cos_sin"),
    "partial_rotary_tail_copied": Case(dim=24, rot=8),
    "partial_rotary_12_of_20_interleaved": Case(dim=20, rot=12, layout="gptj"),
    "mscale": Case(mscale=1.37, table="cos_sin"),
    "key_only": Case(query=False),
    "padding_tokens_skip_cache": Case(n=6, padding=2),
    "int32_indices": Case(index_dtype=torch.int32, padding=1),
    "fused_qkv_slices": Case(storage="fused_qkv"),
    "singleton_dim_4d": Case(storage="singleton_dim", layout="gptj"),
    "fp16": Case(dtype=torch.float16),
    "bf16": Case(dtype=torch.bfloat16),
    "bf16_mla_fused_qkv_partial": Case(dtype=torch.bfloat16, layout="mla", storage="fused_qkv",
                                       dim=24, rot=16),
    "fp16_cos_sin_interleaved_padding": Case(dtype=torch.float16, layout="gptj", table="cos_sin",
                                             padding=1, n=7),
}.items()]


def _inputs(case: Case, generator: torch.Generator):
    rows, hq, hkv, dim = case.n + case.guard_rows, case.heads_q, case.heads_kv, case.dim
    if case.storage == "fused_qkv":
        base = torch.rand(rows, (hq + 2 * hkv) * dim, generator=generator)

        def views(b):
            q = b[:, : hq * dim].view(rows, hq, dim)
            k = b[:, hq * dim: (hq + hkv) * dim].view(rows, hkv, dim)
            return q, k, b[:, (hq + hkv) * dim:].view(rows, hkv, dim)
    elif case.storage == "singleton_dim":
        base = torch.rand(rows, 1, hq + 2 * hkv, dim, generator=generator)

        def views(b):
            return b[:, :, :hq], b[:, :, hq: hq + hkv], b[:, :, hq + hkv:]
    else:
        base = torch.rand(rows * (hq + 2 * hkv) * dim, generator=generator)

        def views(b):
            q = b[: rows * hq * dim].view(rows, hq, dim)
            kv = b[rows * hq * dim:].view(2, rows, hkv, dim)
            return q, kv[0], kv[1]
    return (base * 2 - 1).to(DEVICE, case.dtype), views


def _targets(case: Case, generator: torch.Generator):
    """Distinct (block, slot) per token in a shuffled order; ``padding`` tokens get -1."""
    num_blocks = -(-case.n // BLOCK_SIZE) + 2
    flat = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator)[: case.n]
    block_ids, slots = flat // BLOCK_SIZE, flat % BLOCK_SIZE
    if case.padding:
        pad = torch.randperm(case.n, generator=generator)[: case.padding]
        block_ids[pad[::2]] = -1
        slots[pad] = -1
    return num_blocks, block_ids.to(DEVICE, case.index_dtype), slots.to(DEVICE, case.index_dtype)


def _kwargs(case: Case) -> dict:
    interleaved = case.layout in ("gptj", "mla_gptj")
    freqs, cos_sin = make_rope_tables(MAX_POS, case.rot, interleaved, device=DEVICE)
    table = {"freqs": freqs} if case.table == "freqs" else {"cos_sin_cache": cos_sin}
    return dict(table, interleaved=interleaved, mla_layout=case.layout.startswith("mla"),
                mscale=case.mscale)


def run_and_check(case: Case, config=None) -> None:
    generator = torch.Generator().manual_seed(99)
    base, views = _inputs(case, generator)
    positions = torch.randint(0, MAX_POS, (case.n,), generator=generator).to(DEVICE)
    num_blocks, block_ids, slots = _targets(case, generator)
    buffer = torch.full((2, LAYERS, num_blocks, BLOCK_SIZE, case.heads_kv, case.dim),
                        float("nan"), dtype=case.dtype, device=DEVICE)
    snapshot, buffer_snapshot = base.clone(), buffer.clone()
    query, key, value = views(base)
    query = query if case.query else None
    expected = [None if x is None else x.float().clone() for x in (query, key, value)]
    expected_buffer = buffer.float()
    rope_kv_append_ref(*expected, positions, expected_buffer[0, LAYER], expected_buffer[1, LAYER],
                       block_ids, slots, **_kwargs(case))

    rope_kv_append(query, key, value, positions, buffer[0, LAYER], buffer[1, LAYER], block_ids,
                   slots, **_kwargs(case), config=config, backend="triton")

    n, rot = case.n, case.rot
    def squeeze(t):
        return t[:, 0] if t.dim() == 4 else t

    before_q, before_k, before_v = (squeeze(t) for t in views(snapshot))
    for name, got, want, before in (("query", query, expected[0], before_q),
                                    ("key", key, expected[1], before_k)):
        if got is None:
            continue
        assert_rotated_heads(name, squeeze(got), squeeze(want), before, n, rot, case.mscale)
    assert torch.equal(byte_view(squeeze(value)), byte_view(before_v)), "value was written"

    written = ((block_ids >= 0) & (slots >= 0)).cpu()
    blocks, offsets = block_ids.cpu()[written].long(), slots.cpu()[written].long()
    key_cache, value_cache = buffer[0, LAYER].cpu(), buffer[1, LAYER].cpu()
    assert_rope_close(key_cache[blocks, offsets],
                      expected_buffer[0, LAYER].cpu()[blocks, offsets], case.mscale, "key_cache")
    assert torch.equal(byte_view(key_cache[blocks, offsets]),
                       byte_view(squeeze(key).cpu()[:n][written]))
    assert torch.equal(byte_view(value_cache[blocks, offsets]),
                       byte_view(before_v.cpu()[:n][written]))
    # every other byte of the poisoned buffer is untouched
    restored = buffer.clone()
    restored[:, LAYER, blocks.to(DEVICE), offsets.to(DEVICE)] = buffer_snapshot[
        :, LAYER, blocks.to(DEVICE), offsets.to(DEVICE)]
    assert torch.equal(byte_view(restored), byte_view(buffer_snapshot)), (
        "cache written outside targets")
    assert_only_views_written(base, snapshot, views, (case.query, True, True),
                              "bytes outside q/k/v written")


@pytest.mark.parametrize("case", CASES)
def test_rope_kv_append_matches_reference(case):
    run_and_check(case)


CONFIGS = preset_configs("rope_kv_append")


@pytest.mark.parametrize("config", [pytest.param(c, id=str(c)) for c in CONFIGS])
def test_every_config(config):
    index = CONFIGS.index(config)
    case = Case(n=6, heads_q=5, heads_kv=2, dim=24, rot=16, layout=LAYOUTS[index % 4],
                table=TABLES[(index // 4) % 2], padding=1,
                dtype=(torch.float32, torch.bfloat16, torch.float16)[index % 3])
    run_and_check(case, config=config)


def test_defaults_lie_in_search_space():
    tuning = autotune.get_tuning("rope_kv_append")
    keys = tuning.presets() + [
        tuning.tune_key(num_tokens=n, num_q_heads=hq, num_k_heads=hk, head_dim=d, rot_dim=r,
                        layout="neox", table="freqs", dtype="float16")
        for n in (0, 7, 300, 9000) for hq, hk, d, r in ((0, 1, 16, 8), (64, 8, 256, 64),
                                                        (8, 8, 512, 128))]
    for key in keys:
        assert tuning.default_config(key) in tuning.configs(key), key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotation_matches_fused_qk_rope_bit_for_bit(layout):
    """Both launchers share the rotation code, so query and key come out identical."""
    case = Case(layout=layout, dtype=torch.bfloat16, table=TABLES[LAYOUTS.index(layout) % 2])
    generator = torch.Generator().manual_seed(4)
    base, views = _inputs(case, generator)
    positions = torch.randint(0, MAX_POS, (case.n,), generator=generator).to(DEVICE)
    num_blocks, block_ids, slots = _targets(case, generator)
    buffer = torch.zeros(2, num_blocks, BLOCK_SIZE, case.heads_kv, case.dim, dtype=case.dtype,
                         device=DEVICE)
    other = base.clone()
    query, key, value = views(base)
    rope_kv_append(query, key, value, positions, buffer[0], buffer[1], block_ids, slots,
                   **_kwargs(case), backend="triton")
    other_query, other_key, _ = views(other)
    fused_qk_rope(other_query, other_key, positions, **_kwargs(case), backend="triton")
    assert torch.equal(byte_view(base), byte_view(other))


def test_zero_tokens_launches_nothing(monkeypatch):
    monkeypatch.setattr(module, "_rope_kv_append_kernel", None)
    key = torch.ones(2, 1, 8, device=DEVICE)
    cache = torch.full((2, 3, 4, 1, 8), float("nan"), device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    freqs, _ = make_rope_tables(MAX_POS, 8, False, device=DEVICE)
    rope_kv_append(None, key, key.clone(), empty, cache[0], cache[1], empty, empty, freqs=freqs,
                   backend="triton")
    assert torch.equal(key, torch.ones_like(key)) and cache.isnan().all()


def _bad_inputs():
    q, k, v = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    cache = torch.zeros(2, 3, 4, 1, 8)
    index = torch.zeros(3, dtype=torch.int64)
    freqs, _ = make_rope_tables(16, 8, False)
    ok = dict(query=q, key=k, value=v, positions=index, key_cache=cache[0], value_cache=cache[1],
              block_ids=index, slots=index, freqs=freqs)
    cases = {
        "key_none": (dict(ok, key=None), "key"),
        "value_heads": (dict(ok, value=torch.zeros(4, 2, 8)), "value"),
        "value_dtype": (dict(ok, value=v.half()), "value"),
        "value_short": (dict(ok, value=v[:2]), "value"),
        "key_cache_3d": (dict(ok, key_cache=cache[0, 0]), "key_cache"),
        "key_cache_dtype": (dict(ok, key_cache=cache[0].half()), "key_cache"),
        "value_cache_heads": (dict(ok, value_cache=torch.zeros(3, 4, 2, 8)), "value_cache"),
        "block_ids_float": (dict(ok, block_ids=index.float()), "block_ids"),
        "block_ids_length": (dict(ok, block_ids=index[:2]), "block_ids"),
        "slots_2d": (dict(ok, slots=index[None]), "slots"),
        "positions_float": (dict(ok, positions=index.float()), "positions"),
        "table_missing": (dict(ok, freqs=None), "cos_sin_cache and freqs"),
    }
    return [pytest.param(kwargs, match, id=name) for name, (kwargs, match) in cases.items()]


@pytest.mark.parametrize("kwargs,match", _bad_inputs())
def test_bad_inputs_raise_value_error(kwargs, match):
    kwargs = dict(kwargs)
    names = ("query", "key", "value", "positions", "key_cache", "value_cache", "block_ids", "slots")
    args = [kwargs.pop(name) for name in names]
    with pytest.raises(ValueError, match=match):
        rope_kv_append(*args, **kwargs, backend="triton")


def test_custom_op_matches_reference():
    generator = torch.Generator().manual_seed(8)
    query, key, value = (torch.rand(5, 1, h, 16, generator=generator) for h in (3, 2, 2))
    positions = torch.randint(0, MAX_POS, (4,), generator=generator)
    block_ids, slots = torch.tensor([0, 2, 1, -1]), torch.tensor([3, 0, 1, 2])
    cache = torch.full((2, 3, 4, 2, 16), float("nan"))
    _, cos_sin = make_rope_tables(MAX_POS, 16, False)
    expected = [x.clone() for x in (query, key, value, cache)]
    rope_kv_append_ref(*expected[:3], positions, expected[3][0], expected[3][1], block_ids, slots,
                       cos_sin_cache=cos_sin, mscale=0.9)
    torch.ops.dynctx.rope_kv_append(query, key, value, positions, cache[0], cache[1], block_ids,
                                    slots, cos_sin, None, False, 0.9, False)
    for got, want in zip((query, key, value, cache), expected):
        assert torch.equal(byte_view(got), byte_view(want))
