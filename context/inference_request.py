"""Megatron-Core 0.19's module-level request helpers (``megatron/core/inference/
inference_request.py`` at tag ``core_v0.19.0``); the request classes are in ``requests.py``.

``compute_block_hashes_batched`` gives the block hashes a 0.19 request precomputes and 0.19's
data-parallel coordinator routes by. dynctx's own prefix cache matches blocks on its digests
(``prefix_cache.py``: BLAKE2b, salted per request, verified against the token bytes on every
lookup); these integers are 0.19's names for the same blocks (docs/SEMANTICS.md §16).
"""

from __future__ import annotations

import hashlib
import numbers
from typing import List

import torch

__all__ = ["compute_block_hashes_batched"]

#: SHA-256's digest size, and the parent "digest" of a prompt's first block (zeros).
_DIGEST_BYTES = 32
_HASH_MODULUS = 2**63 - 1


def compute_block_hashes_batched(prompt_tokens: torch.Tensor, block_size: int) -> List[int]:
    """One hash per complete block of ``prompt_tokens``, each chained to its parent's.

    Block ``i``'s digest is ``SHA-256(digest(i - 1) || int64 bytes of its tokens)`` with 32 zero
    bytes before the first block; its hash is the first 8 digest bytes read as a little-endian
    unsigned integer, reduced to ``[1, 2**63 - 1]`` (``raw % (2**63 - 1) + 1``), so that it never
    equals the sentinels -1 and 0. These are 0.19's values exactly (pinned in
    ``tests/megatron019/test_block_hashes.py`` and checked against 0.19's function by the port's
    runner).

    Args:
        prompt_tokens: ``[seq_len]`` token ids, any device; converted to int64 as 0.19 does.
        block_size: tokens per block, at least 1.

    Returns:
        ``seq_len // block_size`` ints; the trailing partial block has none.
    """
    if not isinstance(prompt_tokens, torch.Tensor):
        raise TypeError(f"prompt_tokens must be a torch.Tensor of token ids, "
                        f"got {type(prompt_tokens).__name__}")
    if prompt_tokens.dim() != 1:
        raise ValueError(f"prompt_tokens must be 1-D [seq_len], got shape "
                         f"{tuple(prompt_tokens.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(f"block_size={block_size!r} must be an int")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    block_size = int(block_size)
    num_complete_blocks = prompt_tokens.numel() // block_size
    if num_complete_blocks == 0:
        return []
    tokens = prompt_tokens[: num_complete_blocks * block_size].to(torch.int64).cpu()
    data = tokens.numpy().tobytes()
    block_bytes = block_size * tokens.element_size()
    hashes = []
    parent = b"\x00" * _DIGEST_BYTES
    for start in range(0, len(data), block_bytes):
        parent = hashlib.sha256(parent + data[start:start + block_bytes]).digest()
        raw = int.from_bytes(parent[:8], byteorder="little", signed=False)
        hashes.append(raw % _HASH_MODULUS + 1)
    return hashes
