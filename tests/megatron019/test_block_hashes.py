"""``compute_block_hashes_batched`` against Megatron-Core 0.19's values, pinned.

The values were computed once with 0.19's own function (``megatron/core/inference/
inference_request.py`` at tag ``core_v0.19.0``, run from its source on a CPU). In CI (dynctx
mode) they check dynctx's function; run by ``run_port.py`` (megatron019 mode) the same cases
check 0.19's, so the pins are compared with the real function. The argument checks at the end
are dynctx's own (0.19 checks nothing).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from mcore019_port import MODE, compute_block_hashes_batched

CASES = {
    "arange10-bs4": (torch.arange(10), 4,
                     [4832768347186360981, 8533535913844734714]),
    "zeros128-bs32": (torch.zeros(128, dtype=torch.long), 32,
                      [2634110215722980655, 2632557350752158080, 8891662694337536696,
                       3856343049086982874]),
    "int64-extremes-bs3": (torch.tensor([2**40, -1, 0, 151643, 2**63 - 1, -2**63]), 3,
                           [1808214724845537889, 3192991194367802967]),
    "int32-bs2": (torch.arange(8, dtype=torch.int32), 2,
                  [778151299291147080, 7439714760811421429, 3447384042913313247,
                   8827045722856784269]),
    "float32-bs2": (torch.arange(8, dtype=torch.float32), 2,
                    [778151299291147080, 7439714760811421429, 3447384042913313247,
                     8827045722856784269]),
    "strided-bs4": (torch.arange(16)[::2], 4,
                    [5749811952826339146, 5543349027469990662]),
    "bs1": (torch.tensor([7, 7, 7]), 1,
            [6981451605787958606, 3117417896917321807, 5542537853086653660]),
    "first-token-99-bs4": (torch.tensor([99, 1, 2, 3, 4, 5, 6, 7]), 4,
                           [9184563825554128772, 7768952812251765373]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_equal_0_19s(name):
    tokens, block_size, expected = CASES[name]
    assert compute_block_hashes_batched(tokens, block_size) == expected


def test_the_rule_written_out():
    """SHA-256 over the parent digest and the block's int64 bytes, zeros before the first."""
    tokens = torch.arange(3, 15)
    block_size = 4
    parent, expected = b"\x00" * 32, []
    for start in range(0, 12, block_size):
        parent = hashlib.sha256(
            parent + np.arange(3 + start, 3 + start + block_size, dtype=np.int64).tobytes()
        ).digest()
        expected.append(int.from_bytes(parent[:8], "little") % (2**63 - 1) + 1)
    assert compute_block_hashes_batched(tokens, block_size) == expected


def test_partial_blocks_have_no_hash_and_chains_depend_on_the_parent():
    assert compute_block_hashes_batched(torch.arange(3), 4) == []
    assert compute_block_hashes_batched(torch.tensor([], dtype=torch.long), 4) == []
    full = compute_block_hashes_batched(torch.arange(8), 4)
    assert compute_block_hashes_batched(torch.arange(11), 4) == full
    assert len(full) == 2 and full[0] != full[1]
    changed = torch.arange(8)
    changed[0] = 99
    other = compute_block_hashes_batched(changed, 4)
    assert other[0] != full[0] and other[1] != full[1]  # same second block, other parent
    assert all(1 <= h <= 2**63 - 1 for h in full + other)


def test_the_input_is_not_modified():
    tokens = torch.arange(10, dtype=torch.int32)
    before = tokens.clone()
    compute_block_hashes_batched(tokens, 4)
    assert torch.equal(tokens, before) and tokens.dtype == torch.int32


@pytest.mark.skipif(MODE == "megatron019", reason="dynctx's argument checks; 0.19 has none")
class TestArgumentChecks:

    def test_block_size_must_be_a_positive_int(self):
        with pytest.raises(ValueError, match=r"block_size=0 must be >= 1"):
            compute_block_hashes_batched(torch.arange(4), 0)
        with pytest.raises(ValueError, match=r"block_size=-2 must be >= 1"):
            compute_block_hashes_batched(torch.arange(4), -2)
        with pytest.raises(TypeError, match=r"block_size=4.0 must be an int"):
            compute_block_hashes_batched(torch.arange(4), 4.0)
        with pytest.raises(TypeError, match=r"block_size=True must be an int"):
            compute_block_hashes_batched(torch.arange(4), True)
        assert compute_block_hashes_batched(torch.arange(8), np.int64(4)) == \
            compute_block_hashes_batched(torch.arange(8), 4)

    def test_prompt_tokens_must_be_a_1d_tensor(self):
        with pytest.raises(TypeError, match=r"prompt_tokens must be a torch.Tensor .* got list"):
            compute_block_hashes_batched([1, 2, 3, 4], 2)
        with pytest.raises(ValueError, match=r"prompt_tokens must be 1-D \[seq_len\], got shape "
                                             r"\(2, 4\)"):
            compute_block_hashes_batched(torch.zeros(2, 4, dtype=torch.long), 2)
