"""The read-back buffers of async scheduling (``engine/overlap.py``, ``TokenReadback``)."""

from __future__ import annotations

import pytest
import torch

from dynctx.engine.overlap import TokenReadback


def test_a_readback_is_never_overwritten_before_it_is_read():
    """Two buffers: a third copy while both hold unread copies raises instead of overwriting
    the oldest (before, the buffer flipped on every start); a read or a discard frees one."""
    readback = TokenReadback(torch.device("cpu"), capacity=4)
    first = readback.start(torch.tensor([1, 2, 3]))
    second = readback.start(torch.tensor([4, 5]))
    with pytest.raises(RuntimeError, match="hold copies not read yet"):
        readback.start(torch.tensor([6]))
    readback.discard(second)  # the step that started it raised: never read
    third = readback.start(torch.tensor([7, 8, 9, 10]))
    assert readback.read(first) == [1, 2, 3]
    assert readback.read(third) == [7, 8, 9, 10]
    with pytest.raises(RuntimeError, match="already read or discarded"):
        readback.read(first)
    with pytest.raises(RuntimeError, match="exceed the readback buffer of 4"):
        readback.start(torch.arange(5))
    assert readback.reads == 2


def test_the_copy_is_taken_when_started():
    """A read gives the values as they were at ``start`` (the copy), not the tensor's values
    at the read."""
    readback = TokenReadback(torch.device("cpu"), capacity=3, dtype=torch.float32)
    values = torch.tensor([0.5, 1.5])
    handle = readback.start(values)
    values.fill_(9.0)
    assert readback.read(handle) == [0.5, 1.5]
