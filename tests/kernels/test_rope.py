"""fused_qk_rope: the Triton kernel against the torch reference, the reference against Megatron.

Run: TRITON_INTERPRET=1 python -m pytest -q -m interpreter tests/kernels/test_rope.py
(on a GPU the same tests run compiled on CUDA tensors).

Tolerance (``rope_tolerance`` in ``tests/tolerances.py``): the reference runs in fp32 on the fp32
upcast of the very inputs the kernel sees, and the kernel's result must be within one ulp of its own
dtype of that fp32 value, plus 8 fp32 eps times the input scale. One ulp because the GPU rounds
fp32 -> bf16 to nearest even (<= 0.5 ulp) while the Triton interpreter truncates (< 1 ulp); the eps
term covers cos/sin computed by a different libm (numpy or libdevice vs torch) and FMA contraction.
In fp32 that is a few ulps. Everything the kernel must not write (rows >= n, dims >= rot,
neighbouring tensors of a fused qkv buffer) is compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from kernel_test_utils import assert_only_views_written, assert_rotated_heads, preset_configs
from tolerances import assert_rope_close

from dynctx.kernels import autotune
from dynctx.kernels.backend import triton_interpreting
from dynctx.kernels.rope import (
    cos_sin_cache_from_freqs,
    fused_qk_rope,
    fused_qk_rope_ref,
    make_rope_tables,
)

pytestmark = pytest.mark.interpreter

rope = importlib.import_module("dynctx.kernels.rope")
rope_flashinfer = importlib.import_module("dynctx.kernels.rope_flashinfer")

DEVICE = "cpu" if triton_interpreting() or not torch.cuda.is_available() else "cuda"
MAX_POS = 64


@dataclasses.dataclass(frozen=True)
class Case:
    n: int = 5
    guard_rows: int = 2
    heads_q: int = 3
    heads_k: int = 2
    dim: int = 16
    rot: int = 16
    layout: str = "neox"
    table: str = "freqs"
    dtype: torch.dtype = torch.float32
    mscale: float = 1.0
    storage: str = "contiguous"
    positions: str = "random"
    query: bool = True
    key: bool = True


def _param(case: Case, id_: str):
    return pytest.param(case, id=id_)


CASES = [
    _param(Case(n=0), "zero_tokens"),
    _param(Case(n=1), "one_token"),
    _param(Case(n=7), "odd_7_tokens"),
    _param(Case(n=6, positions="near_max"), "near_max_pos"),
    _param(Case(layout="gptj"), "interleaved"),
    _param(Case(layout="mla"), "mla_layout"),
    _param(Case(layout="mla_gptj"), "mla_layout_interleaved"),
    _param(Case(table="cos_sin"), "cos_sin_neox"),
    _param(Case(table="cos_sin", layout="gptj"), "cos_sin_interleaved"),
    _param(Case(table="cos_sin", layout="mla"), "cos_sin_mla"),
    _param(Case(table="cos_sin", layout="mla_gptj"), "cos_sin_mla_interleaved"),
    _param(Case(dim=24, rot=8), "partial_rotary_neox"),
    _param(Case(dim=20, rot=12, layout="gptj"), "partial_rotary_12_of_20_interleaved"),
    _param(Case(dim=24, rot=12, layout="mla", table="cos_sin"), "partial_rotary_mla_cos_sin"),
    _param(Case(mscale=1.37), "mscale_freqs"),
    _param(Case(mscale=0.7, table="cos_sin", layout="gptj"), "mscale_cos_sin"),
    _param(Case(key=False), "query_only"),
    _param(Case(query=False), "key_only"),
    _param(Case(query=False, layout="mla", heads_k=1), "key_only_single_head_mla"),
    _param(Case(storage="fused_qkv"), "fused_qkv_slices"),
    _param(Case(storage="fused_qkv", layout="gptj", key=False), "fused_qkv_query_only"),
    _param(Case(storage="singleton_dim"), "singleton_dim_4d"),
    _param(Case(storage="padded_heads", layout="mla"), "padded_head_stride"),
    _param(Case(heads_q=9, heads_k=5, n=3), "many_heads"),
    _param(Case(dtype=torch.float16), "fp16"),
    _param(Case(dtype=torch.bfloat16), "bf16"),
    _param(Case(dtype=torch.bfloat16, layout="gptj", table="cos_sin", mscale=1.2), "bf16_cos_sin"),
    _param(Case(dtype=torch.float16, layout="mla", storage="fused_qkv"), "fp16_mla_fused_qkv"),
    _param(Case(dtype=torch.bfloat16, dim=24, rot=8, storage="singleton_dim"), "bf16_partial_4d"),
    _param(Case(dtype=torch.bfloat16, layout="mla_gptj", positions="near_max"), "bf16_mla_gptj"),
]


def _storage(case: Case, generator: torch.Generator):
    """Random base buffer and a function giving the (query, key) views into it."""
    rows, hq, hk, dim = case.n + case.guard_rows, case.heads_q, case.heads_k, case.dim
    if case.storage == "contiguous":
        shape = (rows * (hq + hk) * dim,)

        def views(base):
            return (base[: rows * hq * dim].view(rows, hq, dim),
                    base[rows * hq * dim:].view(rows, hk, dim))
    elif case.storage == "fused_qkv":
        shape = (rows, (hq + 2 * hk) * dim)

        def views(base):
            return (base[:, : hq * dim].view(rows, hq, dim),
                    base[:, hq * dim: (hq + hk) * dim].view(rows, hk, dim))
    elif case.storage == "singleton_dim":
        shape = (rows, 1, hq + hk, dim)

        def views(base):
            return base[:, :, :hq], base[:, :, hq:]
    else:
        shape = (rows, hq + hk, dim + 5)

        def views(base):
            return base[:, :hq, :dim], base[:, hq:, :dim]
    base = (torch.rand(shape, generator=generator) * 2 - 1).to(DEVICE, case.dtype)
    return base, views


def _positions(case: Case, generator: torch.Generator) -> torch.Tensor:
    if case.positions == "near_max":
        positions = MAX_POS - 1 - torch.randint(0, 3, (case.n,), generator=generator)
    else:
        positions = torch.randint(0, MAX_POS, (case.n,), generator=generator)
    return positions.to(DEVICE)


def _tables(case: Case) -> dict:
    freqs, cos_sin = make_rope_tables(MAX_POS, case.rot, case.layout in ("gptj", "mla_gptj"),
                                      device=DEVICE)
    return {"freqs": freqs} if case.table == "freqs" else {"cos_sin_cache": cos_sin}


def _flags(case: Case) -> dict:
    return {"interleaved": case.layout in ("gptj", "mla_gptj"),
            "mla_layout": case.layout.startswith("mla"), "mscale": case.mscale}


def run_and_check(case: Case, config=None) -> None:
    generator = torch.Generator().manual_seed(1234)
    base, views = _storage(case, generator)
    positions = _positions(case, generator)
    snapshot = base.clone()
    query, key = views(base)
    query, key = (query if case.query else None), (key if case.key else None)
    expected = [None if x is None else x.float().clone() for x in (query, key)]
    fused_qk_rope_ref(*expected, positions, **_tables(case), **_flags(case))

    fused_qk_rope(query, key, positions, **_tables(case), **_flags(case), config=config,
                  backend="triton")

    n, rot = case.n, case.rot
    for name, got, want, before in zip(("query", "key"), (query, key), expected, views(snapshot)):
        if got is None:
            continue
        got, want, before = (t[:, 0] if t.dim() == 4 else t for t in (got, want, before))
        assert_rotated_heads(name, got, want, before, n, rot, case.mscale)
    assert_only_views_written(base, snapshot, views, (case.query, case.key),
                              "bytes outside query/key were written")


@pytest.mark.parametrize("case", CASES)
def test_fused_qk_rope_matches_reference(case):
    run_and_check(case)


CONFIGS = preset_configs("fused_qk_rope")


@pytest.mark.parametrize("config", [pytest.param(c, id=str(c)) for c in CONFIGS])
def test_every_config(config):
    index = CONFIGS.index(config)
    layout = rope.LAYOUTS[index % 4]
    case = Case(n=6, heads_q=5, heads_k=2, dim=24, rot=16, layout=layout,
                table=rope.TABLES[(index // 4) % 2],
                dtype=(torch.float32, torch.bfloat16, torch.float16)[index % 3])
    run_and_check(case, config=config)


def test_defaults_lie_in_search_space():
    tuning = autotune.get_tuning("fused_qk_rope")
    keys = tuning.presets() + [
        rope.fused_qk_rope_tune_key(num_tokens=n, num_q_heads=hq, num_k_heads=hk, head_dim=d,
                                    rot_dim=r, layout="gptj", table="cos_sin", dtype=torch.float16)
        for n in (0, 3, 100, 5000) for hq, hk, d, r in ((1, 0, 16, 16), (0, 1, 64, 32),
                                                        (64, 64, 256, 256), (8, 1, 512, 512))]
    for key in keys:
        assert tuning.default_config(key) in tuning.configs(key), key
    assert {key["num_tokens"] for key in keys} >= {1, 4, 128, 8192}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("layout", ["neox", "gptj", "mla", "mla_gptj"])
@pytest.mark.parametrize("mscale,dim,rot", [pytest.param(1.0, 16, 16, id="full"),
                                            pytest.param(1.25, 24, 16, id="mscale_partial")])
def test_reference_is_megatron(layout, mscale, dim, rot):
    """fp32: our reference equals Megatron's _apply_rotary_pos_emb_bshd bit for bit, and the
    kernel is within the stated tolerance of it. megatron-core is a test dependency (CI has
    it); the GPU machine does not, where this comparison is skipped."""
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils",
                                     reason="megatron-core is not installed here")
    _apply_rotary_pos_emb_bshd = rope_utils._apply_rotary_pos_emb_bshd

    interleaved, mla = layout in ("gptj", "mla_gptj"), layout.startswith("mla")
    generator = torch.Generator().manual_seed(7)
    n, heads = 6, 3
    x = torch.rand(n, heads, dim, generator=generator) * 2 - 1
    positions = torch.randint(0, MAX_POS, (n,), generator=generator)
    freqs, _ = make_rope_tables(MAX_POS, rot, interleaved)
    megatron = _apply_rotary_pos_emb_bshd(x.unsqueeze(1), freqs[positions],
                                          rotary_interleaved=interleaved,
                                          multi_latent_attention=mla, mscale=mscale).squeeze(1)
    ours = x.clone()
    fused_qk_rope_ref(ours, None, positions, freqs=freqs, interleaved=interleaved,
                      mscale=mscale, mla_layout=mla)
    assert torch.equal(ours, megatron)
    kernel = x.clone().to(DEVICE)
    fused_qk_rope(kernel, None, positions.to(DEVICE), freqs=freqs.to(DEVICE),
                  interleaved=interleaved, mscale=mscale, mla_layout=mla, backend="triton")
    assert_rope_close(kernel.cpu(), megatron, mscale)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_table_forms_agree(interleaved):
    """freqs [P, 1, 1, rot], freqs [P, rot] and the derived cos_sin_cache rotate alike."""
    generator = torch.Generator().manual_seed(3)
    x = (torch.rand(4, 2, 16, generator=generator) * 2 - 1).to(DEVICE)
    positions = torch.tensor([0, 5, 63, 17], device=DEVICE)
    freqs, _ = make_rope_tables(MAX_POS, 16, interleaved, device=DEVICE)
    outs = [x.clone() for _ in range(3)]
    for out, table in zip(outs, ({"freqs": freqs}, {"freqs": freqs[:, 0, 0]},
                                 {"cos_sin_cache": cos_sin_cache_from_freqs(freqs, interleaved)})):
        fused_qk_rope(out, None, positions, interleaved=interleaved, backend="triton", **table)
    assert torch.equal(outs[0], outs[1])
    assert_rope_close(outs[2], outs[0].float(), 1.0)


def test_zero_tokens_launches_nothing(monkeypatch):
    monkeypatch.setattr(rope, "_fused_qk_rope_kernel", None)
    query = torch.ones(3, 2, 8, device=DEVICE)
    freqs, _ = make_rope_tables(MAX_POS, 8, False, device=DEVICE)
    fused_qk_rope(query, None, torch.zeros(0, dtype=torch.int64, device=DEVICE), freqs=freqs,
                  backend="triton")
    assert torch.equal(query, torch.ones_like(query))


def _bad_inputs():
    q = torch.zeros(4, 2, 8)
    k = torch.zeros(4, 1, 8)
    pos = torch.zeros(3, dtype=torch.int64)
    freqs, cos_sin = make_rope_tables(16, 8, False)
    ok = dict(query=q, key=k, positions=pos, freqs=freqs)
    cases = {
        "positions_float": (dict(ok, positions=pos.float()), "positions"),
        "positions_2d": (dict(ok, positions=pos[None]), "positions"),
        "no_tensors": (dict(ok, query=None, key=None), "query and key"),
        "no_table": (dict(ok, freqs=None), "cos_sin_cache and freqs"),
        "two_tables": (dict(ok, cos_sin_cache=cos_sin), "cos_sin_cache and freqs"),
        "table_fp16": (dict(ok, freqs=None, cos_sin_cache=cos_sin.half()), "cos_sin_cache"),
        "table_3d": (dict(ok, freqs=freqs[:, 0]), "freqs"),
        "odd_rot": (dict(ok, freqs=freqs[..., :7]), "freqs"),
        "rot_over_dim": (dict(ok, freqs=make_rope_tables(16, 10, False)[0]), "query head dim"),
        "query_int": (dict(ok, query=q.int()), "query"),
        "query_2d": (dict(ok, query=q[:, 0]), "query"),
        "query_4d_wide": (dict(ok, query=q.view(4, 2, 1, 8)), "query"),
        "query_short": (dict(ok, query=q[:2]), "query"),
        "key_dtype": (dict(ok, key=k.half()), "key"),
        "key_dim": (dict(ok, key=torch.zeros(4, 1, 10)), "key"),
        "backend": (dict(ok, backend="cuda"), "backend"),
    }
    return [pytest.param(kwargs, match, id=name) for name, (kwargs, match) in cases.items()]


@pytest.mark.parametrize("kwargs,match", _bad_inputs())
def test_bad_inputs_raise_value_error(kwargs, match):
    kwargs = dict(kwargs)
    kwargs.setdefault("backend", "triton")
    args = [kwargs.pop(name) for name in ("query", "key", "positions")]
    with pytest.raises(ValueError, match=match):
        fused_qk_rope(*args, **kwargs)


def test_flashinfer_route():
    """Without CUDA (here) the FlashInfer route names what is missing; with CUDA and no
    flashinfer it names flashinfer; with both it must agree with the reference."""
    assert not rope_flashinfer.flashinfer_rope_available("cpu")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(11)
    q = (torch.rand(3, 4, 16, generator=generator) * 2 - 1).to(device)
    k = (torch.rand(3, 2, 16, generator=generator) * 2 - 1).to(device)
    positions = torch.tensor([0, 9, 31], device=device)
    _, cos_sin = make_rope_tables(32, 16, False, device=device)
    if device == "cpu":
        assert not rope_flashinfer.flashinfer_rope_available("cuda")
        with pytest.raises(RuntimeError, match="CUDA"):
            rope_flashinfer.apply_rope_flashinfer(q, k, positions, cos_sin, False)
    elif not rope_flashinfer.flashinfer_rope_available(device):
        with pytest.raises(RuntimeError, match="flashinfer"):
            rope_flashinfer.apply_rope_flashinfer(q, k, positions, cos_sin, False)
    else:
        expected = (q.clone(), k.clone())
        fused_qk_rope_ref(*expected, positions, cos_sin_cache=cos_sin)
        rope_flashinfer.apply_rope_flashinfer(q, k, positions, cos_sin, False)
        assert_rope_close(q, expected[0], 1.0)
        assert_rope_close(k, expected[1], 1.0)


def test_custom_op_matches_launcher():
    generator = torch.Generator().manual_seed(5)
    query = torch.rand(5, 1, 3, 16, generator=generator)
    key = torch.rand(5, 1, 2, 16, generator=generator)
    positions = torch.randint(0, MAX_POS, (4,), generator=generator)
    freqs, _ = make_rope_tables(MAX_POS, 16, True)
    expected = (query.clone(), key.clone())
    fused_qk_rope_ref(*expected, positions, freqs=freqs, interleaved=True, mscale=1.1)

    torch.ops.dynctx.fused_qk_rope(query, key, positions, None, freqs, True, 1.1, False)
    assert torch.equal(query, expected[0]) and torch.equal(key, expected[1])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def rotate_twice(q, k, pos, table):
        torch.ops.dynctx.fused_qk_rope(q, k, pos, None, table, True, 1.1, False)
        return q * 1

    again = rotate_twice(query, key, positions, freqs)
    fused_qk_rope_ref(*expected, positions, freqs=freqs, interleaved=True, mscale=1.1)
    assert torch.equal(again, expected[0]) and torch.equal(query, expected[0])
