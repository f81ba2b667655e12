"""Tiny random models of the decoder families the generic transformers path serves, and their
block sizes (shared by the generic e2e tests).

Each has 2 layers, hidden size 32 and a vocabulary of 128; the windowed ones have a sliding
window of 6 tokens, shorter than most prompts of the tests, so that a window that is ignored
gives other tokens (``test_generic_families.py`` checks that in transformers itself)."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from dynctx.models.random_models import kv_block_bytes as random_kv_block_bytes
from dynctx.models.random_models import random_causal_lm

VOCAB = 128
WINDOW = 6
# The families of the generic path (dynctx.models.random_models has them and the dedicated
# ones), and those with sliding windows.
FAMILIES = ("qwen3", "qwen2", "mistral", "gemma3", "gpt_oss", "qwen3_moe", "mixtral", "phi3",
            "olmo2")
WINDOWED = ("qwen3", "mistral", "gemma3", "gpt_oss", "mixtral")


def tiny_family(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides) -> torch.nn.Module:
    """The family's tiny model with random weights (``initializer_range=0.1``: transformers'
    0.02 gives nearly uniform attention; sinks drawn too: transformers starts them at zero)."""
    model = random_causal_lm(name, vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2,
                             intermediate=64, max_positions=256, window=WINDOW, seed=seed,
                             **dict(dict(initializer_range=0.1), **overrides))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_()
    return model.to(dtype)


def without_windows(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose windows are wider than any sequence of the tests (the same
    weights, full attention in effect)."""
    wide = copy.deepcopy(model)
    wide.config.sliding_window = 10_000
    for module in wide.modules():
        if getattr(module, "sliding_window", None) is not None:
            module.sliding_window = 10_000
    return wide


def kv_block_bytes(model: torch.nn.Module) -> Callable[..., int]:
    """``block_bytes(hf, block_size)`` for ``gib_for_blocks``: one K/V block of every layer."""

    def block_bytes(hf, block_size: int) -> int:
        return random_kv_block_bytes(model, block_size)

    return block_bytes


__all__ = ["FAMILIES", "VOCAB", "WINDOW", "WINDOWED", "kv_block_bytes", "tiny_family",
           "without_windows"]
