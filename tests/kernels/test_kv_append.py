"""kv_append: Triton launcher vs the torch reference, bit-exact, with poisoned caches and guards.

Run with ``TRITON_INTERPRET=1`` on a CPU (set before import) or compiled on a GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_test_utils import (
    DEVICE,
    DTYPES,
    bits,
    check_presets_share_space,
    check_tune_case,
    token_layout,
)

from dynctx.kernels import autotune
from dynctx.kernels.kv_append import (
    kv_append,
    kv_append_configs,
    kv_append_default_config,
    kv_append_op,
    kv_append_presets,
    kv_append_ref,
    kv_append_tune_key,
)

pytestmark = pytest.mark.interpreter

# The module itself (``dynctx.kernels.kv_append`` as an attribute is the launcher function).
kv_module = importlib.import_module("dynctx.kernels.kv_append")

LAYERS, LAYER = 3, 1
GUARD_BLOCKS = 1


def make_input(layout: str, rows: int, heads: int, dim: int, dtype, gen) -> torch.Tensor:
    """K or V rows in a given memory layout; values include -0.0, inf and a NaN."""
    if layout == "contig":
        base = torch.randn(rows, heads, dim, generator=gen)
    elif layout == "qkv":
        base = torch.randn(rows, 4 + 2 * heads, dim, generator=gen)[:, 4 + heads:]
    elif layout == "4d":
        base = torch.randn(rows, 1, heads, dim, generator=gen)
    elif layout == "transposed":
        base = torch.randn(heads, rows, dim, generator=gen).transpose(0, 1)
    elif layout == "dim_strided":
        base = torch.randn(rows, heads, 2 * dim, generator=gen)[..., ::2]
    else:
        raise AssertionError(layout)
    flat = base.reshape(-1) if base.is_contiguous() else None
    if flat is not None and flat.numel() >= 3:
        flat[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    # Cast keeping the layout: convert the storage-owning tensor, then take the same view.
    out = torch.empty_strided(base.shape, base.stride(), dtype=dtype, device=DEVICE)
    out.copy_(base)
    return out


def build(case: dict, dtype, seed: int = 0):
    """Poisoned [2, L, blocks + guards, bs, H, D] buffer, its cache views, inputs and indices."""
    gen = torch.Generator().manual_seed(seed)
    heads, dim, bs, blocks = case["heads"], case["dim"], case["block_size"], case["num_blocks"]
    buffer = torch.full((2, LAYERS, blocks + 2 * GUARD_BLOCKS, bs, heads, dim), float("nan"),
                        dtype=dtype, device=DEVICE)
    block_ids, slots = token_layout(case["tokens"], bs, blocks, gen)
    n = block_ids.numel()
    rows = n + case.get("extra_rows", 0)
    key = make_input(case["key"], rows, heads, dim, dtype, gen)
    value = make_input(case["value"], rows, heads, dim, dtype, gen)
    pad = (block_ids == blocks - 1).nonzero().flatten()
    if pad.numel() > 1:
        # Padding tokens share (dummy, 0): give them identical rows so the result is defined.
        for tensor in (key, value):
            tensor[pad[1:]] = tensor[pad[0]].clone()
    index_dtype = case.get("index_dtype", torch.int32)
    return buffer, key, value, block_ids.to(DEVICE, index_dtype), slots.to(DEVICE, index_dtype)


def caches(buffer: torch.Tensor):
    inner = slice(GUARD_BLOCKS, buffer.shape[2] - GUARD_BLOCKS)
    return buffer[0, LAYER, inner], buffer[1, LAYER, inner]


def check_against_reference(case: dict, dtype, config=None, backend="triton"):
    buffer, key, value, block_ids, slots = build(case, dtype)
    inputs_before = [bits(t).clone() for t in (key, value)]
    expected = buffer.clone()
    kv_append_ref(*caches(expected), key, value, block_ids, slots)
    kv_append(*caches(buffer), key, value, block_ids, slots, config=config, backend=backend)
    # The whole buffer: written rows, untouched poisoned rows, other layers and guard blocks.
    assert torch.equal(bits(buffer), bits(expected))
    for before, tensor in zip(inputs_before, (key, value)):
        assert torch.equal(before, bits(tensor)), "inputs were modified"
    return buffer, expected


SHAPES = [
    pytest.param(dict(heads=5, dim=96, block_size=16, num_blocks=6, tokens="decode:0",
                      key="contig", value="contig"), id="0tok"),
    pytest.param(dict(heads=5, dim=96, block_size=16, num_blocks=6, tokens="decode:1",
                      key="contig", value="4d", index_dtype=torch.int64), id="1tok-lastslot-4d"),
    pytest.param(dict(heads=2, dim=80, block_size=16, num_blocks=9, tokens="decode:5",
                      key="qkv", value="qkv"), id="5tok-decode-d80-qkv"),
    pytest.param(dict(heads=3, dim=128, block_size=16, num_blocks=6, tokens="prefill:37",
                      key="transposed", value="dim_strided"), id="37tok-prefill-crossblocks"),
    pytest.param(dict(heads=5, dim=96, block_size=16, num_blocks=8,
                      tokens="decode:3+prefill:20+pad:4", key="4d", value="contig", extra_rows=6,
                      index_dtype=torch.int64), id="mixed-pad-extrarows"),
    pytest.param(dict(heads=1, dim=16, block_size=4, num_blocks=4, tokens="prefill:7+pad:2",
                      key="dim_strided", value="transposed"), id="1head-d16-bs4"),
]

# The preset space (8 heads of 128) and this case's space (5 heads of 96) are the same list.
CONFIG_CASE = dict(heads=5, dim=96, block_size=16, num_blocks=8, tokens="decode:3+prefill:20+pad:4",
                   key="qkv", value="4d")
CONFIG_KEY = kv_append_tune_key(num_tokens=27, num_heads=5, head_dim=96, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES)
def test_matches_reference(case, dtype):
    check_against_reference(case, dtype)


def test_config_space_covers_presets():
    check_presets_share_space(kv_append_configs, kv_append_default_config, kv_append_presets,
                              CONFIG_KEY)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config",
                         [pytest.param(c, id=str(c)) for c in kv_append_configs(CONFIG_KEY)])
def test_every_config(config, dtype):
    check_against_reference(CONFIG_CASE, dtype, config=config)


def kv_append_by_token(key_cache, value_cache, key, value, block_ids, slots) -> None:
    """The contract written out token by token, independent of ``kv_append_ref``: token ``t``'s
    K and V rows go to ``(block_ids[t], slots[t])``."""
    heads, dim = key_cache.shape[2:]
    for t, (block, slot) in enumerate(zip(block_ids.tolist(), slots.tolist())):
        key_cache[block, slot] = key[t].reshape(heads, dim)
        value_cache[block, slot] = value[t].reshape(heads, dim)


@pytest.mark.parametrize("case", SHAPES[1:5])
def test_torch_backend_matches_a_token_by_token_copy(case):
    """The torch backend runs ``kv_append_ref``: compared with a copy written independently
    (not with the reference it calls), so a wrong reference fails here."""
    buffer, key, value, block_ids, slots = build(case, torch.bfloat16)
    expected = buffer.clone()
    kv_append_by_token(*caches(expected), key, value, block_ids, slots)
    kv_append(*caches(buffer), key, value, block_ids, slots, backend="torch")
    assert torch.equal(bits(buffer), bits(expected))


def test_default_config_in_space_and_key_buckets():
    for heads, dim in ((1, 16), (3, 80), (8, 128), (32, 256), (64, 512)):
        for n in (1, 37, 4096):
            key = kv_append_tune_key(num_tokens=n, num_heads=heads, head_dim=dim,
                                     dtype=torch.float16)
            assert key["num_tokens"] == autotune.bucket_tokens(n)
            assert kv_append_default_config(key) in kv_append_configs(key)


def test_tune_case_checks_and_runs():
    tuning = autotune.get_tuning("kv_append")
    check_tune_case(tuning, tuning.tune_key(num_tokens=5, num_heads=2, head_dim=16,
                                            dtype=torch.bfloat16))


def _bad_inputs():
    """(mutation, argument named in the error) pairs."""
    def cast(name, dtype):
        return lambda a: {**a, name: a[name].to(dtype)}

    return [
        pytest.param(cast("key", torch.float16), "key", id="key-dtype"),
        pytest.param(lambda a: {**a, "value": a["value"][:, :1]}, "value", id="value-heads"),
        pytest.param(lambda a: {**a, "key": a["key"][:2]}, "key", id="key-rows"),
        pytest.param(lambda a: {**a, "slots": a["slots"][:-1]}, "slots", id="slots-length"),
        pytest.param(cast("block_ids", torch.float32), "block_ids", id="block_ids-float"),
        pytest.param(lambda a: {**a, "slots": torch.empty_like(a["slots"], device="meta")}, "slots",
                     id="slots-device"),
        pytest.param(lambda a: {**a, "key": a["key"].to("meta")}, "key", id="key-device"),
        pytest.param(lambda a: {**a, "key_cache": a["key_cache"][0],
                                "value_cache": a["value_cache"][0]},
                     "key_cache", id="key_cache-3d"),
        pytest.param(lambda a: {**a, "value_cache": a["value_cache"][:2]}, "value_cache",
                     id="value_cache-shape"),
        pytest.param(lambda a: {**a, "key_cache": a["key_cache"].int(),
                                "value_cache": a["value_cache"].int()}, "key_cache",
                     id="key_cache-dtype"),
        pytest.param(lambda a: {**a, "block_ids": a["block_ids"][None]}, "block_ids",
                     id="block_ids-2d"),
    ]


@pytest.mark.parametrize("mutate,argname", _bad_inputs())
def test_bad_inputs_raise(mutate, argname):
    buffer = torch.zeros(2, 1, 4, 4, 2, 8, device=DEVICE)
    # Views of one buffer, with a strided slot dim, so that a clone changes the strides.
    key_cache, value_cache = buffer[0, 0, :, ::2], buffer[1, 0, :, ::2]
    args = dict(key_cache=key_cache, value_cache=value_cache,
                key=torch.zeros(3, 2, 8, device=DEVICE),
                value=torch.zeros(3, 2, 8, device=DEVICE),
                block_ids=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                slots=torch.zeros(3, dtype=torch.int64, device=DEVICE))
    args = mutate(args)
    with pytest.raises(ValueError, match=rf"^{argname}\b"):
        kv_append(**args, backend="torch")
    with pytest.raises(ValueError, match=rf"^{argname}\b"):
        kv_append(**args, backend="triton")


class _LaunchSpy:
    """Stands in for the jitted kernel and records each launch's keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](**kwargs)
        return launch


