"""Host-side mirrors of small device state, and host-to-device copies without blocking.

``HostArena`` lays several small typed arrays (per-request fields, request metadata, attention
metadata, the compaction plan) out in one byte buffer that exists twice: a numpy mirror the host
writes, and a device tensor the kernels read. ``flush`` moves it in ONE copy. On a CPU device
the two are one buffer (the tensor is ``torch.from_numpy`` of the mirror): nothing is copied,
``flush`` does nothing, and every host write is at once what the kernels read.

``HostToDevice`` stages uploads in pinned memory (a ring of two buffers, each reused only after
the copy that last read it has finished), so every upload is non-blocking on CUDA. On a CPU
device it copies directly.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

_ALIGN = 16

_NP_DTYPES = {
    torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32,
    torch.float64: np.float64, torch.bool: np.bool_, torch.int16: np.int16,
    torch.int8: np.int8, torch.uint8: np.uint8, torch.float16: np.float16,
}


def numpy_dtype(dtype: torch.dtype):
    try:
        return _NP_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot live in a host arena; supported: "
                         f"{sorted(str(d) for d in _NP_DTYPES)}") from None


class HostToDevice:
    """Non-blocking host-to-device copies through a pinned two-buffer ring."""

    def __init__(self, device: torch.device, capacity_bytes: int):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.capacity = int(capacity_bytes)
        if self.pinned:
            self._buffers = [torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)
                             for _ in range(2)]
            self._events = [None, None]
        self._current = 0
        self._offset = 0

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """``dst.copy_(src)`` for a contiguous numpy ``src`` of the same shape and dtype."""
        src = np.ascontiguousarray(src)
        if not self.pinned:
            dst.copy_(torch.from_numpy(src).view(dst.shape), non_blocking=True)
            return
        nbytes = src.nbytes
        if nbytes > self.capacity:
            raise ValueError(f"upload of {nbytes} bytes exceeds the staging capacity "
                             f"{self.capacity}")
        start = -(-self._offset // _ALIGN) * _ALIGN
        if start + nbytes > self.capacity:
            self.advance()
            start = 0
        if self._offset == 0 and self._events[self._current] is not None:
            # The copies that last read this buffer must be done before we overwrite it.
            self._events[self._current].synchronize()
        buffer = self._buffers[self._current]
        buffer.numpy()[start:start + nbytes] = src.view(np.uint8).reshape(-1)
        staged = buffer[start:start + nbytes].view(dst.dtype).view(dst.shape)
        dst.copy_(staged, non_blocking=True)
        self._offset = start + nbytes

    def advance(self) -> None:
        """Close the current buffer (record its event) and switch to the other one."""
        if not self.pinned or self._offset == 0:
            return
        event = torch.cuda.Event()
        event.record()
        self._events[self._current] = event
        self._current ^= 1
        self._offset = 0


class HostArena:
    """Typed sections of one byte buffer, mirrored on the host and the device."""

    def __init__(self, sections: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 device: torch.device):
        layout = []
        offset = 0
        for name, dtype, shape in sections:
            offset = -(-offset // _ALIGN) * _ALIGN
            nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            layout.append((name, dtype, tuple(shape), offset, nbytes))
            offset += nbytes
        self.nbytes = -(-offset // _ALIGN) * _ALIGN
        self.layout = layout
        self.device_type = torch.device(device)
        self.host_bytes = np.zeros(self.nbytes, dtype=np.uint8)
        self.host: dict[str, np.ndarray] = {}
        for name, dtype, shape, start, nbytes in layout:
            host = self.host_bytes[start:start + nbytes].view(numpy_dtype(dtype))
            self.host[name] = host.reshape(shape)
        # A CPU device reads the host mirror itself: no copy per step (44-88 KB at 1024 rows,
        # and a copy that size enters an OpenMP region on a multi-threaded torch).
        self.set_shared(self.device_type.type == "cpu")
        self.dirty = False

    def set_shared(self, shared: bool) -> None:
        """Make the device side the host buffer itself (CPU devices only) or a separate
        buffer holding a copy of it; the ``device`` views are new either way."""
        if shared and self.device_type.type != "cpu":
            raise ValueError(f"a {self.device_type} arena cannot share the host buffer")
        self.shared = bool(shared)
        if self.shared:
            self.device_bytes = torch.from_numpy(self.host_bytes)
        else:
            self.device_bytes = torch.from_numpy(self.host_bytes.copy()).to(self.device_type)
        self.device: dict[str, torch.Tensor] = {}
        for name, dtype, shape, start, nbytes in self.layout:
            self.device[name] = self.device_bytes[start:start + nbytes].view(dtype).view(shape)

    def flush(self, h2d: HostToDevice) -> None:
        """Copy the whole host mirror to the device in one copy (none when shared); clears
        ``dirty``."""
        if not self.shared:
            h2d.copy(self.device_bytes, self.host_bytes)
        self.dirty = False
