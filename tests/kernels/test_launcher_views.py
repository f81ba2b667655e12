"""Every launcher honours the strides and storage offset of every tensor argument.

For each launcher, each of its tensor arguments is replaced in turn by a view holding the same
values in another layout (every dim strided, and from 2-D on every dim reversed in memory), and
then every argument at once (storage offsets, strided, reversed). The Triton kernel runs on the
views; the torch reference runs on contiguous copies of the same values. Outputs must match
(bit for bit for data movement, within the tolerances of ``tests/tolerances.py`` for rope and
log-softmax), inputs must be left as they were, and the memory around each view (its buffer's
other elements, poisoned) must be untouched. Outputs that are expanded views (several elements
at one address) are refused before anything is written.

Grids are tiny: a few programs per launch, so the whole file runs in seconds under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from kernel_test_utils import DEVICE, bits
from tolerances import LOG_SOFTMAX_TOLERANCE, assert_rope_close

from dynctx.kernels import (
    compact_requests,
    fused_qk_rope,
    kv_append,
    last_token_logits,
    mamba_state_gather,
    mamba_state_scatter,
    mla_latent_append,
    rope_kv_append,
    step_metadata,
    token_log_probs,
)
from dynctx.kernels.autotune import KernelConfig
from dynctx.kernels.rope import make_rope_tables

pytestmark = pytest.mark.interpreter

VIEWS = ("offset", "strided", "reversed")
OFFSET = 3


def _poison(buffer: torch.Tensor) -> None:
    if buffer.is_floating_point():
        buffer.fill_(float("nan"))
    else:
        buffer.view(torch.uint8).fill_(0x5A)


def make_view(values: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: a view of a poisoned ``buffer`` holding ``values`` in layout ``kind``.

    offset: contiguous, ``OFFSET`` elements into the storage; strided: every dim of stride
    2 x its contiguous stride, plus the offset; reversed: the dims laid out in reverse order
    (dim 0 fastest), plus the offset.
    """
    shape = tuple(values.shape)
    if kind == "offset":
        buffer = torch.empty(OFFSET + values.numel() + OFFSET, dtype=values.dtype, device=DEVICE)
        view = buffer[OFFSET:OFFSET + values.numel()].view(shape)
    elif kind == "strided":
        buffer = torch.empty([2 * s + 1 for s in shape], dtype=values.dtype, device=DEVICE)
        view = buffer[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
    elif kind == "reversed":
        numel = values.numel()
        buffer = torch.empty(OFFSET + numel + OFFSET, dtype=values.dtype, device=DEVICE)
        strides, step = [], 1
        for size in shape:
            strides.append(step)
            step *= size
        view = buffer.as_strided(shape, strides, OFFSET)
    else:
        raise ValueError(kind)
    _poison(buffer)
    view.copy_(values)
    return view, buffer


@dataclass
class LauncherCase:
    """One launcher call: its tensor arguments (contiguous), the other arguments, which tensors
    it writes, and how its outputs compare (``exact`` bits, else ``compare``)."""

    name: str
    tensors: dict[str, torch.Tensor]
    call: Callable[..., object]
    written: tuple[str, ...] = ()
    others: dict = field(default_factory=dict)
    compare: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None

    def viewable(self) -> list[tuple[str, str]]:
        """(argument, layout) pairs of the one-argument cases: strided, and reversed from 2-D
        on (a storage offset alone is covered by every argument at once, which is cheaper)."""
        return [(arg, kind) for arg, tensor in self.tensors.items() for kind in VIEWS[1:]
                if kind != "reversed" or tensor.dim() >= 2]


def _assert_same(name: str, got: torch.Tensor, want: torch.Tensor, case: LauncherCase) -> None:
    if case.compare is not None and got.is_floating_point():
        case.compare(name, got, want)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if got.is_floating_point():
        assert torch.equal(bits(got.contiguous()), bits(want.contiguous())), \
            f"{case.name}: {name} differs from the reference"
    else:
        assert torch.equal(got, want), \
            f"{case.name}: {name} differs from the reference:\n{got}\n{want}"


def run_with_views(case: LauncherCase, views: dict[str, str]) -> None:
    """Run ``case`` on Triton with ``views`` (argument -> layout) and compare with the reference."""
    expected_tensors = {name: t.clone() for name, t in case.tensors.items()}
    expected_result = case.call(**expected_tensors, **case.others, backend="torch")

    actual, buffers = {}, {}
    for name, tensor in case.tensors.items():
        if name in views:
            actual[name], buffers[name] = make_view(tensor, views[name])
        else:
            actual[name] = tensor.clone()
    buffers_before = {name: buffer.clone() for name, buffer in buffers.items()}
    result = case.call(**actual, **case.others, backend="triton")

    for name in case.tensors:
        _assert_same(name, actual[name], expected_tensors[name], case)
    for name, buffer in buffers.items():
        # Outside the view every element keeps its poison.
        outside = torch.ones_like(buffer, dtype=torch.bool)
        actual_view = actual[name]
        mask_view = outside.as_strided(actual_view.shape, actual_view.stride(),
                                       actual_view.storage_offset())
        mask_view.fill_(False)
        assert torch.equal(bits(buffer[outside]) if buffer.is_floating_point() else buffer[outside],
                           bits(buffers_before[name][outside]) if buffer.is_floating_point()
                           else buffers_before[name][outside]), \
            f"{case.name}: the launcher wrote outside the {views[name]} view of {name}"
    results = result if isinstance(result, tuple) else (result,)
    expected_results = expected_result if isinstance(expected_result, tuple) else (expected_result,)
    for i, (got, want) in enumerate(zip(results, expected_results)):
        if got is None or want is None:
            assert got is None and want is None
            continue
        _assert_same(f"result {i}", got, want, case)


def _rope_compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    # The cache may hold poison (NaN) where nothing is written: the same NaN in both.
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN at different places"
    assert_rope_close(got.nan_to_num(7.0), want.nan_to_num(7.0), 1.0, name)


def _softmax_compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **LOG_SOFTMAX_TOLERANCE, equal_nan=True, msg=name)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(DEVICE)


