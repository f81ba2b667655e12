"""Mamba state gather and scatter: move the conv or SSM states of the active requests by slot.

``gather``: ``out[i] = states[slot_ids[i]]``, zero where ``slot_ids[i] == -1``.
``scatter``: ``states[slot_ids[i]] = src[i]``, skipped where ``slot_ids[i] == -1``.
A state is moved as one flat row of ``prod(state_shape)`` elements, so one kernel serves conv
states ``[slots, conv_dim, d_conv]`` and SSM states ``[slots, nheads, headdim, d_state]``.
Pure data movement: bit-exact in every dtype.
"""

from __future__ import annotations

import math

import torch

from . import autotune
from ._common import FLOAT_DTYPES, bits, check_writable, custom_op, next_pow2
from ._shapes import MAMBA2_CONV_STATE, MAMBA2_MIXER, MAMBA2_SSM_STATE
from .autotune import KernelConfig, KernelTuning, TuneCase
from .backend import HAS_TRITON, resolve_backend
from .devices import same_device
from .launch_plan import KernelLaunch, PlanCache

GATHER, SCATTER = "mamba_state_gather", "mamba_state_scatter"
# Per launch key (launch_plan.py): the checks passed, the config, the grid, the arguments
# (and for a gather into a new tensor, its shape).
_GATHER_PLANS, _SCATTER_PLANS = PlanCache(GATHER), PlanCache(SCATTER)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _state_offsets(offs_r, size_1, size_2, stride_0, stride_1, stride_2, FLAT: tl.constexpr):
        """Element offsets within one state row of flat indices ``offs_r`` (row-major order of a
        ``[size_0, size_1, size_2]`` row with the given strides); ``offs_r`` itself when FLAT."""
        if FLAT:
            return offs_r
        plane = size_1 * size_2
        return ((offs_r // plane) * stride_0 + ((offs_r % plane) // size_2) * stride_1
                + (offs_r % size_2) * stride_2)

    @triton.jit
    def _mamba_state_gather_kernel(
        out_ptr, states_ptr, slot_ids_ptr,
        row_elems, size_1, size_2,
        stride_out_row, stride_out_0, stride_out_1, stride_out_2,
        stride_states_slot, stride_states_0, stride_states_1, stride_states_2,
        stride_slot_ids,
        BLOCK_R: tl.constexpr, FLAT: tl.constexpr,
    ):
        """Copy BLOCK_R elements of state row ``slot_ids[i]`` to output row i (zeros for -1)."""
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ids_ptr + row * stride_slot_ids).to(tl.int64)
        offs_r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        # Slot -1 folds into the bound: the interpreter rejects a vector & scalar-bool mask.
        mask_slot = offs_r < tl.where(slot >= 0, row_elems, 0)
        offs_states = _state_offsets(offs_r, size_1, size_2, stride_states_0, stride_states_1,
                                     stride_states_2, FLAT)
        offs_out = _state_offsets(offs_r, size_1, size_2, stride_out_0, stride_out_1,
                                  stride_out_2, FLAT)
        values = tl.load(states_ptr + slot * stride_states_slot + offs_states, mask=mask_slot,
                         other=0)
        tl.store(out_ptr + row * stride_out_row + offs_out, values, mask=offs_r < row_elems)

    @triton.jit
    def _mamba_state_scatter_kernel(
        states_ptr, src_ptr, slot_ids_ptr,
        row_elems, size_1, size_2,
        stride_states_slot, stride_states_0, stride_states_1, stride_states_2,
        stride_src_row, stride_src_0, stride_src_1, stride_src_2,
        stride_slot_ids,
        BLOCK_R: tl.constexpr, FLAT: tl.constexpr,
    ):
        """Copy BLOCK_R elements of source row i to state row ``slot_ids[i]`` (skip -1)."""
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ids_ptr + row * stride_slot_ids).to(tl.int64)
        offs_r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = offs_r < tl.where(slot >= 0, row_elems, 0)
        offs_states = _state_offsets(offs_r, size_1, size_2, stride_states_0, stride_states_1,
                                     stride_states_2, FLAT)
        offs_src = _state_offsets(offs_r, size_1, size_2, stride_src_0, stride_src_1,
                                  stride_src_2, FLAT)
        values = tl.load(src_ptr + row * stride_src_row + offs_src, mask=mask)
        tl.store(states_ptr + slot * stride_states_slot + offs_states, values, mask=mask)


_MAX_ROW_DIMS = 3


