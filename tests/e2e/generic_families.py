"""Tiny random models of the decoder families the generic transformers path serves, and their
block sizes (shared by the generic e2e tests and ``python -m dynctx demo --model``'s tests).

Each has 2 layers, hidden size 32 and a vocabulary of 128; the windowed ones have a sliding
window of 6 tokens, shorter than most prompts of the tests, so that a window that is ignored
gives other tokens (``test_generic_families.py`` checks that in transformers itself)."""

from __future__ import annotations

import copy
from typing import Callable, Dict

import torch
import transformers as T

VOCAB = 128
WINDOW = 6
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=256, initializer_range=0.1)
_ALTERNATING = ["sliding_attention", "full_attention"]

# name -> (config class, model class, config fields beyond _COMMON)
FAMILIES: Dict[str, tuple] = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM,
              dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               dict(layer_types=_ALTERNATING, sliding_window=WINDOW)),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM,
                dict(layer_types=_ALTERNATING, sliding_window=WINDOW, num_local_experts=4,
                     num_experts_per_tok=2)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(pad_token_id=0)),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
}
WINDOWED = ("qwen3", "mistral", "gemma3", "gpt_oss", "mixtral")


def tiny_family(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides) -> torch.nn.Module:
    """The family's tiny model with random weights (sinks too: transformers starts them at
    zero)."""
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    config = config_cls(**dict(_COMMON, **extra, **overrides))
    model = model_cls(config).eval()
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
    config = model.config
    itemsize = next(model.parameters()).element_size()

    def block_bytes(hf, block_size: int) -> int:
        return (itemsize * 2 * config.num_hidden_layers * block_size
                * config.num_key_value_heads * config.head_dim)

    return block_bytes


__all__ = ["FAMILIES", "VOCAB", "WINDOW", "WINDOWED", "kv_block_bytes", "tiny_family",
           "without_windows"]