def _index(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


# Rope runs slowly under the interpreter: 4 tokens x 4 heads per program keeps its grid at 4.
ROPE_CONFIG = KernelConfig.make(BLOCK_T=4, BLOCK_H=4, num_warps=4)

# Targets of 5 tokens in a [3 blocks, 4 slots] cache, every (block, slot) distinct.
BLOCK_IDS, SLOTS = [2, 0, 2, 1, 0], [1, 3, 0, 2, 0]


def kv_append_case() -> LauncherCase:
    return LauncherCase(
        "kv_append",
        dict(key_cache=_randn(3, 4, 2, 8, seed=0), value_cache=_randn(3, 4, 2, 8, seed=1),
             key=_randn(5, 2, 8, seed=2), value=_randn(5, 2, 8, seed=3),
             block_ids=_index(BLOCK_IDS), slots=_index(SLOTS, torch.int64)),
        kv_append, written=("key_cache", "value_cache"))


def mla_latent_case() -> LauncherCase:
    return LauncherCase(
        "mla_latent_append",
        dict(latent_cache=_randn(3, 4, 12, seed=0), kv_latent=_randn(5, 8, seed=1),
             k_rope=_randn(5, 4, seed=2), block_ids=_index(BLOCK_IDS, torch.int64),
             slots=_index(SLOTS)),
        mla_latent_append, written=("latent_cache",))


def _rope_tables(interleaved: bool):
    freqs, cos_sin = make_rope_tables(16, 6, interleaved, device=DEVICE)
    return freqs[:, 0, 0].contiguous(), cos_sin


def rope_case(table: str, mla_layout: bool) -> LauncherCase:
    freqs, cos_sin = _rope_tables(False)
    tensors = dict(query=_randn(5, 3, 8, seed=0), key=_randn(5, 2, 8, seed=1),
                   positions=_index([0, 7, 15, 3, 9], torch.int64))
    tensors["cos_sin_cache" if table == "cos_sin" else "freqs"] = (
        cos_sin if table == "cos_sin" else freqs)
    return LauncherCase(f"fused_qk_rope-{table}-{'mla' if mla_layout else 'neox'}", tensors,
                        fused_qk_rope, written=("query", "key"),
                        others=dict(mla_layout=mla_layout, config=ROPE_CONFIG),
                        compare=_rope_compare)


def rope_kv_append_case() -> LauncherCase:
    freqs, _ = _rope_tables(True)
    return LauncherCase(
        "rope_kv_append",
        dict(query=_randn(5, 3, 8, seed=0), key=_randn(5, 2, 8, seed=1),
             value=_randn(5, 2, 8, seed=2), positions=_index([4, 1, 15, 0, 8]),
             key_cache=_randn(3, 4, 2, 8, seed=3), value_cache=_randn(3, 4, 2, 8, seed=4),
             # token 3 is padding (block -1): rotated, never appended
             block_ids=_index([2, 0, 2, -1, 0], torch.int64), slots=_index(SLOTS),
             freqs=freqs),
        rope_kv_append, written=("query", "key", "key_cache", "value_cache"),
        others=dict(interleaved=True, config=ROPE_CONFIG), compare=_rope_compare)


def mamba_gather_case() -> LauncherCase:
    return LauncherCase(
        "mamba_state_gather",
        dict(states=_randn(6, 2, 3, 5, seed=0), slot_ids=_index([4, -1, 0, 5]),
             out=_randn(4, 2, 3, 5, seed=1)),
        mamba_state_gather, written=("out",))


def mamba_scatter_case() -> LauncherCase:
    return LauncherCase(
        "mamba_state_scatter",
        dict(states=_randn(6, 3, 5, seed=0), slot_ids=_index([4, -1, 0, 5], torch.int64),
             src=_randn(4, 3, 5, seed=1)),
        mamba_state_scatter, written=("states",))


def last_token_case(log_softmax: bool) -> LauncherCase:
    # 3 requests own tokens [0, 2), [2, 3), [3, 7) of 7
    logits = _randn(7, 33, seed=0) * 4
    out = _randn(3, 33, seed=1)
    return LauncherCase(
        f"last_token_logits-{'log_softmax' if log_softmax else 'gather'}",
        dict(logits=logits, cu_query_lengths=_index([0, 2, 3, 7]), out=out),
        last_token_logits, written=("out",),
        others=dict(num_requests=3, log_softmax=log_softmax),
        compare=_softmax_compare if log_softmax else None)


def token_log_probs_case() -> LauncherCase:
    return LauncherCase(
        "token_log_probs",
        dict(logits=_randn(5, 33, seed=0) * 4, token_ids=_index([3, 0, 32, 17, 3], torch.int64)),
        token_log_probs, others=dict(return_full=True), compare=_softmax_compare)


def compaction_case(new_tokens_dtype=torch.int64) -> LauncherCase:
    src_table = torch.arange(30, dtype=torch.int32, device=DEVICE).view(6, 5)
    return LauncherCase(
        "compact_requests",
        dict(dst_block_table=torch.full((6, 5), -7, dtype=torch.int32, device=DEVICE),
             src_block_table=src_table,
             dst_next_tokens=torch.full((6,), -7, dtype=torch.int64, device=DEVICE),
             src_next_tokens=_index([10, 11, 12, 13, 14, 15], torch.int64),
             # rows 2.. were active: their tokens come from new_tokens
             new_tokens=_index([4, 5, 6, 99], new_tokens_dtype),
             plan_src=_index([3, 0, -1, 2, 4]), plan_append_col=_index([-1, 2, -1, 4, 0]),
             plan_append_block=_index([-1, 50, -1, 51, 52])),
        compact_requests, written=("dst_block_table", "dst_next_tokens"),
        others=dict(new_token_offset=2, num_rows=5, clear_rows=6))


def step_metadata_case() -> LauncherCase:
    # 2 decode rows, 2 prefill rows of 3 and 2 tokens; 7 tokens padded to 9, 4 rows padded to 5.
    def out(n):
        return torch.full((n,), -7, dtype=torch.int64, device=DEVICE)

    return LauncherCase(
        "step_metadata",
        dict(token_to_input_ids=out(9), token_to_pos_ids=out(9), token_to_request_idx=out(9),
             token_to_block_idx=out(9), token_to_position_in_request=out(9),
             token_to_local_position_within_kv_block=out(9),
             attn_block_table=torch.full((5, 3), -7, dtype=torch.int32, device=DEVICE),
             block_table=torch.arange(100, 112, dtype=torch.int32, device=DEVICE).view(4, 3),
             query_lengths=_index([1, 1, 3, 2]), kv_offsets=_index([5, 2, 0, 6]),
             cu_query_lengths=_index([0, 1, 2, 5, 7]),
             next_tokens=_index([41, 42, 43, 44], torch.int64),
             prompt_tokens=_index([51, 52, 53, 54, 55])),
        step_metadata,
        written=("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                 "token_to_block_idx", "token_to_position_in_request",
                 "token_to_local_position_within_kv_block", "attn_block_table"),
        others=dict(num_requests=4, num_decode=2, active_tokens=7, padded_tokens=9,
                    padded_requests=5, row_offset=1, block_size=4, dummy_block=99))


CASES = {
    "kv_append": kv_append_case,
    "mla_latent_append": mla_latent_case,
    "fused_qk_rope-cos_sin": lambda: rope_case("cos_sin", mla_layout=False),
    "fused_qk_rope-freqs-mla": lambda: rope_case("freqs", mla_layout=True),
    "rope_kv_append": rope_kv_append_case,
    "mamba_state_gather": mamba_gather_case,
    "mamba_state_scatter": mamba_scatter_case,
    "last_token_logits": lambda: last_token_case(False),
    "last_token_logits-log_softmax": lambda: last_token_case(True),
    "token_log_probs": token_log_probs_case,
    "compact_requests": compaction_case,
    "step_metadata": step_metadata_case,
}


def _single_view_params():
    params = []
    for case_name, make in CASES.items():
        for arg, kind in make().viewable():
            params.append(pytest.param(case_name, arg, kind, id=f"{case_name}-{arg}-{kind}"))
    return params


@pytest.mark.parametrize("case_name,arg,kind", _single_view_params())
def test_one_argument_as_a_view(case_name, arg, kind):
    run_with_views(CASES[case_name](), {arg: kind})


@pytest.mark.parametrize("kind", VIEWS)
@pytest.mark.parametrize("case_name", list(CASES))
def test_every_argument_as_a_view(case_name, kind):
    case = CASES[case_name]()
    views = {arg: (kind if kind != "reversed" or t.dim() >= 2 else "strided")
             for arg, t in case.tensors.items()}
    run_with_views(case, views)


def test_views_are_what_they_claim():
    """The layouts really are offset, strided and reversed (else the tests above prove little)."""
    values = torch.arange(24.0, device=DEVICE).view(2, 3, 4)
    offset, _ = make_view(values, "offset")
    strided, _ = make_view(values, "strided")
    reversed_, _ = make_view(values, "reversed")
    assert offset.storage_offset() == OFFSET and offset.is_contiguous()
    assert all(s % 2 == 0 for s in strided.stride()) and strided.storage_offset() > 0
    assert reversed_.stride() == (1, 2, 6) and reversed_.storage_offset() == OFFSET
    for view in (offset, strided, reversed_):
        assert torch.equal(view, values)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32,
                                   torch.uint32, torch.uint64], ids=str)