def test_override_file_config_is_launched(tmp_path, monkeypatch):
    case = dict(heads=5, dim=96, block_size=16, num_blocks=8, tokens="decode:3+prefill:9",
                key="contig", value="qkv")
    key = kv_append_tune_key(num_tokens=12, num_heads=5, head_dim=96, dtype=torch.float16)
    chosen = next(c for c in kv_append_configs(key) if c != kv_append_default_config(key)
                  and c.kwargs["BLOCK_T"] == 4 and c.kwargs["BLOCK_H"] == 2)
    monkeypatch.setenv(autotune.OVERRIDE_ENV, str(tmp_path))
    device = autotune.device_name(DEVICE)
    autotune.write_cache_file(tmp_path / device / "kv_append.json", device=device,
                               kernel="kv_append",
                               entries=[{"key": key, "config": chosen.to_dict(),
                                         "times_us": {"triton": 1.0}}],
                               versions={"triton": "test", "torch": "test"})
    config, source = autotune.resolve_config("kv_append", key, DEVICE)
    assert config == chosen and source.startswith("override-exact")
    spy = _LaunchSpy(kv_module._kv_append_kernel)
    monkeypatch.setattr(kv_module, "_kv_append_kernel", spy)
    check_against_reference(case, torch.float16)
    assert len(spy.launches) == 1
    grid, kwargs = spy.launches[0]
    assert {k: kwargs[k] for k in chosen.launch_kwargs()} == chosen.launch_kwargs()
    assert grid == (3, 3)  # 12 tokens / BLOCK_T 4, 5 heads / BLOCK_H 2
    # Another token count of the same shape takes the nearest bucket's entry.
    assert autotune.resolve_config("kv_append", {**key, "num_tokens": 64}, DEVICE)[0] == chosen


