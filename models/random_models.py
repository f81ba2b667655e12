"""Small ``transformers`` causal LMs with random weights, by family name, for the demo
(``python -m dynctx demo --model NAME``) and the tests: nothing downloads.

``random_causal_lm(name, ...)`` builds the family's model from the common sizes (the windowed
families get a sliding window; the MoE families 4 experts, 2 per token; DeepSeek-V3 one
expert group, as a tiny config needs), and ``kv_block_bytes`` gives the bytes of one KV block
of a rank, to size a context in blocks."""

from __future__ import annotations

from typing import Any, Dict

import torch

_ALTERNATING = ["sliding_attention", "full_attention"]

# name -> (config class, model class, fields beyond the common sizes; "{window}" is replaced
# by the window).
RANDOM_MODELS: Dict[str, tuple] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(use_sliding_window=True, sliding_window="{window}", max_window_layers=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window="{window}")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(layer_types="{alternating}", sliding_window="{window}")),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(layer_types="{alternating}", sliding_window="{window}",
                     num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size="{half}")),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window="{window}")),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(q_lora_rank=None, kv_lora_rank="{half_head_total}",
                         qk_rope_head_dim="{head_dim}", qk_nope_head_dim="{head_dim}",
                         v_head_dim="{head_dim}", n_routed_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size="{half}", n_shared_experts=1,
                         first_k_dense_replace=1, n_group=1, topk_group=1)),
}


def random_causal_lm(name: str, *, vocab: int = 512, hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                     max_positions: int = 256, window: int = 16, seed: int = 0,
                     **overrides: Any) -> Any:
    """The family ``name``'s causal LM (eval mode, fp32, random weights drawn after
    ``torch.manual_seed(seed)``). ``overrides`` go to its config."""
    import transformers

    if name not in RANDOM_MODELS:
        raise ValueError(f"model {name!r} is not one of {sorted(RANDOM_MODELS)}")
    config_name, model_name, extra = RANDOM_MODELS[name]
    head_dim = hidden // heads
    values = {"{window}": window, "{alternating}": _ALTERNATING, "{half}": intermediate // 2,
              "{head_dim}": head_dim, "{half_head_total}": hidden // 2}
    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads if name == "deepseek_v3" else kv_heads,
                  max_position_embeddings=max_positions)
    if name != "deepseek_v3":
        fields["head_dim"] = head_dim
    fields.update({key: values.get(value, value) if isinstance(value, str) else value
                   for key, value in extra.items()})
    fields.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**fields)
    return getattr(transformers, model_name)(config).eval()


def kv_block_bytes(model: Any, block_size: int, tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block (every layer) of one rank: K and V of its share of the KV heads
    (one, replicated, when the ranks outnumber them), or an MLA model's latent row."""
    config = model.config
    itemsize = next(model.parameters()).element_size()
    if getattr(config, "kv_lora_rank", None):
        return (itemsize * config.num_hidden_layers * block_size
                * (config.kv_lora_rank + config.qk_rope_head_dim))
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_rank = max(1, kv_heads // tensor_parallel_size)
    return itemsize * 2 * config.num_hidden_layers * block_size * per_rank * head_dim


__all__ = ["RANDOM_MODELS", "kv_block_bytes", "random_causal_lm"]
