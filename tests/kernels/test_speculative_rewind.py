"""speculative_rewind: the Triton launcher against its torch reference, bit-exact, over every
config, strided views, poisoned rows, guard bands and bad input; the reference against a copy
written row by row.

Run with ``TRITON_INTERPRET=1`` on a CPU (set before import) or compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, DTYPES, bits, check_presets_share_space, check_tune_case

from dynctx.kernels import autotune
from dynctx.kernels.speculative_rewind import (
    speculative_rewind,
    speculative_rewind_configs,
    speculative_rewind_default_config,
    speculative_rewind_op,
    speculative_rewind_presets,
    speculative_rewind_ref,
    speculative_rewind_tune_key,
)

pytestmark = pytest.mark.interpreter

GUARD = 1


def make_case(case: dict, dtypes, gen) -> dict:
    """The tensors of one call, each a view inside a larger buffer (guard slots, layers and
    entries around it); the state rows a restore writes are poisoned with NaN first.
    ``buffers`` holds what the checks compare whole."""
    n, layers, slots, k = case["n"], case["layers"], case["slots"], case["k"]
    conv_dtype, ssm_dtype = dtypes
    rejected = torch.tensor(case["rejected"], dtype=case.get("index_dtype", torch.int64))
    assert rejected.numel() == n
    args, buffers = {"rejected": rejected.to(DEVICE)}, {}
    if case.get("states", True):
        slot_ids = torch.randperm(slots, generator=gen)[:n].to(torch.int32)
        for i in case.get("pad", ()):
            slot_ids[i] = -1
        args["slot_ids"] = slot_ids.to(DEVICE, case.get("index_dtype", torch.int32))
        for name, shape, dtype in (("conv", case["conv"], conv_dtype),
                                   ("ssm", case["ssm"], ssm_dtype)):
            buffer = torch.randn(layers + 1, slots + 2 * GUARD, *shape, generator=gen).to(dtype)
            states = buffer[1:, GUARD:GUARD + slots]
            restored = ((rejected > 0) | case.get("all_rows", False)) & (slot_ids >= 0)
            states[:, slot_ids[restored].long()] = float("nan")
            inter = torch.randn(layers, k + 1, slots, *shape, generator=gen).to(dtype)
            if case.get("strided"):
                # [L, S, k + 1, *shape] as a permuted view: steps outermost in memory.
                inter = inter.transpose(1, 2)
            else:
                inter = inter.transpose(1, 2).contiguous()
            buffers[f"{name}_states"] = buffer.to(DEVICE)
            args[f"{name}_states"] = buffers[f"{name}_states"][1:, GUARD:GUARD + slots]
            args[f"{name}_intermediate"] = inter.to(DEVICE)
    if case.get("fields", True):
        extra = case.get("extra_rows", 2)
        step = 2 if case.get("strided") else 1
        for name in ("kv_offsets", "kv_lengths"):
            buffer = torch.randint(8, 1000, ((n + 2 * GUARD) * step,), generator=gen,
                                   dtype=torch.int32).to(DEVICE)
            buffers[name] = buffer
            args[name] = buffer[GUARD * step:(GUARD + n) * step:step]
        buffer = torch.randint(0, 1 << 20, (n + extra + 1 + 2 * GUARD,), generator=gen,
                               dtype=torch.int32).to(DEVICE)
        buffers["cu_kv"] = buffer
        args["cu_kv"] = buffer[GUARD:GUARD + n + extra + 1]
    return dict(args=args, buffers=buffers)


def views_of(case: dict, buffers: dict, args: dict) -> dict:
    """``args`` with each written tensor re-cut from the cloned ``buffers``."""
    out = dict(args)
    n, slots = case["n"], case["slots"]
    step = 2 if case.get("strided") else 1
    for name in ("conv_states", "ssm_states"):
        if name in buffers:
            out[name] = buffers[name][1:, GUARD:GUARD + slots]
    for name in ("kv_offsets", "kv_lengths"):
        if name in buffers:
            out[name] = buffers[name][GUARD * step:(GUARD + n) * step:step]
    if "cu_kv" in buffers:
        out["cu_kv"] = buffers["cu_kv"][GUARD:GUARD + args["cu_kv"].numel()]
    return out


def check(case: dict, dtypes, config=None, backend="triton") -> None:
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    made = make_case(case, dtypes, gen)
    expected = {name: buffer.clone() for name, buffer in made["buffers"].items()}
    all_rows = case.get("all_rows", False)
    speculative_rewind_ref(**views_of(case, expected, made["args"]), all_rows=all_rows)
    read_only = {name: made["args"][name].clone() for name in
                 ("rejected", "slot_ids", "conv_intermediate", "ssm_intermediate")
                 if name in made["args"]}
    speculative_rewind(**made["args"], config=config, backend=backend, all_rows=all_rows)
    for name, buffer in made["buffers"].items():
        # Whole buffers: restored rows, rows left alone, other layers, guard bands.
        assert torch.equal(bits(buffer), bits(expected[name])), name
    for name, before in read_only.items():
        assert torch.equal(made["args"][name].view(torch.uint8) if before.is_floating_point()
                           else made["args"][name], before.view(torch.uint8)
                           if before.is_floating_point() else before), f"{name} was written"


CONV, SSM = (6, 4), (2, 3, 5)
SHAPES = [
    pytest.param(dict(n=0, layers=2, slots=3, k=2, conv=CONV, ssm=SSM, rejected=[]), id="0req"),
    pytest.param(dict(n=1, layers=1, slots=2, k=1, conv=CONV, ssm=SSM, rejected=[1]),
                 id="1req-k1"),
    pytest.param(dict(n=5, layers=3, slots=7, k=3, conv=CONV, ssm=SSM, rejected=[0, 3, 1, 2, 3],
                      pad=(3,)), id="5req-pad"),
    pytest.param(dict(n=4, layers=2, slots=6, k=3, conv=CONV, ssm=SSM, rejected=[2, 0, 3, 1],
                      strided=True, index_dtype=torch.int32), id="4req-strided"),
    pytest.param(dict(n=3, layers=2, slots=4, k=2, conv=CONV, ssm=SSM, rejected=[0, 0, 0]),
                 id="nothing-rejected"),
    pytest.param(dict(n=3, layers=2, slots=4, k=2, conv=CONV, ssm=SSM, rejected=[5, -1, 2]),
                 id="out-of-range-clamped"),
    pytest.param(dict(n=4, layers=2, slots=6, k=2, conv=CONV, ssm=SSM, rejected=[0, 2, 0, 1],
                      pad=(2,), all_rows=True, fields=False), id="all-rows"),
    pytest.param(dict(n=6, layers=2, slots=8, k=3, conv=CONV, ssm=SSM, rejected=[1, 2, 3, 0, 1, 2],
                      fields=False), id="states-only"),
    pytest.param(dict(n=300, layers=1, slots=1, k=3, conv=CONV, ssm=SSM, states=False,
                      rejected=[i % 4 for i in range(300)], extra_rows=37), id="fields-only-300"),
    pytest.param(dict(n=2, layers=1, slots=2, k=2, conv=(5,), ssm=(3,), rejected=[1, 2],
                      extra_rows=0), id="1d-states-no-padding-rows"),
]
MIXED = (torch.bfloat16, torch.float32)   # NemotronH: bf16 conv states, fp32 SSM states


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES)
def test_matches_reference(case, dtype):
    check(case, (dtype, dtype))


@pytest.mark.parametrize("case", SHAPES[2:4])
def test_mixed_state_dtypes(case):
    check(case, MIXED)


# Conv rows of 4,140 and SSM rows of 2,100 elements: several chunks of every BLOCK_R but 8K.
CONFIG_CASE = dict(n=3, layers=2, slots=5, k=2, conv=(1035, 4), ssm=(3, 20, 35),
                   rejected=[1, 0, 2], pad=(2,))
CONFIG_KEY = speculative_rewind_tune_key(num_requests=3, conv_shape=(1035, 4),
                                         ssm_shape=(3, 20, 35), conv_dtype=torch.float32,
                                         ssm_dtype=torch.float32, fields=True)
ALL_CONFIGS = [pytest.param(c, id=str(c)) for c in speculative_rewind_configs(CONFIG_KEY)]


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_every_config(config):
    check(CONFIG_CASE, MIXED, config=config)


def test_every_config_fields_only():
    case = dict(SHAPES[8].values[0], n=20, rejected=[i % 3 for i in range(20)])
    key = speculative_rewind_tune_key(num_requests=20, fields=True)
    for config in speculative_rewind_configs(key):
        check(case, MIXED, config=config)


def test_config_space_covers_presets():
    key = speculative_rewind_tune_key(num_requests=1, conv_shape=(6144, 4),
                                      ssm_shape=(64, 64, 128), conv_dtype="bfloat16",
                                      ssm_dtype="bfloat16", fields=True)
    mamba = [p for p in speculative_rewind_presets() if p["conv_elems"]]
    check_presets_share_space(speculative_rewind_configs, speculative_rewind_default_config,
                              lambda: mamba, key)
    for preset in speculative_rewind_presets():
        assert speculative_rewind_default_config(preset) in speculative_rewind_configs(preset)


def test_default_config_in_space_and_key_buckets():
    for conv, ssm in (((), ()), ((5,), (3,)), (CONV, SSM), ((6144, 4), (64, 64, 128))):
        for n in (1, 37, 300):
            key = speculative_rewind_tune_key(num_requests=n, conv_shape=conv, ssm_shape=ssm,
                                              conv_dtype=None if not conv else torch.float16,
                                              ssm_dtype=None if not ssm else torch.float32)
            assert key["num_requests"] == autotune.bucket_tokens(n)
            assert speculative_rewind_default_config(key) in speculative_rewind_configs(key)


@pytest.mark.parametrize("fields", [0, 1])
@pytest.mark.parametrize("states", [True, False])
def test_tune_case_checks_and_runs(states, fields):
    if not states and not fields:
        return
    tuning = autotune.get_tuning("speculative_rewind")
    shapes = dict(conv_shape=(4, 300), ssm_shape=(2, 3, 50), conv_dtype=torch.bfloat16,
                  ssm_dtype=torch.float32) if states else {}
    key = tuning.tune_key(num_requests=3, fields=bool(fields), **shapes)
    check_tune_case(tuning, key, tuning.configs(key))


@pytest.mark.parametrize("case", [SHAPES[2], SHAPES[3], SHAPES[5], SHAPES[6]])
def test_torch_backend_matches_a_row_by_row_copy(case):
    """The torch backend runs the reference: compared with a rewind written independently, row
    by row, so that a wrong reference fails here."""
    gen = torch.Generator().manual_seed(0)
    made = make_case(case, (torch.float32, torch.float32), gen)
    args = made["args"]
    expected = {name: buffer.clone() for name, buffer in made["buffers"].items()}
    want = views_of(case, expected, args)
    k = case["k"]
    running = 0
    for i, count in enumerate(args["rejected"].tolist()):
        slot = int(args["slot_ids"][i])
        if (count > 0 or case.get("all_rows")) and slot >= 0:
            for name in ("conv", "ssm"):
                for layer in range(case["layers"]):
                    want[f"{name}_states"][layer, slot] = \
                        args[f"{name}_intermediate"][layer, slot, min(max(k - count, 0), k)]
        running += count
        if "kv_offsets" not in want:
            continue
        want["kv_offsets"][i] -= count
        want["kv_lengths"][i] -= count
        want["cu_kv"][i + 1] -= running
    if "cu_kv" in want:
        want["cu_kv"][case["n"] + 1:] -= running
    speculative_rewind(**args, backend="torch", all_rows=case.get("all_rows", False))
    for name, buffer in made["buffers"].items():
        assert torch.equal(bits(buffer), bits(expected[name])), name


def _base_args() -> dict:
    layers, slots, k = 2, 4, 2
    return dict(rejected=torch.tensor([1, 0, 2], device=DEVICE),
                slot_ids=torch.tensor([3, -1, 0], dtype=torch.int32, device=DEVICE),
                conv_states=torch.zeros(layers, slots, 3, 2, device=DEVICE),
                ssm_states=torch.zeros(layers, slots, 2, 2, device=DEVICE),
                conv_intermediate=torch.ones(layers, slots, k + 1, 3, 2, device=DEVICE),
                ssm_intermediate=torch.ones(layers, slots, k + 1, 2, 2, device=DEVICE),
                kv_offsets=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                kv_lengths=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                cu_kv=torch.zeros(5, dtype=torch.int32, device=DEVICE))


def _bad_inputs():
    """(mutation, the argument the error names first)."""
    return [
        pytest.param(lambda a: {**a, "rejected": a["rejected"].float()}, "rejected",
                     id="rejected-float"),
        pytest.param(lambda a: {**a, "rejected": a["rejected"][None]}, "rejected",
                     id="rejected-2d"),
        pytest.param(lambda a: {**a, "slot_ids": a["slot_ids"][:2]}, "slot_ids",
                     id="slot_ids-rows"),
        pytest.param(lambda a: {**a, "slot_ids": a["slot_ids"].to("meta")}, "slot_ids",
                     id="slot_ids-device"),
        pytest.param(lambda a: {**a, "slot_ids": None}, "slot_ids", id="slot_ids-missing"),
        pytest.param(lambda a: {**a, "ssm_intermediate": None}, "ssm_intermediate",
                     id="ssm_intermediate-missing"),
        pytest.param(lambda a: {**a, "conv_states": a["conv_states"].int()}, "conv_states",
                     id="conv_states-dtype"),
        pytest.param(lambda a: {**a, "conv_states": a["conv_states"][:, :, 0, 0]},
                     "conv_states", id="conv_states-2d"),
        pytest.param(lambda a: {**a, "ssm_states": a["ssm_states"][:1]}, "ssm_states",
                     id="ssm_states-layers"),
        pytest.param(lambda a: {**a, "conv_intermediate": a["conv_intermediate"].half()},
                     "conv_intermediate", id="conv_intermediate-dtype"),
        pytest.param(lambda a: {**a, "conv_intermediate": a["conv_intermediate"][:, :3]},
                     "conv_intermediate", id="conv_intermediate-slots"),
        pytest.param(lambda a: {**a, "ssm_intermediate": a["ssm_intermediate"][:, :, :2]},
                     "ssm_intermediate", id="intermediate-steps-differ"),
        pytest.param(lambda a: {**a, "conv_states": a["conv_states"][:, :1].expand(2, 4, 3, 2)},
                     "conv_states", id="conv_states-stride0"),
        pytest.param(lambda a: {**a, "kv_offsets": a["kv_offsets"].long()}, "kv_offsets",
                     id="kv_offsets-dtype"),
        pytest.param(lambda a: {**a, "kv_lengths": a["kv_lengths"][:2]}, "kv_lengths",
                     id="kv_lengths-rows"),
        pytest.param(lambda a: {**a, "cu_kv": a["cu_kv"][:3]}, "cu_kv", id="cu_kv-short"),
        pytest.param(lambda a: {**a, "cu_kv": None}, "cu_kv", id="cu_kv-missing"),
    ]


@pytest.mark.parametrize("mutate,argname", _bad_inputs())
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_raise_and_write_nothing(mutate, argname, backend):
    args = mutate(_base_args())
    before = {name: value.clone() for name, value in args.items()
              if isinstance(value, torch.Tensor) and value.device.type != "meta"}
    with pytest.raises(ValueError, match=rf"^{argname}\b"):
        speculative_rewind(**args, backend=backend)
    for name, value in before.items():
        assert torch.equal(args[name], value), f"a refused call wrote into {name}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unmergeable_state_rows_are_refused(backend):
    args = _base_args()
    states = torch.zeros(2, 2, 3, 4, 5, 4, device=DEVICE).permute(0, 5, 2, 4, 1, 3)
    args["conv_states"] = states
    args["conv_intermediate"] = torch.ones(2, 4, 3, 2, 5, 2, 3, device=DEVICE)
    with pytest.raises(ValueError, match=r"^conv_intermediate|^states strides"):
        speculative_rewind(**args, backend=backend)
    assert not states.any()


def test_custom_op_matches_reference_and_opchecks():
    args = _base_args()
    args["conv_intermediate"] = torch.arange(args["conv_intermediate"].numel(),
                                             dtype=torch.float32).view_as(
        args["conv_intermediate"]).to(DEVICE)
    args["cu_kv"] = torch.tensor([0, 5, 9, 14, 14], dtype=torch.int32, device=DEVICE)
    expected = {name: value.clone() for name, value in args.items()}
    speculative_rewind_ref(**expected)
    names = ("rejected", "slot_ids", "conv_states", "ssm_states", "conv_intermediate",
             "ssm_intermediate", "kv_offsets", "kv_lengths", "cu_kv")
    torch.library.opcheck(speculative_rewind_op, tuple(args[n].clone() for n in names))
    speculative_rewind_op(*(args[n] for n in names))
    for name in names:
        assert torch.equal(args[name], expected[name]), name
    assert args["cu_kv"].tolist() == [0, 4, 8, 11, 11]
