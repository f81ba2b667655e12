"""The one shape registry shared by benchmarks, tuning presets and tests (docs/DESIGN.md §5).

Plain dicts and tuples only, no imports: kernel files may read these numbers to build their
``presets()`` keys without pulling in anything else. Dimensions are per tensor-parallel rank
with ``tensor_model_parallel_size=1``. Token counts are the packed tokens of one forward pass;
keys bucket them to powers of two, so every count here is one.

Sources: the models' published ``config.json`` values (Llama-3-8B, DeepSeek-V2-Lite) and the
defaults of ``transformers``' ``NemotronHConfig`` (Nemotron-H-8B: 52 layers, of which 24 Mamba2,
4 attention and 24 MLP). ``block_size`` is Megatron-Core's default of 256 tokens, and 64 for
MLA, which its FlashMLA path requires.
"""

LLAMA_3_8B = {
    "name": "Llama-3-8B",
    "attention": "gqa",
    "num_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rotary_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 128256,
    "block_size": 256,
    "dtype": "bfloat16",
}

DEEPSEEK_V2_LITE = {
    "name": "DeepSeek-V2-Lite",
    "attention": "mla",
    "num_layers": 27,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "rope_theta": 10000.0,
    "max_position_embeddings": 163840,
    "vocab_size": 102400,
    "block_size": 64,
    "dtype": "bfloat16",
}

NEMOTRON_H_8B = {
    "name": "Nemotron-H-8B (Mamba2 hybrid)",
    "attention": "gqa",
    "num_layers": 52,
    "num_mamba_layers": 24,
    "num_attention_layers": 4,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "vocab_size": 131072,
    "block_size": 256,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    # conv channels: mamba_num_heads * mamba_head_dim + 2 * n_groups * ssm_state_size
    "conv_dim": 128 * 64 + 2 * 8 * 128,
    "ssm_state_dtype": "float32",
    "conv_state_dtype": "bfloat16",
    "dtype": "bfloat16",
}

MODELS = {
    "llama": LLAMA_3_8B,
    "mla": DEEPSEEK_V2_LITE,
    "mamba": NEMOTRON_H_8B,
}

# Decode: one token per active request; prefill: the packed prompt tokens of a step.
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS = (512, 2048, 8192)
TOKEN_COUNTS = {"decode": DECODE_TOKENS, "prefill": PREFILL_TOKENS}

# A small stand-in for each model, for CPU runs of the torch references and interpreter checks:
# the same field names, dimensions cut down, token counts tiny.
SMALL_TOKENS = (1, 4)
SMALL_MODELS = {
    "llama": {**LLAMA_3_8B, "name": "llama-small", "num_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rotary_dim": 16, "vocab_size": 256, "block_size": 16},
    "mla": {**DEEPSEEK_V2_LITE, "name": "mla-small", "num_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 256, "block_size": 16},
    "mamba": {**NEMOTRON_H_8B, "name": "mamba-small", "num_layers": 4, "num_mamba_layers": 2,
              "num_attention_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
              "block_size": 16, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8,
              "n_groups": 2, "conv_dim": 4 * 8 + 2 * 2 * 8},
}


def token_counts(phase: str | None = None) -> tuple[int, ...]:
    """Token counts of one phase (``"decode"`` or ``"prefill"``), or of both in order."""
    if phase is None:
        return DECODE_TOKENS + PREFILL_TOKENS
    return TOKEN_COUNTS[phase]