def _op_args(dtype=torch.float32):
    case = dict(heads=2, dim=8, block_size=4, num_blocks=5, tokens="decode:2+prefill:5+pad:2",
                key="qkv", value="contig")
    buffer, key, value, block_ids, slots = build(case, dtype)
    return buffer, key, value, block_ids, slots


def test_custom_op_matches_reference():
    buffer, key, value, block_ids, slots = _op_args()
    expected = buffer.clone()
    kv_append_ref(*caches(expected), key, value, block_ids, slots)
    kv_append_op(*caches(buffer), key, value, block_ids, slots)
    assert torch.equal(bits(buffer), bits(expected))


def test_custom_op_opcheck():
    buffer, key, value, block_ids, slots = _op_args()
    torch.library.opcheck(kv_append_op, (*caches(buffer.nan_to_num()), key.nan_to_num(),
                                         value.nan_to_num(), block_ids, slots))


def test_custom_op_compiles():
    buffer, key, value, block_ids, slots = _op_args()
    expected = buffer.clone()
    kv_append_ref(*caches(expected), key, value, block_ids, slots)

    def step(buffer, key, value, block_ids, slots):
        kv_append_op(buffer[0, LAYER, 1:-1], buffer[1, LAYER, 1:-1], key, value, block_ids, slots)
        return buffer.sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(buffer, key, value, block_ids, slots)
    assert torch.equal(bits(buffer), bits(expected))
