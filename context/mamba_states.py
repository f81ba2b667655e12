"""The Mamba side of a hybrid model: state slots, the conv and SSM states, their snapshots.

``MambaStates`` owns what a hybrid keeps per request row: a state slot (``SlotAllocator``, a host
stack, as Megatron-Core's), the conv and SSM states of every Mamba layer per slot (allocated with
the context's tensors, dropped on suspend), the step's ``seq_idx``, and prefix caching's state
snapshots (``MambaSnapshots``, docs/SEMANTICS.md §17). ``MambaMetadata`` is Megatron-Core's view
of it (``ctx.mamba_metadata``): the slot map, the free slots and the step's Mamba fields. The
step's Mamba host metadata is built by ``step_builder.StepBuilder`` into the arena; ``step_fields``
turns it into the device views of ``MambaMetadata``'s step fields.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from dynctx.kernels.mamba_state import mamba_state_gather, mamba_state_scatter
from dynctx.kernels.speculative_rewind import speculative_rewind

from ._fields import FIELD_MAMBA_SLOT


class SlotAllocator:
    """Host-side stack of Mamba state slots (one per live request of a hybrid model).

    The first slot handed out is ``count - 1``, as in Megatron-Core; freed slots are reused
    first.
    """

    def __init__(self, count: int):
        self.count = int(count)
        self.reset()

    def reset(self) -> None:
        self.free_slots = np.arange(self.count, dtype=np.int32)
        self.free_count = self.count

    def allocate(self) -> int | None:
        if self.free_count == 0:
            return None
        self.free_count -= 1
        return int(self.free_slots[self.free_count])

    def release(self, slots: np.ndarray) -> None:
        """Push slots back (``-1`` entries ignored)."""
        slots = np.asarray(slots, dtype=np.int32).reshape(-1)
        slots = slots[slots >= 0]
        if self.free_count + slots.size > self.count:
            raise RuntimeError(f"release of {slots.size} slots overflows the stack "
                               f"({self.free_count} of {self.count} free)")
        self.free_slots[self.free_count:self.free_count + slots.size] = slots
        self.free_count += int(slots.size)


class MambaSnapshots:
    """Conv and SSM state copies at block boundaries (hybrids), keyed by block digest: the one
    store of a hybrid's prefix-cache states (Megatron-Core 0.19's ``mamba_slot_allocator`` is a
    view of it, ``mamba_slot_allocator.py``).

    Args:
        count: snapshots (``prefix_caching_mamba_gb`` // bytes of one request's states).
        conv_shape, ssm_shape: ``[mamba layers, *state shape]`` of one request.
        conv_dtype, ssm_dtype, device: as the context's Mamba states.
    """

    def __init__(self, count: int, conv_shape: tuple, ssm_shape: tuple, conv_dtype, ssm_dtype,
                 device):
        self.count = int(count)
        self._spec = (tuple(conv_shape), tuple(ssm_shape), conv_dtype, ssm_dtype, device)
        self.conv: Optional[torch.Tensor] = None
        self.ssm: Optional[torch.Tensor] = None
        # digest -> snapshot index, least recently used first; the free indexes (a stack).
        self.index: "OrderedDict[bytes, int]" = OrderedDict()
        self.slots = SlotAllocator(self.count)
        self.tier = None   # the prefix cache's host tier: replaced snapshots spill to it

    def allocate(self) -> None:
        conv_shape, ssm_shape, conv_dtype, ssm_dtype, device = self._spec
        layers = conv_shape[0]
        self.conv = torch.zeros((layers, self.count, *conv_shape[1:]), dtype=conv_dtype,
                                device=device)
        self.ssm = torch.zeros((layers, self.count, *ssm_shape[1:]), dtype=ssm_dtype,
                               device=device)
        self.clear()

    def release(self) -> None:
        self.conv = self.ssm = self._scratch = None
        self.clear()

    def scratch(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(conv, ssm)`` ``[layers, rows, ...]`` zeros: 0.19's extraction scratch, allocated
        at the first use (dynctx's models never use it) and dropped with the snapshots."""
        if getattr(self, "_scratch", None) is None:
            conv_shape, ssm_shape, conv_dtype, ssm_dtype, device = self._spec
            self._scratch = (
                torch.zeros((conv_shape[0], rows, *conv_shape[1:]), dtype=conv_dtype,
                            device=device),
                torch.zeros((ssm_shape[0], rows, *ssm_shape[1:]), dtype=ssm_dtype,
                            device=device))
        return self._scratch

    def clear(self) -> None:
        """Forget every snapshot (every index free)."""
        self.index.clear()
        self.slots.reset()

    def take(self, digest: bytes) -> int:
        """The snapshot index of ``digest``: its own (touched), else a free one, else the
        least recently used one's (replaced); its content is the caller's to write."""
        return self._take(digest)[0]

    def _take(self, digest: bytes) -> Tuple[int, Optional[bytes]]:
        """``take``, and the digest whose snapshot it replaced (None: none)."""
        index = self.index.get(digest)
        if index is not None:
            self.index.move_to_end(digest)
            return index, None
        replaced = None
        if self.slots.free_count:
            index = self.slots.allocate()
        elif self.index:
            replaced, index = self.index.popitem(last=False)
        else:
            raise RuntimeError("no Mamba state snapshot fits prefix_caching_mamba_gb")
        self.index[digest] = index
        return index, replaced

    def drop(self, digests) -> None:
        """Forget the snapshots of ``digests`` (their indexes free again); with the host tier,
        the snapshot of a block that went there goes along (``HostTier.spill_snapshots``)."""
        gone = [(d, self.index.pop(d)) for d in digests if d in self.index]
        if not gone:
            return
        if self.tier is not None:
            self.tier.spill_snapshots([(d, i) for d, i in gone if d in self.tier.blocks],
                                      self.conv, self.ssm)
        self.slots.release(np.asarray([i for _, i in gone], dtype=np.int32))

    def save(self, items: List[Tuple[int, bytes]], conv_states: torch.Tensor,
             ssm_states: torch.Tensor) -> None:
        """Copy the states of slots into snapshots under ``(slot, digest)`` items (a digest
        already held is kept; when full, the least recently used snapshot is replaced)."""
        writes: Dict[int, int] = {}   # snapshot index -> slot (the last item written wins)
        replaced = []                 # (digest, index) of snapshots written before this call
        for slot, digest in items:
            if digest in self.index or self.count == 0:
                continue
            target, old = self._take(digest)
            if old is not None and target not in writes:
                replaced.append((old, target))
            # An item of this very call may have been replaced (more items than snapshots):
            # each index is copied once, from the slot its digest now names. ``index_copy_``
            # with a repeated index leaves either source there (on CUDA, nondeterministically).
            writes.pop(target, None)
            writes[target] = slot
        if self.tier is not None:   # the host tier: replaced snapshots spill, saved ones
            self.tier.spill_snapshots(replaced, self.conv, self.ssm)   # leave the host
            self.tier.discard_snapshots([d for _, d in items if d in self.index])
        if writes:
            self.copy_in(list(writes), list(writes.values()), conv_states, ssm_states)

    def restore(self, items: List[Tuple[int, int]], conv_states: torch.Tensor,
                ssm_states: torch.Tensor) -> None:
        """Copy snapshots into slots: ``(slot, snapshot index)`` items."""
        if items:
            device = conv_states.device
            dst = torch.tensor([slot for slot, _ in items], dtype=torch.int64, device=device)
            src = torch.tensor([index for _, index in items], dtype=torch.int64, device=device)
            conv_states.index_copy_(1, dst, self.conv.index_select(1, src))
            ssm_states.index_copy_(1, dst, self.ssm.index_select(1, src))

    def copy_in(self, targets: List[int], rows: List[int], conv_states: torch.Tensor,
                ssm_states: torch.Tensor) -> None:
        """Snapshots ``targets`` take rows ``rows`` of ``conv_states`` / ``ssm_states``
        (``[layers, rows, ...]``), every layer: one gather and one scatter each."""
        device = self.conv.device
        src = torch.tensor(rows, dtype=torch.int64, device=device)
        dst = torch.tensor(targets, dtype=torch.int64, device=device)
        self.conv.index_copy_(1, dst, conv_states.index_select(1, src))
        self.ssm.index_copy_(1, dst, ssm_states.index_select(1, src))

class MambaStates:
    """Slots, states and snapshots of a hybrid model's Mamba layers.

    Args:
        layers: the ``sizing.LayerLayout`` (Mamba layer count, state shapes and dtypes).
        max_requests: slots, one per request row; max_tokens: tokens of one step.
        device: where the states live; kernel_backend: the backend of the gather/scatter
            launches.
        snapshot_count: prefix caching's state snapshots (``prefix_snapshot_count``; -1: none).
        speculative: ``num_speculative_tokens`` (k); k > 0 adds 0.19's intermediate states,
            ``[layers, max_requests, k + 1, *shape]``: the state after each of a decode step's
            ``1 + k`` tokens, which the model writes and a rewind restores from.
    """

    def __init__(self, layers, *, max_requests: int, max_tokens: int, device: torch.device,
                 kernel_backend: Optional[str], snapshot_count: int = -1, speculative: int = 0):
        self.layers, self.device, self.kernel_backend = layers, device, kernel_backend
        self.max_requests, self.max_tokens = max_requests, max_tokens
        count = layers.num_mamba_layers
        self.conv_shape = (count, max_requests, *layers.mamba_conv_states_shape)
        self.ssm_shape = (count, max_requests, *layers.mamba_ssm_states_shape)
        self.slots = SlotAllocator(max_requests)
        self.snapshots = None if snapshot_count < 0 else MambaSnapshots(
            snapshot_count, (count, *layers.mamba_conv_states_shape),
            (count, *layers.mamba_ssm_states_shape), layers.mamba_conv_states_dtype,
            layers.mamba_ssm_states_dtype, device)
        self.conv_states: Optional[torch.Tensor] = None
        self.ssm_states: Optional[torch.Tensor] = None
        self.speculative = speculative
        self.intermediate_conv = self.intermediate_ssm = None
        self.seq_idx: Optional[torch.Tensor] = None
        self.host_seq_idx: Optional[np.ndarray] = None

    def nbytes(self) -> int:
        """Bytes ``allocate`` takes on the device (states, snapshots and ``seq_idx``)."""
        layers = self.layers
        conv = torch.empty((), dtype=layers.mamba_conv_states_dtype).element_size()
        ssm = torch.empty((), dtype=layers.mamba_ssm_states_dtype).element_size()
        rows = self.max_requests + (self.snapshots.count if self.snapshots is not None else 0)
        if self.speculative:  # the intermediate states
            rows += self.max_requests * (self.speculative + 1)
        per_row = (conv * math.prod(self.conv_shape[2:])
                   + ssm * math.prod(self.ssm_shape[2:])) * layers.num_mamba_layers
        return rows * per_row + 4 * self.max_tokens

    def allocate(self) -> None:
        """The state tensors (their bytes are not initialised: a new request's slot is zeroed
        when its step is built), every slot free."""
        layers, device = self.layers, self.device
        self.conv_states = torch.empty(self.conv_shape, dtype=layers.mamba_conv_states_dtype,
                                       device=device)
        self.ssm_states = torch.empty(self.ssm_shape, dtype=layers.mamba_ssm_states_dtype,
                                      device=device)
        self.seq_idx = torch.full((self.max_tokens,), -1, dtype=torch.int32, device=device)
        self.host_seq_idx = np.full(self.max_tokens, -1, dtype=np.int32)
        if self.speculative:
            count, rows, steps = self.conv_shape[0], self.max_requests, self.speculative + 1
            self.intermediate_conv = torch.zeros(
                (count, rows, steps, *self.conv_shape[2:]),
                dtype=layers.mamba_conv_states_dtype, device=device)
            self.intermediate_ssm = torch.zeros(
                (count, rows, steps, *self.ssm_shape[2:]),
                dtype=layers.mamba_ssm_states_dtype, device=device)
        self.slots.reset()
        if self.snapshots is not None:
            self.snapshots.allocate()

    def release(self) -> None:
        self.conv_states = self.ssm_states = self.seq_idx = self.host_seq_idx = None
        self.intermediate_conv = self.intermediate_ssm = None
        self.slots.reset()
        if self.snapshots is not None:
            self.snapshots.release()

    def layer(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(conv [max_requests, *conv_shape], ssm [max_requests, *ssm_shape])`` of the Mamba
        layer ``index`` (0-based among the Mamba layers)."""
        return self.conv_states[index], self.ssm_states[index]

    def intermediate(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(conv [max_requests, k + 1, *conv_shape], ssm [max_requests, k + 1, *ssm_shape])``
        intermediate states of the Mamba layer ``index``: entry ``[slot, j]`` is the state after
        the ``j``-th token of the slot's decode step (0.19's layout)."""
        return self.intermediate_conv[index], self.intermediate_ssm[index]

    def rewind(self, rejected: torch.Tensor, slot_ids: torch.Tensor,
               all_rows: bool = True) -> None:
        """Rewind: each row's state becomes its intermediate state after its accepted tokens
        (``current[l, slot] = intermediate[l, slot, k - rejected]``, 0.19's
        ``mamba_state_selective_copy``; only where ``rejected > 0`` without ``all_rows``), every
        Mamba layer and both state tensors in one ``speculative_rewind`` launch. ``rejected``,
        ``slot_ids``: ``[n]`` device tensors."""
        if rejected.shape[0]:
            speculative_rewind(rejected, slot_ids=slot_ids, conv_states=self.conv_states,
                               ssm_states=self.ssm_states,
                               conv_intermediate=self.intermediate_conv,
                               ssm_intermediate=self.intermediate_ssm, all_rows=all_rows,
                               backend=self.kernel_backend, check=False)

    def rewind_tensors(self) -> tuple:
        """``(conv, ssm, conv intermediate, ssm intermediate)``: what a deferred rewind
        restores from and into (``DraftRows.apply_lags``)."""
        return (self.conv_states, self.ssm_states, self.intermediate_conv,
                self.intermediate_ssm)

    def zero(self, slots: np.ndarray) -> None:
        """Zero the states of ``slots`` (every layer)."""
        index = torch.from_numpy(slots).to(self.device)
        self.conv_states.index_fill_(1, index, 0)
        self.ssm_states.index_fill_(1, index, 0)

    def gather(self, index: int, slots: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        conv, ssm = self.layer(index)
        return (mamba_state_gather(conv, slots, backend=self.kernel_backend),
                mamba_state_gather(ssm, slots, backend=self.kernel_backend))

    def scatter(self, index: int, slots: torch.Tensor, conv: torch.Tensor,
                ssm: torch.Tensor) -> None:
        conv_states, ssm_states = self.layer(index)
        mamba_state_scatter(conv_states, slots, conv, backend=self.kernel_backend)
        mamba_state_scatter(ssm_states, slots, ssm, backend=self.kernel_backend)

    def save_snapshots(self, items) -> None:
        """Prefix caching: ``(slot, digest)`` items' states into snapshots."""
        self.snapshots.save(list(items), self.conv_states, self.ssm_states)

    def restore_snapshots(self, items) -> None:
        """Prefix caching: ``(slot, snapshot index)`` items' snapshots into their slots."""
        if items:
            self.snapshots.restore(items, self.conv_states, self.ssm_states)

    def step_fields(self, step, arena: dict, h2d) -> dict:
        """Zero the Mamba states of this step's new requests; the step's Mamba metadata fields
        (``MambaMetadata.STEP_FIELDS``) as views of the device state (``arena``: the arena's
        device sections, where ``StepBuilder`` wrote the step's slots and offsets)."""
        host = step.mamba
        if host.zero_count:
            new_slots = arena["mamba_zero_slots"][:host.zero_count]
            self.conv_states.index_fill_(1, new_slots, 0)
            self.ssm_states.index_fill_(1, new_slots, 0)
        padded_tokens = step.padded_tokens
        if host.padded_prefill:
            h2d.copy(self.seq_idx[:padded_tokens], self.host_seq_idx[:padded_tokens])
        return dict(
            batch_indices_decode=(arena["mamba_decode_slots"][:host.padded_decode]
                                  if host.padded_decode else None),
            batch_indices_prefill=(arena["mamba_prefill_slots"][:host.padded_prefill]
                                   if host.padded_prefill else None),
            batch_indices_chunked_prefill=(arena["mamba_chunked_slot"]
                                           if host.chunked else None),
            cu_seqlens=(arena["mamba_cu_seqlens"][:host.padded_prefill + 1]
                        if host.padded_prefill else None),
            seq_idx=(self.seq_idx[:padded_tokens].unsqueeze(0)
                     if host.padded_prefill else None),
            device_decode_prefill=(host.decode, host.regular),
            device_chunked_prefill=((host.regular_tokens, host.chunked_tokens)
                                    if host.chunked else None),
        )


class MambaMetadata:
    """The Mamba side of the context, with Megatron-Core's names (``ctx.mamba_metadata`` of a
    hybrid model; None otherwise). Built with the context and kept across ``reset``:

    * ``request_to_mamba_state_idx``: int32 ``[max_requests]``, each row's state slot (-1
      none), the context's slot field (a view: ``request_ids`` says how writes reach it);
    * ``mamba_state_free_slot_count``: free slots; settable by hand like
      ``block_allocator.total_avail`` (lowering it takes the top of the free stack);
    * ``allocate_slot()``: pop a free slot (None when none is free), as Megatron-Core's;
    * the step's fields (``STEP_FIELDS``: batch indices of the decode, prefill and chunked rows,
      ``cu_seqlens``, ``seq_idx``, the decode/prefill split), set by
      ``initialize_attention_state`` and None again after ``reset_attention_state``.
    """

    STEP_FIELDS = ("batch_indices_decode", "batch_indices_prefill",
                   "batch_indices_chunked_prefill", "cu_seqlens", "seq_idx",
                   "device_decode_prefill", "device_chunked_prefill")

    #: 0.19's per-step bound on extracted intermediate states (the context sets it).
    max_intermediate_count = 0

    def __init__(self, states: "MambaStates", table, device):
        # The parts it reads (none refers back to it): the slot stack, and the request table
        # and device state whose slot field ``request_to_mamba_state_idx`` hands out.
        self._states, self._table, self._device = states, table, device
        self.reset_varlen_metadata()

    def reset_varlen_metadata(self) -> None:
        """Forget the step's fields (the slot map and the free slots stay), and 0.19's
        intermediate-state extraction of the step (``mamba_slot_allocator.py``)."""
        for name in self.STEP_FIELDS:
            setattr(self, name, None)
        self.intermediate_count, self.per_request_intermediate_counts = 0, []
        self.intermediate_chunk_indices = self.intermediate_abs_positions = None

    def update_step(self, fields: dict) -> None:
        for name in self.STEP_FIELDS:
            setattr(self, name, fields[name])

    @property
    def request_to_mamba_state_idx(self) -> torch.Tensor:
        return self._device.field_view(self._table, FIELD_MAMBA_SLOT)

    def _slots(self) -> "SlotAllocator":
        self._device.check_allocated()
        return self._states.slots

    @property
    def mamba_state_free_slot_count(self) -> int:
        return self._slots().free_count

    @mamba_state_free_slot_count.setter
    def mamba_state_free_slot_count(self, value: int) -> None:
        slots = self._slots()
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"mamba_state_free_slot_count={value!r} must be an int")
        if not 0 <= value <= slots.count:
            raise ValueError(f"mamba_state_free_slot_count={value} must lie in [0, "
                             f"{slots.count}] (the slots, one per request row)")
        slots.free_count = int(value)

    def allocate_slot(self) -> Optional[int]:
        """Pop a free slot for a request the caller places by hand (None when none is free)."""
        return self._slots().allocate()

    def batch_allocate_slots(self, count: int) -> Optional[torch.Tensor]:
        """Pop ``count`` free slots (int32, in ``allocate_slot``'s order) for rows the caller
        places by hand, or None, taking none, when fewer are free (Megatron-Core 0.19)."""
        slots = self._slots()
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"count={count!r} must be an int >= 0")
        if count > slots.free_count:
            return None
        return torch.tensor([slots.allocate() for _ in range(count)], dtype=torch.int32)