@pytest.mark.parametrize("kind", ["contiguous", "strided"])
def test_compaction_accepts_narrow_new_tokens(dtype, kind):
    """new_tokens of every integer dtype: widened to int64 in the kernel, no copy."""
    case = compaction_case(dtype)
    run_with_views(case, {} if kind == "contiguous" else {"new_tokens": "strided"})


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.float16, torch.complex64],
                         ids=str)
def test_compaction_refuses_other_new_token_dtypes_before_writing(dtype, backend):
    case = compaction_case()
    tensors = {name: t.clone() for name, t in case.tensors.items()}
    tensors["new_tokens"] = tensors["new_tokens"].to(dtype)
    before = {name: t.clone() for name, t in tensors.items()}
    with pytest.raises(ValueError, match=r"^new_tokens must be .*int8.*got"):
        compact_requests(**tensors, **case.others, backend=backend)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, before[name]), f"a refused call wrote {name}"


def test_issue_examples():
    """The three reported cases, as the issue states them."""
    # compact_requests with sampled[:, 0]: next input ids [4, 5, 6], not [4, 99, 5].
    sampled = _index([[4, 99], [5, 98], [6, 97]], torch.int64)
    src_table = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    dst_table = torch.empty_like(src_table)
    dst_tokens = torch.empty(3, dtype=torch.int64, device=DEVICE)
    plan = _index([0, 1, 2])
    compact_requests(dst_table, src_table, dst_tokens, torch.zeros(3, dtype=torch.int64,
                                                                   device=DEVICE),
                     sampled[:, 0], plan, _index([-1, -1, -1]), _index([0, 0, 0]),
                     new_token_offset=0, num_rows=3, clear_rows=3, backend="triton")
    assert dst_tokens.tolist() == [4, 5, 6]
    # token_log_probs with a strided token column: the same as with its contiguous copy.
    logits = _randn(3, 33, seed=5)
    got, _ = token_log_probs(logits, sampled[:, 0], backend="triton")
    want, _ = token_log_probs(logits, sampled[:, 0].contiguous(), backend="torch")
    torch.testing.assert_close(got, want, **LOG_SOFTMAX_TOLERANCE)
    # mamba_state_scatter with strided slot ids: rows land in slots 4 and 1 only.
    states = torch.zeros(6, 3, device=DEVICE)
    slots = _index([[4, 0], [1, 0]])[:, 0]
    mamba_state_scatter(states, slots, torch.ones(2, 3, device=DEVICE), backend="triton")
    assert states.sum(1).tolist() == [0, 3, 0, 0, 3, 0]


def _written_params():
    return [pytest.param(case_name, arg, id=f"{case_name}-{arg}")
            for case_name, make in CASES.items() for arg in make().written]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case_name,arg", _written_params())
def test_outputs_whose_elements_share_an_address_are_refused(case_name, arg, backend):
    """An output that is an expanded view (stride 0) is refused, naming it, before any write."""
    case = CASES[case_name]()
    tensors = {name: t.clone() for name, t in case.tensors.items()}
    tensors[arg] = tensors[arg][:1].expand_as(tensors[arg])
    before = {name: t.clone() for name, t in tensors.items()}
    with pytest.raises(ValueError, match=rf"^{arg} is written in place but dim 0 has stride 0"):
        case.call(**tensors, **case.others, backend=backend)
    for name, tensor in tensors.items():
        assert torch.equal(tensor.nan_to_num(-9.0) if tensor.is_floating_point() else tensor,
                           before[name].nan_to_num(-9.0) if tensor.is_floating_point()
                           else before[name]), f"a refused call wrote {name}"
