"""Helpers shared by the kernel tests: devices, poisoned buffers, token layouts and the checks
that several test files make in the same words.

pytest puts this folder on ``sys.path`` (``rootdir``-relative "prepend" import, as for
``tests/context/helpers.py``), so test files import it as ``kernel_test_utils``.
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_rope_close

from dynctx.kernels import autotune
from dynctx.kernels._common import bits

__all__ = ["DEVICE", "DTYPES", "POISONS", "assert_only_views_written", "assert_raises_naming",
           "assert_rotated_heads", "bits", "byte_view", "check_presets_share_space",
           "check_tune_case", "poisoned", "preset_configs", "token_layout"]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
# 0xFF bytes, then 0x5A bytes: a row the kernel should set to -1 but skips is caught too.
POISONS = (0xFF, 0x5A)


def byte_view(x: torch.Tensor) -> torch.Tensor:
    """The bytes of ``x`` (made contiguous), for bit-for-bit comparisons of any dtype."""
    return x.contiguous().view(torch.uint8)


def poisoned(shape, dtype, poison: int, device, *, guard: int):
    """``(buffer, view)``: a buffer of ``poison`` bytes with ``guard`` entries on each side of
    every dim, and the ``shape`` view inside it."""
    buf = torch.empty([s + 2 * guard for s in shape], dtype=dtype, device=device)
    buf.view(torch.uint8).fill_(poison)
    return buf, buf[tuple(slice(guard, guard + size) for size in shape)]


def token_layout(kind: str, block_size: int, num_blocks: int, gen: torch.Generator):
    """(block_ids, slots) for a named token layout; the last block is the dummy block.

    ``kind`` is ``"+"``-joined ``what:count`` items: ``decode`` (one token per request, each in
    its own block, the first at the block's last slot), ``prefill`` (a chunk starting mid-block
    and crossing block boundaries), ``pad`` (padding tokens at the dummy block's slot 0).
    """
    dummy = num_blocks - 1
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()
    parts: list[tuple[int, int]] = []
    for item in kind.split("+"):
        what, count = item.split(":")
        count = int(count)
        if what == "decode":
            for i in range(count):
                slot = (block_size - 1 if i == 0
                        else int(torch.randint(0, block_size, (1,), generator=gen)))
                parts.append((free.pop(), slot))
        elif what == "prefill":
            start = 3 % block_size
            blocks = [free.pop() for _ in range(math.ceil((start + count) / block_size))]
            parts += [(blocks[(start + t) // block_size], (start + t) % block_size)
                      for t in range(count)]
        elif what == "pad":
            parts += [(dummy, 0)] * count
        else:
            raise AssertionError(what)
    block_ids = torch.tensor([b for b, _ in parts], dtype=torch.int64).reshape(-1)
    slots = torch.tensor([s for _, s in parts], dtype=torch.int64).reshape(-1)
    return block_ids, slots


def check_presets_share_space(configs, default_config, presets, key: dict) -> None:
    """Every preset has ``configs(key)`` as its search space and its default inside it; the
    space has no repeats."""
    space = configs(key)
    for preset in presets():
        assert configs(preset) == space
        assert default_config(preset) in space
    assert len(set(space)) == len(space)


def check_tune_case(tuning, key: dict, configs=None) -> None:
    """``tuning.make_case(key)`` passes its ``check`` with each of ``configs`` (the default
    config when None), runs its reference, and counts the bytes it moves."""
    case = tuning.make_case(key, DEVICE)
    for config in [tuning.default_config(key)] if configs is None else configs:
        case.check(config)
    case.run_reference()
    assert case.bytes_moved > 0


def assert_raises_naming(call, name: str, backend: str, monkeypatch) -> None:
    """With the kernel backend set to ``backend``, ``call()`` raises a ``ValueError`` whose
    message matches ``name`` (the argument at fault)."""
    monkeypatch.setenv("DYNCTX_KERNEL_BACKEND", backend)
    with pytest.raises(ValueError, match=name):
        call()


def preset_configs(name: str) -> list:
    """Every config of kernel ``name``'s search spaces over its presets, without repeats."""
    tuning = autotune.get_tuning(name)
    configs = []
    for key in tuning.presets():
        configs += [c for c in tuning.configs(key) if c not in configs]
    return configs


def assert_rotated_heads(name: str, got, want, before, n: int, rot: int, mscale: float) -> None:
    """Rows ``< n`` of ``got`` ``[T, H, D]`` are ``want`` rotated on dims ``< rot`` (within
    ``rope_tolerance``) and ``before`` bit for bit past them; rows ``>= n`` are ``before``."""
    assert_rope_close(got[:n, :, :rot], want[:n, :, :rot], mscale, name)
    assert torch.equal(byte_view(got[:n, :, rot:]), byte_view(before[:n, :, rot:])), f"{name} tail"
    assert torch.equal(byte_view(got[n:]), byte_view(before[n:])), f"{name} guard rows"


def assert_only_views_written(base, snapshot, views, used, message: str) -> None:
    """Nothing of ``base`` outside the ``used`` views moved: put those views back from
    ``snapshot`` in a copy and compare the whole buffer bit for bit."""
    restored = base.clone()
    for got, before, in_use in zip(views(restored), views(snapshot), used):
        if in_use:
            got.copy_(before)
    assert torch.equal(byte_view(restored), byte_view(snapshot)), message
