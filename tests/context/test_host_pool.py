"""The host block pool (context/host_pool.py): whole blocks across layers to the host and back,
bit-exact in every dtype, through runs of consecutive host slots; its free stacks never lose or
double a slot (``check``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynctx.context.host_pool import HostBlockPool, _runs


def make_pool(buffer: torch.Tensor, block_dim: int, blocks: int, states=()):
    shape = tuple(n for i, n in enumerate(buffer.shape) if i != block_dim)
    pool = HostBlockPool(blocks=blocks, block_shape=shape, block_dim=block_dim,
                         dtype=buffer.dtype, device=buffer.device, states=len(states) and 4,
                         state_shapes=[(s.shape[0], *s.shape[2:]) for s in states],
                         state_dtypes=[s.dtype for s in states])
    pool.allocate()
    return pool


def test_runs_of_consecutive_slots():
    assert _runs(np.array([], dtype=np.int64)) == []
    assert _runs(np.array([3, 4, 5, 9, 1, 2])) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_blocks_round_trip_bit_exact(dtype, mla):
    torch.manual_seed(0)
    shape = (3, 7, 4, 10) if mla else (2, 3, 7, 4, 2, 5)
    block_dim = 1 if mla else 2
    source = torch.randn(shape).to(dtype)
    pool = make_pool(source, block_dim, blocks=6)
    device_blocks = np.array([5, 0, 3, 4])
    host = np.concatenate([pool.take(2, 0)[0], pool.take(2, 0)[0]])
    pool.save(source, device_blocks, host)
    target = torch.zeros(shape).to(dtype)
    back = np.array([6, 1, 2, 0])
    pool.load(target, host, back)
    for src, dst in zip(device_blocks, back):
        assert torch.equal(source.select(block_dim, int(src)).view(torch.uint8),
                           target.select(block_dim, int(dst)).view(torch.uint8))
    untouched = [b for b in range(shape[block_dim]) if b not in back]
    for b in untouched:
        assert not target.select(block_dim, b).float().any()
    pool.check(host, np.empty(0, dtype=np.int64))


def test_mamba_states_round_trip():
    torch.manual_seed(1)
    kv = torch.randn(2, 1, 5, 4, 2, 3)
    conv, ssm = torch.randn(2, 6, 8, 4), torch.randn(2, 6, 4, 3, 3)
    pool = make_pool(kv, 2, blocks=4, states=(conv, ssm))
    blocks, states = pool.take(1, 2)
    pool.save(kv, np.array([2]), blocks, states=(conv, ssm), device_slots=np.array([4, 1]),
              host_states=states)
    conv2, ssm2 = torch.zeros_like(conv), torch.zeros_like(ssm)
    pool.load(torch.zeros_like(kv), blocks, np.array([0]), states=(conv2, ssm2),
              host_states=states[::-1].copy(), device_slots=np.array([0, 5]))
    assert torch.equal(conv2[:, 0], conv[:, 1]) and torch.equal(conv2[:, 5], conv[:, 4])
    assert torch.equal(ssm2[:, 0], ssm[:, 1]) and torch.equal(ssm2[:, 5], ssm[:, 4])


def test_free_stacks_and_invariants():
    pool = make_pool(torch.zeros(2, 1, 3, 2, 1, 1), 2, blocks=5)
    taken, _ = pool.take(3, 0)
    assert pool.free_blocks == 2 and sorted(taken.tolist()) == [0, 1, 2]
    pool.check(taken, np.empty(0, dtype=np.int64))
    with pytest.raises(AssertionError, match="lost"):
        pool.check(taken[:2], np.empty(0, dtype=np.int64))
    with pytest.raises(AssertionError, match="twice"):
        pool.check(np.concatenate([taken, taken[:1]]), np.empty(0, dtype=np.int64))
    with pytest.raises(RuntimeError, match="3 slots asked, 2 free"):
        pool.take(3, 0)
    pool.give(taken, np.empty(0, dtype=np.int64))
    with pytest.raises(RuntimeError, match="overflows"):
        pool.give(taken[:1], np.empty(0, dtype=np.int64))
    pool.check(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    assert pool.nbytes() == 5 * 2 * 1 * 2 * 1 * 1 * 4
