"""mamba_state_gather / mamba_state_scatter: Triton launchers vs the torch references, bit-exact,
with poisoned outputs and guard slots/rows.

Run with ``TRITON_INTERPRET=1`` on a CPU (set before import) or compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, DTYPES, bits, check_presets_share_space, check_tune_case

from dynctx.kernels import autotune
from dynctx.kernels.mamba_state import (
    mamba_state_configs,
    mamba_state_default_config,
    mamba_state_gather,
    mamba_state_gather_op,
    mamba_state_gather_ref,
    mamba_state_presets,
    mamba_state_scatter,
    mamba_state_scatter_op,
    mamba_state_scatter_ref,
    mamba_state_tune_key,
)

pytestmark = pytest.mark.interpreter

LAYERS, LAYER = 3, 1
GUARD = 1


def random_values(shape, dtype, gen) -> torch.Tensor:
    values = torch.randn(shape, generator=gen)
    if values.numel() >= 3:
        values.view(-1)[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    return values.to(DEVICE, dtype)


def make_slot_ids(case: dict, gen) -> torch.Tensor:
    """``n`` distinct slots in shuffled order, with ``-1`` at the positions ``case["pad"]``."""
    n, num_slots = case["n"], case["num_slots"]
    slot_ids = torch.randperm(num_slots, generator=gen)[:n].clone()
    for i in case.get("pad", ()):
        slot_ids[i] = -1
    return slot_ids.to(DEVICE, case.get("index_dtype", torch.int32))


def states_buffer(case: dict, dtype, gen, poison: bool) -> torch.Tensor:
    """``[L, num_slots + 2 guards, *state_shape]``: the states are ``buffer[LAYER, 1:-1]``."""
    shape = (LAYERS, case["num_slots"] + 2 * GUARD, *case["state"])
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return random_values(shape, dtype, gen)


def states_view(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[LAYER, GUARD:buffer.shape[1] - GUARD]


def check_gather(case: dict, dtype, config=None, backend="triton", with_out=True):
    gen = torch.Generator().manual_seed(0)
    buffer = states_buffer(case, dtype, gen, poison=False)
    slot_ids = make_slot_ids(case, gen)
    before = bits(buffer).clone()
    expected = mamba_state_gather_ref(states_view(buffer), slot_ids)
    n = slot_ids.numel()
    if with_out:
        # Guard rows around the output, which is poisoned.
        out_buffer = torch.full((n + 2 * GUARD, *case["state"]), float("nan"), dtype=dtype,
                                device=DEVICE)
        out = out_buffer[GUARD:GUARD + n]
        out_before = bits(out_buffer).clone()
        result = mamba_state_gather(states_view(buffer), slot_ids, out, config=config,
                                    backend=backend)
        assert result.data_ptr() == out.data_ptr() and result.shape == out.shape
        for guard in (slice(0, GUARD), slice(GUARD + n, None)):
            assert torch.equal(bits(out_buffer[guard]), out_before[guard]), "guard rows written"
    else:
        result = mamba_state_gather(states_view(buffer), slot_ids, config=config, backend=backend)
    assert result.shape == (n, *case["state"]) and result.dtype == dtype
    assert torch.equal(bits(result), bits(expected))
    valid = slot_ids >= 0
    assert torch.equal(bits(result[~valid]), bits(torch.zeros_like(result[~valid])))
    assert torch.equal(bits(buffer), before), "states were modified"


def check_scatter(case: dict, dtype, config=None, backend="triton"):
    gen = torch.Generator().manual_seed(0)
    buffer = states_buffer(case, dtype, gen, poison=True)
    slot_ids = make_slot_ids(case, gen)
    n, extra = slot_ids.numel(), case.get("extra_rows", 0)
    row = int(torch.tensor(case["state"]).prod())
    if case.get("row_strided"):
        # Rows of the source sit in a wider buffer: strided over rows, contiguous within one.
        src = random_values((n + extra, row + 7), dtype, gen)[:, :row].unflatten(1, case["state"])
    else:
        src = random_values((n + extra, *case["state"]), dtype, gen)
    src_before = bits(src).clone()
    expected = buffer.clone()
    mamba_state_scatter_ref(states_view(expected), slot_ids, src)
    mamba_state_scatter(states_view(buffer), slot_ids, src, config=config, backend=backend)
    # The whole buffer: written slots, untouched poisoned slots, other layers and guard slots.
    assert torch.equal(bits(buffer), bits(expected))
    assert torch.equal(bits(src), src_before), "src was modified"


CONV = (1030, 4)        # [conv_dim, d_conv], 4120 elements: every BLOCK_R of the space
SSM = (3, 40, 70)       # [nheads, headdim, d_state], 8400 elements
SHAPES = [
    pytest.param(dict(state=CONV, num_slots=4, n=0), id="0req"),
    pytest.param(dict(state=CONV, num_slots=4, n=1, index_dtype=torch.int64), id="1req-conv"),
    pytest.param(dict(state=SSM, num_slots=9, n=5), id="5req-ssm"),
    pytest.param(dict(state=SSM, num_slots=9, n=7, pad=(0, 4, 6), extra_rows=3, row_strided=True),
                 id="7req-pad-ssm-strided"),
    pytest.param(dict(state=CONV, num_slots=5, n=3, pad=(0, 1, 2)), id="all-pad"),
    pytest.param(dict(state=(5, 3), num_slots=40, n=37, pad=(36,), index_dtype=torch.int64),
                 id="37req-tiny-state"),
    pytest.param(dict(state=(37,), num_slots=6, n=6, pad=(2,)), id="1d-state"),
]

# The presets' space (conv 24576 and SSM 524288 elements) and this case's space are the same list.
CONFIG_CASE = dict(state=SSM, num_slots=9, n=5, pad=(3,))
CONFIG_KEY = mamba_state_tune_key(num_requests=5, state_shape=SSM, dtype=torch.bfloat16)
ALL_CONFIGS = [pytest.param(c, id=str(c)) for c in mamba_state_configs(CONFIG_KEY)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES)
def test_gather_matches_reference(case, dtype):
    check_gather(case, dtype)


@pytest.mark.parametrize("case", SHAPES[:4])
def test_gather_allocates_out(case):
    check_gather(case, torch.bfloat16, with_out=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES)
def test_scatter_matches_reference(case, dtype):
    check_scatter(case, dtype)


def test_config_space_covers_presets():
    check_presets_share_space(mamba_state_configs, mamba_state_default_config, mamba_state_presets,
                              CONFIG_KEY)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_gather_every_config(config, dtype):
    check_gather(CONFIG_CASE, dtype, config=config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_scatter_every_config(config, dtype):
    check_scatter(CONFIG_CASE, dtype, config=config)


@pytest.mark.parametrize("case", SHAPES[1:5])
def test_torch_backend_matches_a_row_by_row_copy(case):
    """The torch backend runs the references: compared with copies written independently, row
    by row (slot -1: a zero row gathered, nothing scattered), so a wrong reference fails here."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    buffer = states_buffer(case, dtype, gen, poison=False)
    states, slot_ids = states_view(buffer), make_slot_ids(case, gen)
    gathered = mamba_state_gather(states, slot_ids, backend="torch")
    assert gathered.shape == (slot_ids.numel(), *case["state"])
    for row, slot in enumerate(slot_ids.tolist()):
        want = states[slot] if slot >= 0 else torch.zeros_like(states[0])
        assert torch.equal(bits(gathered[row]), bits(want)), (row, slot)
    src = random_values((slot_ids.numel() + 1, *case["state"]), dtype, gen)
    expected = buffer.clone()
    for row, slot in enumerate(slot_ids.tolist()):
        if slot >= 0:
            states_view(expected)[slot] = src[row]
    mamba_state_scatter(states, slot_ids, src, backend="torch")
    assert torch.equal(bits(buffer), bits(expected))


