"""The model shapes the kernels are tuned for: the one table every ``<kernel>_presets()`` reads.

``python -m dynctx autotune tune|bench`` and ``bench/`` reach these shapes through the
presets (``dynctx.kernels.registry``), so a shape changed here changes what is tuned, timed
and benchmarked, everywhere at once. Dimensions are per tensor-parallel rank with
``tensor_model_parallel_size=1``; token counts stay in each kernel's presets (they bucket to
powers of two). Plain values, no imports.

Sources: Llama-3-8B's and DeepSeek-V2-Lite's published ``config.json``; the Mamba2 mixer is a
NemotronH-style layer of 64 heads of 64 (``d_inner`` 4096), 8 groups, ``d_state`` 128 and
``d_conv`` 4. ``BLOCK_SIZE`` is Megatron-Core's default KV block of 256 tokens.
"""

LLAMA_3_8B = {
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rotary_dim": 128,
    "vocab_size": 128256,
    "dtype": "bfloat16",
}

DEEPSEEK_V2_LITE = {
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "dtype": "bfloat16",
}

MAMBA2_MIXER = {
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "dtype": "bfloat16",
}
# d_inner + 2 * n_groups * d_state conv channels, d_conv taps; SSM state [heads, head_dim, d_state].
MAMBA2_CONV_STATE = (MAMBA2_MIXER["mamba_num_heads"] * MAMBA2_MIXER["mamba_head_dim"]
                     + 2 * MAMBA2_MIXER["n_groups"] * MAMBA2_MIXER["ssm_state_size"],
                     MAMBA2_MIXER["conv_kernel"])
MAMBA2_SSM_STATE = (MAMBA2_MIXER["mamba_num_heads"], MAMBA2_MIXER["mamba_head_dim"],
                    MAMBA2_MIXER["ssm_state_size"])

BLOCK_SIZE = 256