def row_layout(states: torch.Tensor, other: torch.Tensor) -> tuple[tuple[int, ...], list, bool]:
    """The state row of ``states`` and ``other`` (same ``shape[1:]``) as at most three dims.

    Size-1 dims are dropped and neighbouring dims merged wherever both tensors allow it, so a
    contiguous row becomes one dim of stride 1. Returns ``(sizes, strides, flat)``: three sizes
    (leading 1s pad), the three strides of each tensor, and whether both rows are contiguous.
    Raises ``ValueError`` naming the tensor when more than three dims remain.
    """
    dims = [(size, (a, b)) for size, a, b in zip(states.shape[1:], states.stride()[1:],
                                                  other.stride()[1:]) if size != 1]
    merged: list = []
    for size, strides in dims:
        if merged:
            prev_size, prev_strides = merged[-1]
            if all(p == s * size for p, s in zip(prev_strides, strides)):
                merged[-1] = (prev_size * size, strides)
                continue
        merged.append((size, strides))
    if len(merged) > _MAX_ROW_DIMS:
        raise ValueError(
            f"states strides {states.stride()} and {other.stride()} of a row of shape "
            f"{tuple(states.shape[1:])} leave {len(merged)} dims that cannot be merged; at most "
            f"{_MAX_ROW_DIMS} are supported (make the rows contiguous)")
    merged = [(1, (0, 0))] * (_MAX_ROW_DIMS - len(merged)) + merged
    sizes = tuple(size for size, _ in merged)
    strides = [tuple(st[i] for _, st in merged) for i in range(2)]
    flat = sizes[:-1] == (1,) * (_MAX_ROW_DIMS - 1) and all(st[-1] == 1 for st in strides)
    return sizes, strides, flat


def _check_states(states: torch.Tensor, slot_ids: torch.Tensor) -> None:
    if states.dim() < 2:
        raise ValueError(f"states must be [num_slots, *state_shape], got {tuple(states.shape)}")
    if states.dtype not in FLOAT_DTYPES:
        raise ValueError(f"states dtype {states.dtype} is not one of {FLOAT_DTYPES}")
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids must be 1-D, got shape {tuple(slot_ids.shape)}")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids dtype {slot_ids.dtype} must be int32 or int64")
    if not same_device(slot_ids.device, states.device):
        raise ValueError(f"slot_ids is on {slot_ids.device}, states on {states.device}")


def _check_rows(name: str, tensor: torch.Tensor, states: torch.Tensor, exact_rows: int | None,
                min_rows: int) -> None:
    if tuple(tensor.shape[1:]) != tuple(states.shape[1:]):
        raise ValueError(f"{name} state shape {tuple(tensor.shape[1:])} != states' "
                         f"{tuple(states.shape[1:])}")
    if exact_rows is not None and tensor.shape[0] != exact_rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {exact_rows}")
    if tensor.shape[0] < min_rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, fewer than the {min_rows} slot ids")
    if tensor.dtype != states.dtype:
        raise ValueError(f"{name} dtype {tensor.dtype} != states dtype {states.dtype}")
    if not same_device(tensor.device, states.device):
        raise ValueError(f"{name} is on {tensor.device}, states on {states.device}")


def _resolve(name: str, config, states: torch.Tensor, n: int) -> KernelConfig:
    if config is not None:
        return config
    key = mamba_state_tune_key(num_requests=n, state_shape=states.shape[1:], dtype=states.dtype)
    return autotune.resolve_config(name, key, states.device)[0]