def test_default_config_in_space_and_key_buckets():
    for shape in ((5,), (4, 300), CONV, SSM, (6144, 4), (64, 64, 128), (128, 64, 256)):
        for n in (1, 37, 300):
            key = mamba_state_tune_key(num_requests=n, state_shape=shape, dtype=torch.float32)
            assert key["num_requests"] == autotune.bucket_tokens(n)
            assert mamba_state_default_config(key) in mamba_state_configs(key)


@pytest.mark.parametrize("name", ["mamba_state_gather", "mamba_state_scatter"])
def test_tune_case_checks_and_runs(name):
    tuning = autotune.get_tuning(name)
    key = tuning.tune_key(num_requests=3, state_shape=(4, 300), dtype=torch.bfloat16)
    check_tune_case(tuning, key, tuning.configs(key))


def _base_args():
    states = torch.zeros(2, 6, 4, 3, device=DEVICE)[1]
    return dict(states=states, slot_ids=torch.tensor([2, -1, 0], dtype=torch.int32, device=DEVICE),
                rows=torch.zeros(3, 4, 3, device=DEVICE))


def _bad_inputs():
    """(mutation, argument named in the error, which launcher) triples."""
    both, gather, scatter = ("gather", "scatter"), ("gather",), ("scatter",)
    return [
        pytest.param(lambda a: {**a, "states": a["states"].int()}, "states", both,
                     id="states-dtype"),
        pytest.param(lambda a: {**a, "states": a["states"][:, 0, 0]}, "states", both,
                     id="states-1d"),
        pytest.param(lambda a: {**a, "slot_ids": a["slot_ids"].float()}, "slot_ids", both,
                     id="slot_ids-float"),
        pytest.param(lambda a: {**a, "slot_ids": a["slot_ids"][None]}, "slot_ids", both,
                     id="slot_ids-2d"),
        pytest.param(lambda a: {**a, "slot_ids": a["slot_ids"].to("meta")}, "slot_ids", both,
                     id="slot_ids-device"),
        pytest.param(lambda a: {**a, "rows": a["rows"][:2]}, "out", gather, id="out-rows"),
        pytest.param(lambda a: {**a, "rows": a["rows"][:, :3]}, "out", gather, id="out-shape"),
        pytest.param(lambda a: {**a, "rows": a["rows"].half()}, "out", gather, id="out-dtype"),
        pytest.param(lambda a: {**a, "rows": a["rows"].to("meta")}, "out", gather, id="out-device"),
        pytest.param(lambda a: {**a, "rows": a["rows"][:2]}, "src", scatter, id="src-rows"),
        pytest.param(lambda a: {**a, "rows": a["rows"][:, :, :2]}, "src", scatter, id="src-shape"),
        pytest.param(lambda a: {**a, "rows": a["rows"].double()}, "src", scatter, id="src-dtype"),
        pytest.param(lambda a: {**a, "rows": a["rows"].to("meta")}, "src", scatter,
                     id="src-device"),
    ]


