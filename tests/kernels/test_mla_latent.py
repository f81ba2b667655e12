"""mla_latent_append: Triton launcher vs the torch reference, bit-exact, poisoned cache and guards.

Run with ``TRITON_INTERPRET=1`` on a CPU (set before import) or compiled on a GPU.
"""

from __future__ import annotations

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
from dynctx.kernels.mla_latent import (
    mla_latent_append,
    mla_latent_append_configs,
    mla_latent_append_default_config,
    mla_latent_append_op,
    mla_latent_append_presets,
    mla_latent_append_ref,
    mla_latent_append_tune_key,
)

pytestmark = pytest.mark.interpreter

LAYERS, LAYER = 3, 1
GUARD_BLOCKS = 1


def make_inputs(layout: str, rows: int, rank: int, rope: int, dtype, gen):
    """(kv_latent, k_rope) in a given memory layout; values include -0.0, inf and a NaN."""
    fused = torch.randn(rows, rank + rope, generator=gen)
    if fused.numel() >= 3:
        fused.view(-1)[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    fused = fused.to(DEVICE, dtype)
    if layout == "fused":
        # Split of one projection output: both strided over tokens by rank + rope.
        return fused[:, :rank], fused[:, rank:]
    latent, rope_key = fused[:, :rank].clone(), fused[:, rank:].clone()
    if layout == "contig":
        return latent, rope_key
    if layout == "3d":
        return latent[:, None], rope_key[:, None]
    if layout == "transposed":
        return latent.t().contiguous().t(), rope_key.t().contiguous().t()
    if layout == "dim_strided":
        wide = torch.empty(rows, 2 * rank, dtype=dtype, device=DEVICE)
        wide[:, ::2] = latent
        return wide[:, ::2], rope_key[:, None]
    raise AssertionError(layout)


def build(case: dict, dtype, seed: int = 0):
    """Poisoned [L, blocks + guards, bs, rank + rope] buffer, inputs and indices."""
    gen = torch.Generator().manual_seed(seed)
    rank, rope, bs, blocks = case["rank"], case["rope"], case["block_size"], case["num_blocks"]
    buffer = torch.full((LAYERS, blocks + 2 * GUARD_BLOCKS, bs, rank + rope), float("nan"),
                        dtype=dtype, device=DEVICE)
    block_ids, slots = token_layout(case["tokens"], bs, blocks, gen)
    n = block_ids.numel()
    kv_latent, k_rope = make_inputs(case["layout"], n + case.get("extra_rows", 0), rank, rope,
                                    dtype, gen)
    pad = (block_ids == blocks - 1).nonzero().flatten()
    if pad.numel() > 1:
        # Padding tokens share (dummy, 0): give them identical rows so the result is defined.
        for tensor in (kv_latent, k_rope):
            tensor[pad[1:]] = tensor[pad[0]].clone()
    index_dtype = case.get("index_dtype", torch.int32)
    return (buffer, kv_latent, k_rope, block_ids.to(DEVICE, index_dtype),
            slots.to(DEVICE, index_dtype))


def cache_view(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[LAYER, GUARD_BLOCKS:buffer.shape[1] - GUARD_BLOCKS]


def check_against_reference(case: dict, dtype, config=None, backend="triton"):
    buffer, kv_latent, k_rope, block_ids, slots = build(case, dtype)
    inputs_before = [bits(t).clone() for t in (kv_latent, k_rope)]
    expected = buffer.clone()
    mla_latent_append_ref(cache_view(expected), kv_latent, k_rope, block_ids, slots)
    mla_latent_append(cache_view(buffer), kv_latent, k_rope, block_ids, slots, config=config,
                      backend=backend)
    # The whole buffer: written rows, untouched poisoned rows, other layers and guard blocks.
    assert torch.equal(bits(buffer), bits(expected))
    for before, tensor in zip(inputs_before, (kv_latent, k_rope)):
        assert torch.equal(before, bits(tensor)), "inputs were modified"


SHAPES = [
    pytest.param(dict(rank=500, rope=40, block_size=16, num_blocks=5, tokens="decode:0",
                      layout="contig", extra_rows=2), id="0tok"),
    pytest.param(dict(rank=500, rope=40, block_size=16, num_blocks=5, tokens="decode:1",
                      layout="3d", index_dtype=torch.int64), id="1tok-lastslot-3d"),
    pytest.param(dict(rank=512, rope=64, block_size=8, num_blocks=9, tokens="decode:5",
                      layout="fused"), id="5tok-decode-r512-fused"),
    pytest.param(dict(rank=96, rope=37, block_size=16, num_blocks=6, tokens="prefill:37",
                      layout="transposed"), id="37tok-prefill-crossblocks"),
    pytest.param(dict(rank=500, rope=40, block_size=16, num_blocks=8,
                      tokens="decode:3+prefill:20+pad:4", layout="dim_strided", extra_rows=5,
                      index_dtype=torch.int64), id="mixed-pad-extrarows"),
    pytest.param(dict(rank=24, rope=8, block_size=4, num_blocks=4, tokens="prefill:7+pad:2",
                      layout="fused"), id="small-bs4"),
]

# The preset space (512 + 64) and this case's space (500 + 40) are the same list.
CONFIG_CASE = dict(rank=500, rope=40, block_size=16, num_blocks=8,
                   tokens="decode:3+prefill:20+pad:4", layout="fused")
CONFIG_KEY = mla_latent_append_tune_key(num_tokens=27, kv_lora_rank=500, rope_dim=40,
                                        dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES)
def test_matches_reference(case, dtype):
    check_against_reference(case, dtype)


def test_config_space_covers_presets():
    check_presets_share_space(mla_latent_append_configs, mla_latent_append_default_config,
                              mla_latent_append_presets, CONFIG_KEY)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [pytest.param(c, id=str(c))
                                    for c in mla_latent_append_configs(CONFIG_KEY)])
def test_every_config(config, dtype):
    check_against_reference(CONFIG_CASE, dtype, config=config)


@pytest.mark.parametrize("case", SHAPES[1:5])
def test_torch_backend_matches_a_token_by_token_copy(case):
    """The torch backend runs ``mla_latent_append_ref``: compared with a copy written
    independently (token ``t``'s latent then rope key into ``(block_ids[t], slots[t])``), so a
    wrong reference fails here."""
    buffer, kv_latent, k_rope, block_ids, slots = build(case, torch.bfloat16)
    expected = buffer.clone()
    cache, rank = cache_view(expected), kv_latent.shape[-1]
    for t, (block, slot) in enumerate(zip(block_ids.tolist(), slots.tolist())):
        cache[block, slot, :rank] = kv_latent[t].reshape(rank)
        cache[block, slot, rank:] = k_rope[t].reshape(-1)
    mla_latent_append(cache_view(buffer), kv_latent, k_rope, block_ids, slots, backend="torch")
    assert torch.equal(bits(buffer), bits(expected))


def test_default_config_in_space_and_key_buckets():
    for rank, rope in ((24, 8), (128, 32), (512, 64), (4096, 64), (16384, 64)):
        for n in (1, 37, 4096):
            key = mla_latent_append_tune_key(num_tokens=n, kv_lora_rank=rank, rope_dim=rope,
                                             dtype=torch.float16)
            assert key["num_tokens"] == autotune.bucket_tokens(n)
            assert mla_latent_append_default_config(key) in mla_latent_append_configs(key)


def test_tune_case_checks_and_runs():
    tuning = autotune.get_tuning("mla_latent_append")
    check_tune_case(tuning, tuning.tune_key(num_tokens=5, kv_lora_rank=40, rope_dim=8,
                                            dtype=torch.bfloat16))


def _bad_inputs():
    """(mutation, argument named in the error) pairs."""
    return [
        pytest.param(lambda a: {**a, "latent_cache": a["latent_cache"][0]}, "latent_cache",
                     id="latent_cache-2d"),
        pytest.param(lambda a: {**a, "latent_cache": a["latent_cache"].int()}, "latent_cache",
                     id="latent_cache-dtype"),
        pytest.param(lambda a: {**a, "kv_latent": a["kv_latent"].half()}, "kv_latent",
                     id="kv_latent-dtype"),
        pytest.param(lambda a: {**a, "kv_latent": a["kv_latent"][:, :-1]}, "kv_latent",
                     id="kv_latent-width"),
        pytest.param(lambda a: {**a, "k_rope": a["k_rope"][:2]}, "k_rope", id="k_rope-rows"),
        pytest.param(lambda a: {**a, "k_rope": a["k_rope"][None]}, "k_rope", id="k_rope-4d"),
        pytest.param(lambda a: {**a, "k_rope": a["k_rope"].to("meta")}, "k_rope",
                     id="k_rope-device"),
        pytest.param(lambda a: {**a, "slots": a["slots"][:-1]}, "slots", id="slots-length"),
        pytest.param(lambda a: {**a, "block_ids": a["block_ids"].float()}, "block_ids",
                     id="block_ids-float"),
        pytest.param(lambda a: {**a, "slots": a["slots"].to("meta")}, "slots", id="slots-device"),
    ]


@pytest.mark.parametrize("mutate,argname", _bad_inputs())
def test_bad_inputs_raise(mutate, argname):
    args = dict(latent_cache=torch.zeros(2, 4, 4, 12, device=DEVICE)[1],
                kv_latent=torch.zeros(3, 8, device=DEVICE), k_rope=torch.zeros(3, 4, device=DEVICE),
                block_ids=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                slots=torch.zeros(3, dtype=torch.int64, device=DEVICE))
    args = mutate(args)
    with pytest.raises(ValueError, match=rf"^{argname}\b"):
        mla_latent_append(**args, backend="torch")
    with pytest.raises(ValueError, match=rf"^{argname}\b"):
        mla_latent_append(**args, backend="triton")


def _op_args():
    case = dict(rank=12, rope=4, block_size=4, num_blocks=5, tokens="decode:2+prefill:5+pad:2",
                layout="fused")
    return build(case, torch.float32)


def test_custom_op_matches_reference():
    buffer, kv_latent, k_rope, block_ids, slots = _op_args()
    expected = buffer.clone()
    mla_latent_append_ref(cache_view(expected), kv_latent, k_rope, block_ids, slots)
    mla_latent_append_op(cache_view(buffer), kv_latent, k_rope, block_ids, slots)
    assert torch.equal(bits(buffer), bits(expected))


def test_custom_op_opcheck():
    buffer, kv_latent, k_rope, block_ids, slots = _op_args()
    torch.library.opcheck(mla_latent_append_op, (cache_view(buffer.nan_to_num()),
                                                 kv_latent.nan_to_num(), k_rope.nan_to_num(),
                                                 block_ids, slots))


def test_custom_op_compiles():
    buffer, kv_latent, k_rope, block_ids, slots = _op_args()
    expected = buffer.clone()
    mla_latent_append_ref(cache_view(expected), kv_latent, k_rope, block_ids, slots)

    def step(buffer, kv_latent, k_rope, block_ids, slots):
        mla_latent_append_op(buffer[LAYER, 1:-1], kv_latent, k_rope, block_ids, slots)
        return buffer.sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(buffer, kv_latent, k_rope, block_ids,
                                                             slots)
    assert torch.equal(bits(buffer), bits(expected))
