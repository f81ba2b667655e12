"""Llama-style model adapter (GQA, RoPE, RMSNorm, SwiGLU) that runs a step's packed tokens
through a ``DynamicInferenceContext``.

The weights come from a ``transformers`` ``LlamaForCausalLM``; the forward follows the model code
path docs/SEMANTICS.md §11 and §13 describe: ``current_input_and_position_ids``, per layer the
rotary embedding through the context, the KV append, paged attention over the block table,
and last-token logits through ``last_token_logits``. Padding tokens (from
``active_token_count`` to ``padded_active_token_count``) flow through every layer, write their
K/V into the dummy block and their outputs are ignored.

Rotary embedding modes (``rope=``):

* ``"table"`` (default): Megatron's angle table ``[max_seq, 1, 1, head_dim]`` (fp32 angles,
  half-split ``emb = cat(freqs, freqs)``) through ``apply_rotary_emb_key`` and
  ``apply_rotary_emb_query``, then ``append_key_value_cache``;
* ``"cos_sin"``: a ``[max_seq, head_dim]`` cos/sin cache (cos half, then sin half) through
  ``apply_fused_qk_rotary_emb``, then ``append_key_value_cache``.

When the context was built with ``fused_rope_kv_append=True`` the adapter calls
``apply_rotary_emb_and_append_key_value_cache`` instead (one launch: rope on Q and K, and the
append), with the table or the cos/sin cache as ``rope`` says.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ._common import (
    ACTIVATIONS,
    ROPE_MODES,
    SINGLE,
    PagedMhaAdapter,
    TensorParallel,
    activation,
    check_model_class,
    gated_mlp,
    mha_cache_problems,
    placement,
    rms_norm,
    shard_attention,
    shard_gated_mlp,
    static_rotary,
    weight_taker,
)


class LlamaLayerWeights(SimpleNamespace):
    """One decoder layer's tensors (biases None when the model has none)."""


