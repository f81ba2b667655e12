"""The block allocator's Megatron-Core surface: tensors in and out, and ``total_avail`` moved by
hand as Megatron's tests do (the context's own numpy path is covered by test_context.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynctx.context import BlockAllocator


def test_allocate_returns_an_int32_cpu_tensor_and_the_host_form_numpy():
    alloc = BlockAllocator(total_count=10, paused_count=2)
    blocks = alloc.allocate_memory_blocks(3)
    assert isinstance(blocks, torch.Tensor)
    assert blocks.dtype == torch.int32 and blocks.device.type == "cpu"
    assert blocks.tolist() == [6, 7, 8] and alloc.total_avail == 6
    host = alloc.allocate_memory_blocks_host(2)
    assert isinstance(host, np.ndarray) and host.dtype == np.int32
    assert host.tolist() == [4, 5] and alloc.total_avail == 4
    empty = alloc.allocate_memory_blocks(0)
    assert empty.shape == (0,) and alloc.total_avail == 4
    assert alloc.allocate_memory_blocks(5) is None and alloc.total_avail == 4
    # The returned tensor is the caller's: writing it does not touch the allocator's stack.
    blocks.fill_(0)
    assert alloc.block_bag[6:9].tolist() == [6, 7, 8]


@pytest.mark.parametrize("form", [
    pytest.param(lambda ids: torch.tensor(ids, dtype=torch.int64), id="tensor-int64"),
    pytest.param(lambda ids: torch.tensor(ids, dtype=torch.int32), id="tensor-int32"),
    pytest.param(lambda ids: torch.tensor(ids).reshape(len(ids), 1), id="tensor-2d"),
    pytest.param(lambda ids: np.array(ids, dtype=np.int64), id="numpy"),
    pytest.param(list, id="list"),
])
def test_release_accepts_tensors_arrays_and_lists(form):
    alloc = BlockAllocator(total_count=10, paused_count=2)
    blocks = alloc.allocate_memory_blocks(4)
    alloc.release_memory_blocks(form(blocks[2:].tolist()))
    assert alloc.total_avail == 7
    # Megatron's order: the released ids go back on top of the stack, the last one on top.
    assert alloc.allocate_memory_blocks(1).item() == blocks[3].item()
    alloc.release_memory_blocks(form([-1, blocks[0].item()]))  # -1 entries are ignored
    assert alloc.total_avail == 7


@pytest.mark.parametrize("blocks,error,match", [
    pytest.param(torch.tensor([1.0]), TypeError, "integer block ids", id="float-tensor"),
    pytest.param(torch.tensor([True]), TypeError, "integer block ids", id="bool-tensor"),
    pytest.param(np.array([1.5]), TypeError, "integer block ids", id="float-array"),
    pytest.param([10], ValueError, "total_count=10", id="beyond-total"),
    pytest.param([2 ** 40], ValueError, "total_count=10", id="beyond-int32"),
    pytest.param([3], RuntimeError, "not allocated", id="free-block"),
    pytest.param([9], RuntimeError, "not allocated", id="dummy"),
])
def test_release_refuses_bad_ids_without_change(blocks, error, match):
    alloc = BlockAllocator(total_count=10, paused_count=2)
    alloc.allocate_memory_blocks(2)
    bag, refs = alloc.block_bag.copy(), alloc.ref_counts.copy()
    with pytest.raises(error, match=match):
        alloc.release_memory_blocks(blocks)
    assert alloc.total_avail == 7
    assert np.array_equal(alloc.block_bag, bag) and np.array_equal(alloc.ref_counts, refs)


@pytest.mark.parametrize("blocks", [[-1], [10]])
def test_share_refuses_ids_outside_the_pool(blocks):
    alloc = BlockAllocator(total_count=10, paused_count=2)
    alloc.allocate_memory_blocks(2)
    with pytest.raises(ValueError, match="total_count=10"):
        alloc.share(blocks)


def test_total_avail_moved_by_hand_takes_and_frees_the_top_of_the_stack():
    alloc = BlockAllocator(total_count=10, paused_count=2)
    alloc.total_avail -= 3  # Megatron's tests reserve blocks this way
    assert alloc.get_total_used() == 3
    assert alloc.ref_counts[[6, 7, 8]].tolist() == [1, 1, 1]
    alloc.total_avail += 3  # and raising it back undoes that
    assert alloc.get_total_used() == 0 and not alloc.ref_counts.any()
    alloc.total_avail -= 2
    alloc.release_memory_blocks(torch.tensor([8, 7]))  # blocks taken by hand can be released
    assert alloc.total_avail == 9 and not alloc.ref_counts.any()
    assert alloc.block_bag[7:9].tolist() == [8, 7]
    assert alloc.is_memory_available(9) and not alloc.is_memory_available(10)
    for bad, error in ((10, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="total_avail"):
            alloc.total_avail = bad
    assert alloc.total_avail == 9


@pytest.mark.gpu
def test_release_of_a_cuda_tensor():
    """Megatron's tests release the ids as a CUDA tensor: it is copied to the host."""
    alloc = BlockAllocator(total_count=10, paused_count=2)
    blocks = alloc.allocate_memory_blocks(2)
    alloc.release_memory_blocks(blocks.to("cuda"))
    assert alloc.total_avail == 9
