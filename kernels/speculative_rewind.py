"""Speculative rewind: what a rewind of rejected draft tokens does on the device, in one launch.

After a speculative step each decode row ``i`` has ``rejected[i]`` draft tokens the target did
not accept (``0..k``). ``speculative_rewind`` applies them to what lives on the device, two
optional parts of the same launch:

* **Mamba states** (hybrids): for every Mamba layer ``l`` and row ``i`` with ``slot_ids[i] >=
  0`` and ``rejected[i] > 0`` (or any ``rejected[i]`` with ``all_rows``), the conv and SSM
  states of the slot become the intermediate state after its accepted tokens: ``states[l,
  slot] = intermediate[l, slot, k - rejected[i]]`` (Megatron-Core 0.19's
  ``mamba_state_selective_copy``, every layer and both state tensors in one launch). Without
  ``all_rows`` a row with nothing rejected keeps its state: a deferred rewind cannot tell such
  a row from one whose intermediate states were never written.
* **Per-request fields** (a rewind the host has not applied yet: async scheduling,
  docs/SEMANTICS.md §19): ``kv_offsets[i] -= rejected[i]``, ``kv_lengths[i] -= rejected[i]``,
  and the cumulative KV lengths ``cu_kv[j] -= sum(rejected[:min(j, n)])`` for ``j >= 1`` (rows
  past ``n``, the step's other and padding rows, shift by the whole sum).

Pure data movement and integer arithmetic: bit-exact in every dtype. ``rejected`` is not read
on the host (that would sync): the intermediate step is clamped to ``[0, k]``, so nothing is
read out of bounds.
"""

from __future__ import annotations

import math

import torch

from . import autotune
from ._common import (
    FLOAT_DTYPES,
    bits,
    check_grid,
    check_tensor,
    check_writable,
    custom_op,
    next_pow2,
)
from ._shapes import MAMBA2_CONV_STATE, MAMBA2_MIXER, MAMBA2_SSM_STATE
from .autotune import KernelConfig, KernelTuning, TuneCase
from .backend import HAS_TRITON, resolve_backend
from .launch_plan import KernelLaunch, PlanCache
from .mamba_state import row_layout