class LlamaAdapter(PagedMhaAdapter):
    """A Llama causal LM whose forward reads and writes a ``DynamicInferenceContext``.

    Build it with ``LlamaAdapter.from_transformers(hf_model)``; call ``forward(ctx)`` after
    ``ctx.initialize_attention_state()``.
    """

    def __init__(self, *, config: Any, embed: torch.Tensor, layers: list, final_norm: torch.Tensor,
                 lm_head: torch.Tensor, inv_freq: torch.Tensor, rope_mscale: float,
                 rope: str = "table", attention_backend: str = "auto",
                 tensor_parallel: TensorParallel = SINGLE):
        if rope not in ROPE_MODES:
            raise ValueError(f"rope={rope!r} must be one of {ROPE_MODES}")
        self.tp = tensor_parallel
        self._init_weights(config=config, embed=embed, layers=layers, final_norm=final_norm,
                           lm_head=lm_head, eps=config.rms_norm_eps,
                           attention_backend=attention_backend)
        self.num_layers = config.num_hidden_layers
        self._init_heads(config)
        self.act = activation(ACTIVATIONS, "hidden_act", getattr(config, "hidden_act", "silu"))
        self._init_rope(inv_freq=inv_freq, rope_mscale=rope_mscale, rope=rope)
        self.rope_config = SimpleNamespace(rotary_interleaved=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_transformers(cls, hf_model: Any, *, device: Optional[torch.device | str] = None,
                          dtype: Optional[torch.dtype] = None, rope: str = "table",
                          attention_backend: str = "auto",
                          tensor_parallel: TensorParallel = SINGLE) -> "LlamaAdapter":
        """Take the weights of a ``transformers`` ``LlamaForCausalLM`` (moved to ``device`` and
        cast to ``dtype`` when given; shared with the model otherwise). With
        ``tensor_parallel`` of more than one rank, this rank's shard: query heads, KV heads
        (replicated when the ranks outnumber them) and MLP channels (``TensorParallel``)."""
        check_model_class(hf_model, "LlamaForCausalLM", "LlamaAdapter")
        config = hf_model.config
        tp = tensor_parallel
        q_heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        rotary = static_rotary(hf_model)
        take = weight_taker(*placement(hf_model, device, dtype))

        layers = []
        for layer in hf_model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(LlamaLayerWeights(
                input_norm=take(layer.input_layernorm.weight),
                q=take(attn.q_proj.weight), q_bias=take(attn.q_proj.bias),
                k=take(attn.k_proj.weight), k_bias=take(attn.k_proj.bias),
                v=take(attn.v_proj.weight), v_bias=take(attn.v_proj.bias),
                o=take(attn.o_proj.weight), o_bias=take(attn.o_proj.bias),
                post_norm=take(layer.post_attention_layernorm.weight),
                gate=take(mlp.gate_proj.weight), gate_bias=take(mlp.gate_proj.bias),
                up=take(mlp.up_proj.weight), up_bias=take(mlp.up_proj.bias),
                down=take(mlp.down_proj.weight), down_bias=take(mlp.down_proj.bias),
            ))
            shard_attention(tp, layers[-1], num_q_heads=q_heads, num_kv_heads=kv_heads)
            shard_gated_mlp(tp, layers[-1], config.intermediate_size, "intermediate_size")
        return cls(config=config, embed=take(hf_model.model.embed_tokens.weight), layers=layers,
                   final_norm=take(hf_model.model.norm.weight),
                   lm_head=take(hf_model.lm_head.weight), inv_freq=rotary.inv_freq,
                   rope_mscale=getattr(rotary, "attention_scaling", 1.0), rope=rope,
                   attention_backend=attention_backend, tensor_parallel=tp)

    # ------------------------------------------------------------------ context checks
    def _cache_problems(self, ctx: Any) -> list:
        return mha_cache_problems(ctx, head_dim=self.head_dim, num_kv_heads=self.num_kv_heads,
                                  num_layers=self.num_layers)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ctx: Any, *, last_token_only: bool = True) -> torch.Tensor:
        """Run the step's tokens through the model.

        Returns ``[active_requests, vocab]`` last-token logits (``last_token_only``: picked on
        the hidden states before the LM head, as Megatron's GPT model does with
        ``materialize_only_last_token_logits``), or ``[1, padded_tokens, vocab]`` logits of every
        token. Logits are in the model dtype.
        """
        hidden, n, attention = self._start_step(ctx)                          # [n, hidden]
        table, cos_sin = self.rope_tables(ctx.max_sequence_length)
        Hq, Hkv, D = self.num_q_heads, self.num_kv_heads, self.head_dim

        for index, w in enumerate(self.layers):
            layer_number = index + 1
            x = rms_norm(hidden, w.input_norm, self.eps)
            query = F.linear(x, w.q, w.q_bias).view(n, 1, Hq, D)
            key = F.linear(x, w.k, w.k_bias).view(n, 1, Hkv, D)
            value = F.linear(x, w.v, w.v_bias).view(n, 1, Hkv, D)
            if ctx.fused_rope_kv_append:
                if self.rope == "table":
                    ctx.apply_rotary_emb_and_append_key_value_cache(
                        layer_number, query, key, value, rotary_pos_emb=table,
                        config=self.rope_config, mscale=self.rope_mscale)
                else:
                    ctx.apply_rotary_emb_and_append_key_value_cache(
                        layer_number, query, key, value, cos_sin_emb=cos_sin,
                        config=self.rope_config)
            elif self.rope == "table":
                key = ctx.apply_rotary_emb_key(key, table, self.rope_config,
                                               mscale=self.rope_mscale)
                ctx.append_key_value_cache(layer_number, key, value)
                query = ctx.apply_rotary_emb_query(query, table, self.rope_config,
                                                   mscale=self.rope_mscale)
            else:
                query, key = ctx.apply_fused_qk_rotary_emb(query, key, cos_sin, self.rope_config)
                ctx.append_key_value_cache(layer_number, key, value)
            attn = self._attend_mha(ctx, attention, layer_number, query, n)      # [n, Hq * D]
            hidden = hidden + self.tp.row_linear(attn, w.o, w.o_bias)
            x = rms_norm(hidden, w.post_norm, self.eps)
            hidden = hidden + gated_mlp(self.act, x, w, self.tp)
        return self._logits(ctx, hidden, last_token_only)

    __call__ = forward