@pytest.mark.parametrize("mutate,argname,launchers", _bad_inputs())
def test_bad_inputs_raise(mutate, argname, launchers):
    args = mutate(_base_args())
    for backend in ("torch", "triton"):
        if "gather" in launchers:
            with pytest.raises(ValueError, match=rf"^{argname}\b"):
                mamba_state_gather(args["states"], args["slot_ids"], args["rows"], backend=backend)
        if "scatter" in launchers:
            with pytest.raises(ValueError, match=rf"^{argname}\b"):
                mamba_state_scatter(args["states"], args["slot_ids"], args["rows"], backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_with_more_than_three_unmergeable_dims_are_refused(backend):
    """Strided rows are honoured (tests/kernels/test_launcher_views.py) while their strides merge
    into at most three dims; a row of four dims that no stride merges is refused, naming states,
    before anything is written."""
    states = torch.zeros(6, 2, 3, 4, 5, device=DEVICE).permute(0, 2, 4, 1, 3)
    rows = torch.ones(2, *states.shape[1:], device=DEVICE)
    slot_ids = torch.tensor([1, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^states strides .* at most 3"):
        mamba_state_gather(states, slot_ids, rows, backend=backend)
    with pytest.raises(ValueError, match=r"^states strides .* at most 3"):
        mamba_state_scatter(states, slot_ids, rows, backend=backend)
    assert not states.any(), "a refused scatter wrote into states"
    assert torch.equal(rows, torch.ones_like(rows)), "a refused gather wrote into out"


def _op_args():
    gen = torch.Generator().manual_seed(1)
    buffer = random_values((LAYERS, 8, 3, 5), torch.float32, gen).nan_to_num()
    slot_ids = torch.tensor([4, -1, 0, 5], dtype=torch.int32, device=DEVICE)
    src = random_values((4, 3, 5), torch.float32, gen).nan_to_num()
    return buffer, slot_ids, src


def test_custom_ops_match_reference():
    buffer, slot_ids, src = _op_args()
    expected = mamba_state_gather_ref(buffer[LAYER], slot_ids)
    assert torch.equal(mamba_state_gather_op(buffer[LAYER], slot_ids), expected)
    expected = buffer.clone()
    mamba_state_scatter_ref(expected[LAYER], slot_ids, src)
    mamba_state_scatter_op(buffer[LAYER], slot_ids, src)
    assert torch.equal(buffer, expected)


def test_custom_ops_opcheck():
    buffer, slot_ids, src = _op_args()
    torch.library.opcheck(mamba_state_gather_op, (buffer[LAYER], slot_ids))
    torch.library.opcheck(mamba_state_scatter_op, (buffer[LAYER], slot_ids, src))


def test_custom_ops_compile():
    buffer, slot_ids, src = _op_args()
    expected_gather = mamba_state_gather_ref(buffer[LAYER], slot_ids)
    expected = buffer.clone()
    mamba_state_scatter_ref(expected[LAYER], slot_ids, src)

    def step(buffer, slot_ids, src):
        gathered = mamba_state_gather_op(buffer[LAYER], slot_ids)
        mamba_state_scatter_op(buffer[LAYER], slot_ids, src)
        return gathered * 1

    gathered = torch.compile(step, backend="aot_eager", fullgraph=True)(buffer, slot_ids, src)
    assert torch.equal(gathered, expected_gather)
    assert torch.equal(buffer, expected)