def mamba_state_gather(states: torch.Tensor, slot_ids: torch.Tensor,
                       out: torch.Tensor | None = None, *, config: KernelConfig | None = None,
                       backend: str | None = None) -> torch.Tensor:
    """Return ``[n, *state_shape]`` rows ``states[slot_ids[i]]``, zeros where the slot is -1.

    - ``states``: ``[num_slots, *state_shape]`` fp32/fp16/bf16, any strides (e.g.
      ``conv_states[layer]``). Read only.
    - ``slot_ids``: ``[n]`` int32/int64, any stride, ``-1`` or in range (not checked: that
      would sync).
    - ``out``: optional ``[n, *state_shape]`` of the states' dtype, any strides; written in
      place and returned. Otherwise a new contiguous tensor is returned.

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied. A row whose strides leave more than three unmergeable dims (``row_layout``) is
    refused with a ``ValueError`` before anything is written.
    """
    plan, plan_key = _GATHER_PLANS.find((states, slot_ids, out), (backend,), config,
                                        backend=backend)
    if plan is not None:
        launch, out_shape = plan
        if out is None:
            out = torch.empty(out_shape, dtype=states.dtype, device=states.device)
        launch.launch((out, states, slot_ids))
        return out
    _check_states(states, slot_ids)
    n = slot_ids.numel()
    if out is None:
        out = torch.empty((n, *states.shape[1:]), dtype=states.dtype, device=states.device)
    else:
        _check_rows("out", out, states, exact_rows=n, min_rows=n)
        check_writable(("out", out))
    sizes, (states_strides, out_strides), flat = row_layout(states, out)
    if n == 0:
        return out
    if resolve_backend(backend, states.device) == "torch":
        out.copy_(mamba_state_gather_ref(states, slot_ids))
        return out
    config = _resolve(GATHER, config, states, n)
    row_elems = math.prod(states.shape[1:])
    grid = (n, -(-row_elems // config.kwargs["BLOCK_R"]))
    pointers = dict(out_ptr=out, states_ptr=states, slot_ids_ptr=slot_ids)
    launch = KernelLaunch(_mamba_state_gather_kernel, grid, dict(
        **pointers, row_elems=row_elems, size_1=sizes[1], size_2=sizes[2],
        stride_out_row=out.stride(0), stride_out_0=out_strides[0], stride_out_1=out_strides[1],
        stride_out_2=out_strides[2],
        stride_states_slot=states.stride(0), stride_states_0=states_strides[0],
        stride_states_1=states_strides[1], stride_states_2=states_strides[2],
        stride_slot_ids=slot_ids.stride(0), FLAT=flat,
        **config.launch_kwargs(),
    ), pointers)
    _GATHER_PLANS.put(plan_key, (launch, tuple(out.shape)))
    return out


def mamba_state_scatter(states: torch.Tensor, slot_ids: torch.Tensor, src: torch.Tensor, *,
                        config: KernelConfig | None = None, backend: str | None = None) -> None:
    """Write ``states[slot_ids[i]] = src[i]`` for ``i < n``, skipping slot -1, in place.

    - ``states``: ``[num_slots, *state_shape]`` fp32/fp16/bf16, any strides. Written in place.
    - ``slot_ids``: ``[n]`` int32/int64, any stride, ``-1`` or in range and distinct (not
      checked).
    - ``src``: ``[>=n, *state_shape]`` of the states' dtype, any strides; rows past ``n``
      ignored.

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied. A row whose strides leave more than three unmergeable dims (``row_layout``) is
    refused with a ``ValueError`` before anything is written.
    """
    plan, plan_key = _SCATTER_PLANS.find((states, slot_ids, src), (backend,), config,
                                         backend=backend)
    if plan is not None:
        plan.launch((states, src, slot_ids))
        return
    _check_states(states, slot_ids)
    n = slot_ids.numel()
    _check_rows("src", src, states, exact_rows=None, min_rows=n)
    check_writable(("states", states))
    sizes, (states_strides, src_strides), flat = row_layout(states, src)
    if n == 0:
        return
    if resolve_backend(backend, states.device) == "torch":
        mamba_state_scatter_ref(states, slot_ids, src)
        return
    config = _resolve(SCATTER, config, states, n)
    row_elems = math.prod(states.shape[1:])
    grid = (n, -(-row_elems // config.kwargs["BLOCK_R"]))
    pointers = dict(states_ptr=states, src_ptr=src, slot_ids_ptr=slot_ids)
    _SCATTER_PLANS.put(plan_key, KernelLaunch(_mamba_state_scatter_kernel, grid, dict(
        **pointers, row_elems=row_elems, size_1=sizes[1], size_2=sizes[2],
        stride_states_slot=states.stride(0), stride_states_0=states_strides[0],
        stride_states_1=states_strides[1], stride_states_2=states_strides[2],
        stride_src_row=src.stride(0), stride_src_0=src_strides[0], stride_src_1=src_strides[1],
        stride_src_2=src_strides[2],
        stride_slot_ids=slot_ids.stride(0), FLAT=flat,
        **config.launch_kwargs(),
    ), pointers))


def mamba_state_gather_ref(states: torch.Tensor, slot_ids: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: index the valid slots, zeros elsewhere."""
    valid = slot_ids >= 0
    rows = states[slot_ids.long().clamp(min=0)]
    rows = torch.where(valid.view(-1, *[1] * (states.dim() - 1)), rows, torch.zeros_like(rows))
    if out is None:
        return rows
    out.copy_(rows)
    return out


def mamba_state_scatter_ref(states: torch.Tensor, slot_ids: torch.Tensor,
                            src: torch.Tensor) -> None:
    """Reference: one advanced-index assignment of the rows whose slot is not -1."""
    n = slot_ids.numel()
    valid = slot_ids >= 0
    states[slot_ids[valid].long()] = src[:n][valid]


_MIN_BLOCK_R = 1024


def mamba_state_configs(key: dict) -> list[KernelConfig]:
    """Search space: row elements per program (1K to 8K, no wider than the row) x warps."""
    widest = max(_MIN_BLOCK_R, next_pow2(key["row_elems"]))
    return [KernelConfig.make(BLOCK_R=block_r, num_warps=num_warps)
            for block_r in (1024, 2048, 4096, 8192) if block_r <= widest for num_warps in (4, 8)]


def mamba_state_default_config(key: dict) -> KernelConfig:
    """4K elements per program (or the row, if shorter), 8 warps from 4K on."""
    block_r = min(4096, max(_MIN_BLOCK_R, next_pow2(key["row_elems"])))
    return KernelConfig.make(BLOCK_R=block_r, num_warps=8 if block_r >= 4096 else 4)


def mamba_state_tune_key(*, num_requests: int, state_shape, dtype) -> dict:
    """Row length (``prod(state_shape)``) and dtype exact; the request count bucketed."""
    dtype = dtype if isinstance(dtype, str) else autotune.dtype_name(dtype)
    return {"num_requests": autotune.bucket_tokens(num_requests),
            "row_elems": int(math.prod(state_shape)), "dtype": dtype}


def mamba_state_presets() -> list[dict]:
    """Conv and SSM states of a NemotronH-style Mamba2 layer (bf16) for 1 to 256 requests."""
    return [mamba_state_tune_key(num_requests=n, state_shape=shape, dtype=MAMBA2_MIXER["dtype"])
            for shape in (MAMBA2_CONV_STATE, MAMBA2_SSM_STATE) for n in (1, 16, 64, 256)]


for _name in (GATHER, SCATTER):
    autotune.register(KernelTuning(
        name=_name, configs=mamba_state_configs, default_config=mamba_state_default_config,
        tune_key=mamba_state_tune_key, token_field="num_requests",
        make_case=lambda key, device, _name=_name: MambaStateCase(_name, key, device),
        presets=mamba_state_presets,
    ))


class MambaStateCase(TuneCase):
    """Scratch buffers for one key: ``2 * num_requests`` slots, the requests in shuffled slots."""

    def __init__(self, name: str, key: dict, device: torch.device):
        n, row_elems = key["num_requests"], key["row_elems"]
        dtype = getattr(torch, key["dtype"])
        gen = torch.Generator().manual_seed(0)
        self.name = name
        self.states = torch.randn(2 * n, row_elems, generator=gen).to(device, dtype)
        self.initial = self.states.clone()
        self.slot_ids = torch.randperm(2 * n, generator=gen)[:n].to(device, torch.int32)
        self.rows = torch.randn(n, row_elems, generator=gen).to(device, dtype)
        self.bytes_moved = 2 * n * row_elems * self.rows.element_size() + 4 * n

    def run(self, config: KernelConfig) -> None:
        if self.name == GATHER:
            mamba_state_gather(self.states, self.slot_ids, self.rows, config=config,
                               backend="triton")
        else:
            mamba_state_scatter(self.states, self.slot_ids, self.rows, config=config,
                                backend="triton")

    def run_reference(self) -> None:
        if self.name == GATHER:
            mamba_state_gather_ref(self.states, self.slot_ids, self.rows)
        else:
            mamba_state_scatter_ref(self.states, self.slot_ids, self.rows)

    def _reset(self) -> None:
        self.states.copy_(self.initial)
        if self.name == GATHER:
            self.rows.fill_(float("nan"))

    def check(self, config: KernelConfig) -> None:
        self._reset()
        self.run_reference()
        expected = (self.states.clone(), self.rows.clone())
        self._reset()
        self.run(config)
        for got, want in zip((self.states, self.rows), expected):
            assert torch.equal(bits(got), bits(want)), \
                f"{self.name} with {config} differs from its reference"


@custom_op("dynctx::mamba_state_gather", mutates_args=())
def _mamba_state_gather_op(states: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    return mamba_state_gather(states, slot_ids, backend=None)


@_mamba_state_gather_op.register_fake
def _mamba_state_gather_fake(states, slot_ids):
    return states.new_empty((slot_ids.shape[0], *states.shape[1:]))


@custom_op("dynctx::mamba_state_scatter", mutates_args=("states",))
def _mamba_state_scatter_op(states: torch.Tensor, slot_ids: torch.Tensor,
                            src: torch.Tensor) -> None:
    mamba_state_scatter(states, slot_ids, src, backend=None)


@_mamba_state_scatter_op.register_fake
def _mamba_state_scatter_fake(states, slot_ids, src) -> None:
    return None


mamba_state_gather_op = torch.ops.dynctx.mamba_state_gather


mamba_state_scatter_op = torch.ops.dynctx.mamba_state_scatter
