"""The host block pool: KV blocks (and hybrids' Mamba states) kept in host memory.

``HostBlockPool`` holds ``blocks`` host copies of a KV block, each one contiguous piece of host
memory laid out as the device buffer with its block dimension first (``[blocks, 2, layers,
block_size, heads, head_dim]``; MLA: ``[blocks, layers, block_size, rank + rope]``), and for a
hybrid ``states`` host copies of one request's Mamba states (``[states, mamba layers, *conv
shape]`` and the SSM states likewise). Its host slots are handed out from two free stacks (no
slot lost, none owned twice: ``check``). On CUDA the pool is pinned memory and every copy runs
on a side stream (``Copier``): the side stream waits for the work queued so far on the current
stream, the copies are enqueued with ``non_blocking=True``, and the current stream waits for an
event recorded after them; the host never waits. On a CPU device the pool is a plain host
tensor and the copies are synchronous.

A copy moves whole blocks across layers: one ``index_select`` over the block dimension of the
device buffer gathers the blocks (a contiguous ``[n, *block]`` tensor) and one copy per run of
consecutive host slots moves them (at most one per block); the way back is the mirror image,
with one ``index_copy_``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

GIB = 1024 ** 3


def _runs(slots: np.ndarray) -> list:
    """``(start in slots, host slot, length)`` of each run of consecutive host slots."""
    if not slots.size:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slots.size]))
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(starts, ends)]


class Copier:
    """Where the pool's copies run: a side stream with events on CUDA, in line elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, copies) -> None:
        """Run ``copies()`` (it enqueues device work): on CUDA on the side stream, after the
        current stream's work so far, and the current stream waits for it (no host wait)."""
        if self.stream is None:
            copies()
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            copies()
        done = torch.cuda.Event()
        done.record(self.stream)
        current.wait_event(done)

    def index(self, values: np.ndarray) -> torch.Tensor:
        """``values`` as an int64 device tensor (through pinned memory on CUDA)."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.stream is None:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)


class _FreeStack:
    """A stack of free host slots ``[0, count)``, lowest first."""

    def __init__(self, count: int):
        self.count = int(count)
        self.reset()

    def reset(self) -> None:
        self.free = np.arange(self.count - 1, -1, -1, dtype=np.int64)
        self.free_count = self.count

    def take(self, n: int) -> np.ndarray:
        if n > self.free_count:
            raise RuntimeError(f"host pool: {n} slots asked, {self.free_count} free")
        self.free_count -= n
        return self.free[self.free_count:self.free_count + n][::-1].copy()

    def give(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if self.free_count + slots.size > self.count:
            raise RuntimeError(f"host pool: releasing {slots.size} slots overflows the stack "
                               f"({self.free_count} of {self.count} free)")
        self.free[self.free_count:self.free_count + slots.size] = slots[::-1]
        self.free_count += int(slots.size)

    def free_slots(self) -> np.ndarray:
        return self.free[:self.free_count]


class HostBlockPool:
    """Host copies of KV blocks and Mamba states.

    Args:
        blocks: host block slots; block_shape: one block's shape (the device buffer's shape
            without its block dimension); block_dim: the block dimension of the device buffer;
        dtype: the buffer's dtype; device: the context's device (CUDA: pinned host memory and
            a side stream); states: host Mamba state slots (0 without Mamba layers);
        state_shapes: ``(conv, ssm)`` shapes of one request's states (``[layers, *shape]``),
            state_dtypes their dtypes.
    """

    def __init__(self, *, blocks: int, block_shape: Tuple[int, ...], block_dim: int,
                 dtype: torch.dtype, device: torch.device, states: int = 0,
                 state_shapes: Optional[Sequence[Tuple[int, ...]]] = None,
                 state_dtypes: Optional[Sequence[torch.dtype]] = None):
        self.block_shape, self.block_dim, self.dtype = tuple(block_shape), block_dim, dtype
        self.device = device
        self.state_shapes = tuple(state_shapes or ())
        self.state_dtypes = tuple(state_dtypes or ())
        self.blocks, self.states = _FreeStack(blocks), _FreeStack(states)
        self.copier = Copier(device)
        self.pinned = device.type == "cuda"
        self.kv: Optional[torch.Tensor] = None
        self.mamba: Tuple[torch.Tensor, ...] = ()

    @staticmethod
    def block_bytes(block_shape: Sequence[int], dtype: torch.dtype) -> int:
        return math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        """Host bytes ``allocate`` takes."""
        total = self.blocks.count * self.block_bytes(self.block_shape, self.dtype)
        for shape, dtype in zip(self.state_shapes, self.state_dtypes):
            total += self.states.count * self.block_bytes(shape, dtype)
        return total

    def allocate(self) -> None:
        """The host tensors (pinned on CUDA), every slot free. The bytes are not cleared: a
        slot is read only after a copy wrote it."""
        pin = self.pinned
        self.kv = torch.empty((self.blocks.count, *self.block_shape), dtype=self._raw(self.dtype),
                              pin_memory=pin)
        self.mamba = tuple(torch.empty((self.states.count, *shape), dtype=dtype, pin_memory=pin)
                           for shape, dtype in zip(self.state_shapes, self.state_dtypes))
        self.reset()

    def reset(self) -> None:
        self.blocks.reset()
        self.states.reset()

    @staticmethod
    def _raw(dtype: torch.dtype) -> torch.dtype:
        # One-byte float dtypes (FP8) move as bytes: their copies need no arithmetic support.
        if dtype.is_floating_point and torch.empty((), dtype=dtype).element_size() == 1:
            return torch.uint8
        return dtype

    def _blocks_view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The device buffer as ``[blocks, *block]`` (a view)."""
        return buffer.view(self._raw(buffer.dtype)).movedim(self.block_dim, 0)

    # ------------------------------------------------------------------ slots
    @property
    def free_blocks(self) -> int:
        return self.blocks.free_count

    @property
    def free_states(self) -> int:
        return self.states.free_count

    def take(self, blocks: int, states: int) -> Tuple[np.ndarray, np.ndarray]:
        return self.blocks.take(blocks), self.states.take(states)

    def give(self, blocks: np.ndarray, states: np.ndarray) -> None:
        self.blocks.give(blocks)
        self.states.give(states)

    def check(self, owned_blocks: np.ndarray, owned_states: np.ndarray) -> None:
        """Raise ``AssertionError`` unless every host slot is free or owned, exactly once."""
        for stack, owned, what in ((self.blocks, owned_blocks, "block"),
                                   (self.states, owned_states, "state")):
            every = np.concatenate((stack.free_slots(), np.asarray(owned, dtype=np.int64)))
            counts = np.bincount(every, minlength=stack.count) if every.size else \
                np.zeros(stack.count, dtype=np.int64)
            assert counts.size == stack.count, f"host {what} slot out of range: {every.max()}"
            lost, twice = np.flatnonzero(counts == 0), np.flatnonzero(counts > 1)
            assert not lost.size, f"host {what} slots lost (neither free nor owned): {lost}"
            assert not twice.size, f"host {what} slots free or owned twice: {twice}"

    # ------------------------------------------------------------------ copies
    def save(self, buffer: torch.Tensor, device_blocks: np.ndarray, host_blocks: np.ndarray,
             states: Sequence[torch.Tensor] = (), device_slots: Optional[np.ndarray] = None,
             host_states: Optional[np.ndarray] = None) -> None:
        """Copy ``buffer``'s blocks ``device_blocks`` into host slots ``host_blocks`` (and the
        Mamba ``states``' slots ``device_slots``, dimension 1, into ``host_states``)."""
        copier = self.copier

        def copies():
            if device_blocks.size:
                gathered = self._blocks_view(buffer).index_select(
                    0, copier.index(device_blocks))
                for start, slot, length in _runs(host_blocks):
                    self.kv[slot:slot + length].copy_(gathered[start:start + length],
                                                      non_blocking=True)
            if device_slots is not None and device_slots.size:
                index = copier.index(device_slots)
                for host, state in zip(self.mamba, states):
                    gathered = state.movedim(1, 0).index_select(0, index)
                    for start, slot, length in _runs(host_states):
                        host[slot:slot + length].copy_(gathered[start:start + length],
                                                       non_blocking=True)

        copier.run(copies)

    def load(self, buffer: torch.Tensor, host_blocks: np.ndarray, device_blocks: np.ndarray,
             states: Sequence[torch.Tensor] = (), host_states: Optional[np.ndarray] = None,
             device_slots: Optional[np.ndarray] = None) -> None:
        """Copy host slots ``host_blocks`` into ``buffer``'s blocks ``device_blocks`` (and the
        host states ``host_states`` into the Mamba ``states``' slots ``device_slots``)."""
        copier = self.copier

        def copies():
            if device_blocks.size:
                staged = torch.empty((device_blocks.size, *self.block_shape),
                                     dtype=self.kv.dtype, device=self.device)
                for start, slot, length in _runs(host_blocks):
                    staged[start:start + length].copy_(self.kv[slot:slot + length],
                                                       non_blocking=True)
                self._blocks_view(buffer).index_copy_(0, copier.index(device_blocks), staged)
            if device_slots is not None and device_slots.size:
                index = copier.index(device_slots)
                for host, state in zip(self.mamba, states):
                    staged = torch.empty((device_slots.size, *host.shape[1:]), dtype=host.dtype,
                                         device=self.device)
                    for start, slot, length in _runs(host_states):
                        staged[start:start + length].copy_(host[slot:slot + length],
                                                           non_blocking=True)
                    state.movedim(1, 0).index_copy_(0, index, staged)

        copier.run(copies)