NAME = "speculative_rewind"
# Per launch key (launch_plan.py): the checks passed, the config, the grid, the arguments.
_PLANS = PlanCache(NAME)
INDEX_DTYPES = (torch.int32, torch.int64)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mamba_state import _state_offsets

    @triton.jit
    def _restore_chunk(states_ptr, inter_ptr, slot, step, offs_r, bound, size_1, size_2,
                       stride_layer, stride_slot, stride_0, stride_1, stride_2,
                       stride_inter_layer, stride_inter_slot, stride_inter_step,
                       stride_inter_0, stride_inter_1, stride_inter_2, layer,
                       FLAT: tl.constexpr):
        """``states[layer, slot, offs_r] = intermediate[layer, slot, step, offs_r]`` where
        ``offs_r < bound``."""
        mask = offs_r < bound
        offs_src = _state_offsets(offs_r, size_1, size_2, stride_inter_0, stride_inter_1,
                                  stride_inter_2, FLAT)
        offs_dst = _state_offsets(offs_r, size_1, size_2, stride_0, stride_1, stride_2, FLAT)
        values = tl.load(inter_ptr + layer * stride_inter_layer + slot * stride_inter_slot
                         + step * stride_inter_step + offs_src, mask=mask)
        tl.store(states_ptr + layer * stride_layer + slot * stride_slot + offs_dst, values,
                 mask=mask)

    @triton.heuristics({"HAS_STATES": lambda args: args["conv_states_ptr"] is not None,
                        "HAS_FIELDS": lambda args: args["kv_offsets_ptr"] is not None})
    @triton.jit(do_not_specialize=["num_rows", "num_cu_rows"])
    def _speculative_rewind_kernel(
        conv_states_ptr, ssm_states_ptr, kv_offsets_ptr, kv_lengths_ptr, cu_kv_ptr,
        conv_inter_ptr, ssm_inter_ptr,
        rejected_ptr, slot_ids_ptr,
        num_rows, num_cu_rows, num_steps, conv_chunks,
        conv_elems, conv_size_1, conv_size_2, ssm_elems, ssm_size_1, ssm_size_2,
        stride_conv_layer, stride_conv_slot, stride_conv_0, stride_conv_1, stride_conv_2,
        stride_conv_inter_layer, stride_conv_inter_slot, stride_conv_inter_step,
        stride_conv_inter_0, stride_conv_inter_1, stride_conv_inter_2,
        stride_ssm_layer, stride_ssm_slot, stride_ssm_0, stride_ssm_1, stride_ssm_2,
        stride_ssm_inter_layer, stride_ssm_inter_slot, stride_ssm_inter_step,
        stride_ssm_inter_0, stride_ssm_inter_1, stride_ssm_inter_2,
        stride_kv_offsets, stride_kv_lengths, stride_cu_kv, stride_rejected, stride_slot_ids,
        HAS_STATES: tl.constexpr, HAS_FIELDS: tl.constexpr, ALL_ROWS: tl.constexpr,
        CONV_FLAT: tl.constexpr,
        SSM_FLAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Program (row, layer, chunk) restores BLOCK_R elements of one state row (the conv
        chunks first, then the SSM ones); program (0, 0, 0) also rewinds the fields."""
        row = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        chunk = tl.program_id(2)
        if HAS_STATES:
            rejected = tl.load(rejected_ptr + row * stride_rejected).to(tl.int64)
            slot = tl.load(slot_ids_ptr + row * stride_slot_ids).to(tl.int64)
            step = tl.minimum(tl.maximum(num_steps - 1 - rejected, 0), num_steps - 1)
            restore = ((rejected > 0) | ALL_ROWS) & (slot >= 0)
            if chunk < conv_chunks:
                offs_r = chunk.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
                _restore_chunk(conv_states_ptr, conv_inter_ptr, slot, step, offs_r,
                               tl.where(restore, conv_elems, 0), conv_size_1, conv_size_2,
                               stride_conv_layer, stride_conv_slot, stride_conv_0, stride_conv_1,
                               stride_conv_2, stride_conv_inter_layer, stride_conv_inter_slot,
                               stride_conv_inter_step, stride_conv_inter_0, stride_conv_inter_1,
                               stride_conv_inter_2, layer, CONV_FLAT)
            else:
                offs_r = (chunk - conv_chunks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
                _restore_chunk(ssm_states_ptr, ssm_inter_ptr, slot, step, offs_r,
                               tl.where(restore, ssm_elems, 0), ssm_size_1, ssm_size_2,
                               stride_ssm_layer, stride_ssm_slot, stride_ssm_0, stride_ssm_1,
                               stride_ssm_2, stride_ssm_inter_layer, stride_ssm_inter_slot,
                               stride_ssm_inter_step, stride_ssm_inter_0, stride_ssm_inter_1,
                               stride_ssm_inter_2, layer, SSM_FLAT)
        if HAS_FIELDS:
            if (row == 0) & (layer == 0) & (chunk == 0):
                # One program: the cumulative lengths need the running sum of every row.
                # (A while loop: Triton 3.6's interpreter cannot take runtime bounds in range().)
                carry = tl.zeros([1], dtype=tl.int64)
                start = 0
                while start < num_cu_rows:
                    offs_n = start + tl.arange(0, BLOCK_N).to(tl.int64)
                    mask_n = offs_n < num_rows
                    values = tl.load(rejected_ptr + offs_n * stride_rejected, mask=mask_n,
                                     other=0).to(tl.int64)
                    offsets = tl.load(kv_offsets_ptr + offs_n * stride_kv_offsets, mask=mask_n)
                    tl.store(kv_offsets_ptr + offs_n * stride_kv_offsets,
                             (offsets - values).to(offsets.dtype), mask=mask_n)
                    lengths = tl.load(kv_lengths_ptr + offs_n * stride_kv_lengths, mask=mask_n)
                    tl.store(kv_lengths_ptr + offs_n * stride_kv_lengths,
                             (lengths - values).to(lengths.dtype), mask=mask_n)
                    # cu_kv[j + 1] for the rows j of this block.
                    shift = carry + tl.cumsum(values, 0)
                    mask_cu = offs_n < num_cu_rows
                    cu_ptrs = cu_kv_ptr + (offs_n + 1) * stride_cu_kv
                    cu = tl.load(cu_ptrs, mask=mask_cu)
                    tl.store(cu_ptrs, (cu - shift).to(cu.dtype), mask=mask_cu)
                    carry += tl.sum(values, 0)
                    start += BLOCK_N


def _check_states(name: str, states, inter, layers: int, slots: int, device) -> int:
    """``states`` ``[L, S, *shape]`` and ``inter`` ``[L, S, k + 1, *shape]``; returns
    ``k + 1``."""
    if not isinstance(states, torch.Tensor) or states.dim() < 3:
        raise ValueError(f"{name} must be a [layers, slots, *state_shape] tensor, got "
                         f"{tuple(states.shape) if isinstance(states, torch.Tensor) else states}")
    check_tensor(name, states, dims=states.dim(), dtypes=FLOAT_DTYPES, device=device,
                 device_of="rejected")
    inter_name = name.replace("states", "intermediate")
    check_tensor(inter_name, inter, dims=states.dim() + 1, dtypes=(states.dtype,),
                 device=device, device_of="rejected")
    if tuple(states.shape[:2]) != (layers, slots):
        raise ValueError(f"{name} has [layers, slots] = {list(states.shape[:2])}, conv_states "
                         f"{[layers, slots]}")
    want = (layers, slots, inter.shape[2], *states.shape[2:])
    if tuple(inter.shape) != want or inter.shape[2] < 1:
        raise ValueError(f"{inter_name} has shape {tuple(inter.shape)}, expected [layers, "
                         f"slots, k + 1, *state_shape] = {list(want)}")
    check_writable((name, states))
    return int(inter.shape[2])


def _check(rejected, slot_ids, conv, ssm, conv_inter, ssm_inter, kv_offsets, kv_lengths,
           cu_kv) -> tuple:
    """Every argument, before anything is written; returns ``(has_states, has_fields)``."""
    if not isinstance(rejected, torch.Tensor):
        raise ValueError(f"rejected must be a tensor, got {type(rejected).__name__}")
    device = rejected.device
    check_tensor("rejected", rejected, dims=1, dtypes=INDEX_DTYPES, device=device,
                 device_of="rejected")
    n = rejected.shape[0]
    mamba = dict(slot_ids=slot_ids, conv_states=conv, ssm_states=ssm,
                 conv_intermediate=conv_inter, ssm_intermediate=ssm_inter)
    fields = dict(kv_offsets=kv_offsets, kv_lengths=kv_lengths, cu_kv=cu_kv)
    for group in (mamba, fields):
        given = [name for name, value in group.items() if value is not None]
        if given and len(given) != len(group):
            missing = [name for name in group if name not in given]
            raise ValueError(f"{missing[0]} is missing: {', '.join(group)} go together "
                             f"(got {', '.join(given)})")
    has_states, has_fields = conv is not None, kv_offsets is not None
    if has_states:
        check_tensor("slot_ids", slot_ids, dims=1, dtypes=INDEX_DTYPES, device=device,
                     device_of="rejected")
        if slot_ids.shape[0] != n:
            raise ValueError(f"slot_ids has {slot_ids.shape[0]} entries, rejected {n}")
        if not isinstance(conv, torch.Tensor) or conv.dim() < 3:
            raise ValueError(f"conv_states must be a [layers, slots, *state_shape] tensor, got "
                             f"{tuple(conv.shape) if isinstance(conv, torch.Tensor) else conv}")
        layers, slots = conv.shape[:2]
        steps = _check_states("conv_states", conv, conv_inter, layers, slots, device)
        if _check_states("ssm_states", ssm, ssm_inter, layers, slots, device) != steps:
            raise ValueError(f"ssm_intermediate has {ssm_inter.shape[2]} steps, "
                             f"conv_intermediate {steps}")
        for name, states, inter in (("conv_states", conv, conv_inter),
                                    ("ssm_states", ssm, ssm_inter)):
            if states.shape[0] and states.shape[1]:
                row_layout(states[0], inter[0, :, 0])   # refuses unmergeable rows, naming states
    if has_fields:
        for name, tensor in (("kv_offsets", kv_offsets), ("kv_lengths", kv_lengths)):
            check_tensor(name, tensor, dims=1, dtypes=(torch.int32,), device=device,
                         device_of="rejected")
            if tensor.shape[0] != n:
                raise ValueError(f"{name} has {tensor.shape[0]} entries, rejected {n}")
        check_tensor("cu_kv", cu_kv, dims=1, dtypes=(torch.int32,), device=device,
                     device_of="rejected")
        if cu_kv.shape[0] < n + 1:
            raise ValueError(f"cu_kv has {cu_kv.shape[0]} entries, fewer than rejected's "
                             f"{n} rows + 1")
        check_writable(("kv_offsets", kv_offsets), ("kv_lengths", kv_lengths), ("cu_kv", cu_kv))
    return has_states, has_fields


def speculative_rewind(rejected: torch.Tensor, *, slot_ids: torch.Tensor | None = None,
                       conv_states: torch.Tensor | None = None,
                       ssm_states: torch.Tensor | None = None,
                       conv_intermediate: torch.Tensor | None = None,
                       ssm_intermediate: torch.Tensor | None = None,
                       kv_offsets: torch.Tensor | None = None,
                       kv_lengths: torch.Tensor | None = None, cu_kv: torch.Tensor | None = None,
                       all_rows: bool = False, config: KernelConfig | None = None,
                       backend: str | None = None, check: bool = True) -> None:
    """Apply ``rejected`` draft tokens per row on the device in one launch (module docstring),
    writing the given tensors in place.

    Args:
        rejected: ``[n]`` int32/int64, any stride: each row's rejected drafts, in ``[0, k]``
            (not checked: that would sync).
        slot_ids, conv_states, ssm_states, conv_intermediate, ssm_intermediate (together or
            not at all): ``slot_ids [n]`` int32/int64 (-1: no slot; distinct otherwise);
            ``conv_states [L, S, *conv_shape]`` and ``ssm_states [L, S, *ssm_shape]``
            fp32/fp16/bf16, written in place; ``conv_intermediate [L, S, k + 1, *conv_shape]``
            and ``ssm_intermediate [L, S, k + 1, *ssm_shape]`` of their states' dtype, read.
        kv_offsets, kv_lengths, cu_kv (together or not at all): int32 ``[n]``, ``[n]`` and
            ``[m + 1]`` (``m >= n``), written in place.
        all_rows: restore the rows with nothing rejected too (the synchronous rewind, as 0.19:
            their state becomes the intermediate state after all ``1 + k`` tokens).
        check: False skips the checks (the context's own buffers, checked once).

    Every tensor is read or written through its own strides and storage offset; nothing is
    copied. Every argument is checked before anything is written. Zero rows launch nothing.
    """
    # (Only the Triton path stores a plan, and ``backend`` is in the key with the state that
    # resolves it: a hit is a Triton launch.)
    plan, plan_key = _PLANS.find((rejected, slot_ids, conv_states, ssm_states, conv_intermediate,
                                  ssm_intermediate, kv_offsets, kv_lengths, cu_kv),
                                 (check, bool(all_rows), backend), config, backend=backend)
    if plan is not None:
        if plan != "empty":
            plan.launch(tuple(p for p in (conv_states, ssm_states, kv_offsets, kv_lengths, cu_kv,
                                          conv_intermediate, ssm_intermediate, rejected,
                                          slot_ids) if p is not None))
        return
    if check:
        has_states, has_fields = _check(rejected, slot_ids, conv_states, ssm_states,
                                        conv_intermediate, ssm_intermediate, kv_offsets,
                                        kv_lengths, cu_kv)
    else:
        has_states, has_fields = conv_states is not None, kv_offsets is not None
    n = rejected.shape[0]
    if resolve_backend(backend, rejected.device) == "torch":
        speculative_rewind_ref(rejected, slot_ids=slot_ids, conv_states=conv_states,
                               ssm_states=ssm_states, conv_intermediate=conv_intermediate,
                               ssm_intermediate=ssm_intermediate, kv_offsets=kv_offsets,
                               kv_lengths=kv_lengths, cu_kv=cu_kv, all_rows=all_rows)
        return
    layers = conv_states.shape[0] if has_states else 1
    if n == 0 or (not has_fields and (layers == 0 or conv_states.shape[1] == 0)):
        _PLANS.put(plan_key, "empty")
        return
    if config is None:
        key = speculative_rewind_tune_key(
            num_requests=n, conv_shape=conv_states.shape[2:] if has_states else (),
            ssm_shape=ssm_states.shape[2:] if has_states else (),
            conv_dtype=conv_states.dtype if has_states else None,
            ssm_dtype=ssm_states.dtype if has_states else None, fields=has_fields)
        config = autotune.resolve_config(NAME, key, rejected.device)[0]
    block_r = config.kwargs["BLOCK_R"]
    args = dict(conv_states_ptr=conv_states, ssm_states_ptr=ssm_states,
                kv_offsets_ptr=kv_offsets, kv_lengths_ptr=kv_lengths, cu_kv_ptr=cu_kv,
                conv_inter_ptr=conv_intermediate, ssm_inter_ptr=ssm_intermediate,
                rejected_ptr=rejected, slot_ids_ptr=slot_ids, num_rows=n,
                num_cu_rows=cu_kv.shape[0] - 1 if has_fields else 0,
                stride_rejected=rejected.stride(0),
                stride_slot_ids=slot_ids.stride(0) if has_states else 0,
                stride_kv_offsets=kv_offsets.stride(0) if has_fields else 0,
                stride_kv_lengths=kv_lengths.stride(0) if has_fields else 0,
                stride_cu_kv=cu_kv.stride(0) if has_fields else 0, ALL_ROWS=bool(all_rows))
    chunks = 1
    steps = 1
    for name, states, inter in (("conv", conv_states, conv_intermediate),
                                ("ssm", ssm_states, ssm_intermediate)):
        elems, sizes, strides, inter_strides, flat = 0, (1, 1, 1), (0, 0, 0), (0, 0, 0), True
        layer_strides = (0, 0, 0, 0, 0)
        if has_states:
            elems = math.prod(states.shape[2:])
            steps = inter.shape[2]
            sizes, (strides, inter_strides), flat = row_layout(states[0], inter[0, :, 0])
            layer_strides = (states.stride(0), states.stride(1), inter.stride(0),
                             inter.stride(1), inter.stride(2))
        args.update({f"{name}_elems": elems, f"{name}_size_1": sizes[1],
                     f"{name}_size_2": sizes[2], f"{name.upper()}_FLAT": flat,
                     f"stride_{name}_layer": layer_strides[0],
                     f"stride_{name}_slot": layer_strides[1],
                     f"stride_{name}_inter_layer": layer_strides[2],
                     f"stride_{name}_inter_slot": layer_strides[3],
                     f"stride_{name}_inter_step": layer_strides[4]})
        for d in range(3):
            args[f"stride_{name}_{d}"] = strides[d]
            args[f"stride_{name}_inter_{d}"] = inter_strides[d]
        chunks_here = -(-elems // block_r)
        if name == "conv":
            args["conv_chunks"] = chunks_here
            chunks = chunks_here
        else:
            chunks += chunks_here
    args["num_steps"] = steps
    grid = (n, layers, max(1, chunks)) if has_states else (1, 1, 1)
    if check:
        check_grid(NAME, grid, "rejected's rows, the layers and the state rows")
    tensors = {name: value for name, value in args.items() if isinstance(value, torch.Tensor)}
    _PLANS.put(plan_key, KernelLaunch(_speculative_rewind_kernel, grid,
                                      dict(args, **config.launch_kwargs()), tensors))


def speculative_rewind_ref(rejected: torch.Tensor, *, slot_ids=None, conv_states=None,
                           ssm_states=None, conv_intermediate=None, ssm_intermediate=None,
                           kv_offsets=None, kv_lengths=None, cu_kv=None,
                           all_rows: bool = False) -> None:
    """Reference: the restored rows by advanced indexing, the fields by a cumulative sum."""
    counts = rejected.long()
    if conv_states is not None:
        steps = conv_intermediate.shape[2]
        chosen = ((counts > 0) | all_rows) & (slot_ids >= 0)
        slots = slot_ids[chosen].long()
        step = (steps - 1 - counts[chosen]).clamp(0, steps - 1)
        for states, inter in ((conv_states, conv_intermediate), (ssm_states, ssm_intermediate)):
            states[:, slots] = inter[:, slots, step]
    if kv_offsets is not None:
        n = counts.shape[0]
        kv_offsets.sub_(counts.to(kv_offsets.dtype))
        kv_lengths.sub_(counts.to(kv_lengths.dtype))
        shift = torch.cumsum(counts, 0)
        cu_kv[1:n + 1] -= shift.to(cu_kv.dtype)
        if n:
            cu_kv[n + 1:] -= shift[-1].to(cu_kv.dtype)


_BLOCK_R = (1024, 2048, 4096, 8192)


def speculative_rewind_configs(key: dict) -> list[KernelConfig]:
    """Search space: state elements per program (no wider than the longer row) x warps; the
    fields' row block is 256 (one program walks every row)."""
    widest = max(_BLOCK_R[0], next_pow2(max(key["conv_elems"], key["ssm_elems"])))
    return [KernelConfig.make(BLOCK_R=block_r, BLOCK_N=256, num_warps=num_warps)
            for block_r in _BLOCK_R if block_r <= widest for num_warps in (4, 8)]


def speculative_rewind_default_config(key: dict) -> KernelConfig:
    """4K elements per program (or the longer row, if shorter), 8 warps from 4K on."""
    longest = max(key["conv_elems"], key["ssm_elems"])
    block_r = min(4096, max(_BLOCK_R[0], next_pow2(longest)))
    return KernelConfig.make(BLOCK_R=block_r, BLOCK_N=256, num_warps=8 if block_r >= 4096 else 4)


def _dtype_text(dtype) -> str:
    return "none" if dtype is None else dtype if isinstance(dtype, str) \
        else autotune.dtype_name(dtype)


def speculative_rewind_tune_key(*, num_requests: int, conv_shape=(), ssm_shape=(),
                                conv_dtype=None, ssm_dtype=None, fields: bool = False) -> dict:
    """The state rows' lengths and dtypes exact (0 and ``"none"`` without Mamba states) and
    whether the fields are rewound (another build); the request count bucketed."""
    return {"num_requests": autotune.bucket_tokens(num_requests), "fields": int(bool(fields)),
            "conv_elems": int(math.prod(conv_shape)) if len(conv_shape) else 0,
            "ssm_elems": int(math.prod(ssm_shape)) if len(ssm_shape) else 0,
            "conv_dtype": _dtype_text(conv_dtype), "ssm_dtype": _dtype_text(ssm_dtype)}


def speculative_rewind_presets() -> list[dict]:
    """A NemotronH-style Mamba2 layer's states (bf16) without and with the fields (the
    synchronous and the deferred rewind), and the fields alone; 1 to 64 requests."""
    mamba = (MAMBA2_CONV_STATE, MAMBA2_SSM_STATE, MAMBA2_MIXER["dtype"])
    return [speculative_rewind_tune_key(num_requests=n, conv_shape=conv, ssm_shape=ssm,
                                        conv_dtype=dtype, ssm_dtype=dtype, fields=fields)
            for (conv, ssm, dtype), fields in ((mamba, False), (mamba, True),
                                               (((), (), None), True))
            for n in (1, 16, 64)]


class SpeculativeRewindCase(TuneCase):
    """Scratch buffers for one key: with states two layers, ``2 * num_requests`` slots,
    ``k = 3``, the requests in shuffled slots; with fields those of ``num_requests`` rows plus
    two padding rows; random rejected counts in ``[0, k]``."""

    LAYERS, K = 2, 3

    def __init__(self, key: dict, device: torch.device):
        n = key["num_requests"]
        gen = torch.Generator().manual_seed(0)
        self.rejected = torch.randint(0, self.K + 1, (n,), generator=gen).to(device)
        self.fields = dict(kv_offsets=torch.randint(8, 1 << 16, (n,), generator=gen,
                                                    dtype=torch.int32),
                           kv_lengths=torch.randint(8, 1 << 16, (n,), generator=gen,
                                                    dtype=torch.int32),
                           cu_kv=torch.randint(0, 1 << 20, (n + 3,), generator=gen,
                                               dtype=torch.int32))
        self.fields = {name: value.to(device) for name, value in self.fields.items()} \
            if key["fields"] else {}
        self.states = {}
        if key["conv_dtype"] != "none":
            slots = 2 * n
            for name in ("conv", "ssm"):
                elems, dtype = key[f"{name}_elems"], getattr(torch, key[f"{name}_dtype"])
                self.states[f"{name}_states"] = torch.randn(
                    self.LAYERS, slots, elems, generator=gen).to(device, dtype)
                self.states[f"{name}_intermediate"] = torch.randn(
                    self.LAYERS, slots, self.K + 1, elems, generator=gen).to(device, dtype)
            self.states["slot_ids"] = torch.randperm(slots, generator=gen)[:n].to(device)
        self.initial = {name: value.clone() for name, value in self._written().items()}
        self.bytes_moved = sum(2 * t.numel() * t.element_size() for t in self._written().values())

    def _written(self) -> dict:
        names = ("conv_states", "ssm_states")
        return dict(self.fields, **{name: self.states[name] for name in names if name in
                                    self.states})

    def _call(self, config, backend) -> None:
        speculative_rewind(self.rejected, **self.fields, **self.states, config=config,
                           backend=backend)

    def run(self, config: KernelConfig) -> None:
        self._call(config, "triton")

    def run_reference(self) -> None:
        self._call(None, "torch")

    def _reset(self) -> None:
        for name, value in self._written().items():
            value.copy_(self.initial[name])

    def check(self, config: KernelConfig) -> None:
        self._reset()
        self.run_reference()
        expected = {name: value.clone() for name, value in self._written().items()}
        self._reset()
        self.run(config)
        for name, value in self._written().items():
            assert torch.equal(bits(value), bits(expected[name])), \
                f"{NAME} with {config}: {name} differs from the reference"


autotune.register(KernelTuning(
    name=NAME, configs=speculative_rewind_configs,
    default_config=speculative_rewind_default_config, tune_key=speculative_rewind_tune_key,
    token_field="num_requests", make_case=SpeculativeRewindCase,
    presets=speculative_rewind_presets))


@custom_op("dynctx::speculative_rewind",
           mutates_args=("conv_states", "ssm_states", "kv_offsets", "kv_lengths", "cu_kv"))
def _speculative_rewind_op(rejected: torch.Tensor, slot_ids: torch.Tensor | None,
                           conv_states: torch.Tensor | None, ssm_states: torch.Tensor | None,
                           conv_intermediate: torch.Tensor | None,
                           ssm_intermediate: torch.Tensor | None,
                           kv_offsets: torch.Tensor | None, kv_lengths: torch.Tensor | None,
                           cu_kv: torch.Tensor | None, all_rows: bool = False) -> None:
    speculative_rewind(rejected, slot_ids=slot_ids, conv_states=conv_states,
                       ssm_states=ssm_states, conv_intermediate=conv_intermediate,
                       ssm_intermediate=ssm_intermediate, kv_offsets=kv_offsets,
                       kv_lengths=kv_lengths, cu_kv=cu_kv, all_rows=all_rows)


@_speculative_rewind_op.register_fake
def _(rejected, slot_ids, conv_states, ssm_states, conv_intermediate, ssm_intermediate,
      kv_offsets, kv_lengths, cu_kv, all_rows=False) -> None:
    return None


speculative_rewind_op = torch.ops.dynctx.speculative_rewind
