"""Llama-style model adapter (GQA, RoPE, RMSNorm, SwiGLU) that runs a step's packed tokens
through a ``DynamicInferenceContext``.

The weights come from a ``transformers`` ``LlamaForCausalLM``; the forward follows the model code
path SEMANTICS.md §11 and §13 describe: ``current_input_and_position_ids``, per layer the
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

from .paged_attention import PagedAttention

ROPE_MODES = ("table", "cos_sin")
# RoPE types whose inverse frequencies do not depend on the sequence length.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


class LlamaLayerWeights(SimpleNamespace):
    """One decoder layer's tensors (biases None when the model has none)."""


class LlamaAdapter:
    """A Llama causal LM whose forward reads and writes a ``DynamicInferenceContext``.

    Build it with ``LlamaAdapter.from_transformers(hf_model)``; call ``forward(ctx)`` after
    ``ctx.initialize_attention_state()``.
    """

    def __init__(self, *, config: Any, embed: torch.Tensor, layers: list, final_norm: torch.Tensor,
                 lm_head: torch.Tensor, inv_freq: torch.Tensor, rope_mscale: float,
                 rope: str = "table", attention_backend: str = "auto"):
        if rope not in ROPE_MODES:
            raise ValueError(f"rope={rope!r} must be one of {ROPE_MODES}")
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_q_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_q_heads
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        act = getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise NotImplementedError(f"hidden_act={act!r}: supported {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.inv_freq = inv_freq.float().to(self.device)
        self.rope_mscale = float(rope_mscale)
        self.rope = rope
        self.attention_backend_request = attention_backend
        self.rope_config = SimpleNamespace(rotary_interleaved=False)
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._attention: Optional[PagedAttention] = None
        self._attention_key = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_transformers(cls, hf_model: Any, *, device: Optional[torch.device | str] = None,
                          dtype: Optional[torch.dtype] = None, rope: str = "table",
                          attention_backend: str = "auto") -> "LlamaAdapter":
        """Take the weights of a ``transformers`` ``LlamaForCausalLM`` (moved to ``device`` and
        cast to ``dtype`` when given; shared with the model otherwise)."""
        name = type(hf_model).__name__
        if name != "LlamaForCausalLM":
            raise NotImplementedError(f"LlamaAdapter takes a LlamaForCausalLM, got {name}")
        config = hf_model.config
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            raise NotImplementedError(f"pretraining_tp={config.pretraining_tp} is not supported")
        rotary = hf_model.model.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise NotImplementedError(
                f"rope_type={rope_type!r}: its frequencies depend on the sequence length; "
                f"supported {_STATIC_ROPE_TYPES}")
        param = next(hf_model.parameters())
        device = torch.device(device) if device is not None else param.device
        dtype = dtype or param.dtype

        def take(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if tensor is None else tensor.detach().to(device=device, dtype=dtype)

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
        return cls(config=config, embed=take(hf_model.model.embed_tokens.weight), layers=layers,
                   final_norm=take(hf_model.model.norm.weight),
                   lm_head=take(hf_model.lm_head.weight), inv_freq=rotary.inv_freq,
                   rope_mscale=getattr(rotary, "attention_scaling", 1.0), rope=rope,
                   attention_backend=attention_backend)

    # ------------------------------------------------------------------ rotary tables
    def rope_tables(self, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(angle table [max_seq, 1, 1, D] fp32, cos/sin cache [max_seq, D] fp32)``.

        The angles are ``position * inv_freq`` in fp32, as transformers computes them; the
        cos/sin cache carries the rope ``attention_scaling`` (mscale), the angle table does not
        (the context applies ``mscale``)."""
        if max_sequence_length not in self._tables:
            positions = torch.arange(max_sequence_length, dtype=torch.float32, device=self.device)
            angles = torch.outer(positions, self.inv_freq)                   # [max_seq, D/2]
            table = torch.cat((angles, angles), dim=-1)[:, None, None, :].contiguous()
            cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1) * self.rope_mscale
            self._tables[max_sequence_length] = (table, cos_sin.contiguous())
        return self._tables[max_sequence_length]

    # ------------------------------------------------------------------ attention
    def check_context(self, ctx: Any) -> None:
        """Raise ``ValueError`` when the context's cache does not fit this model."""
        problems = []
        if ctx.cache_mla_latent:
            problems.append("the context caches an MLA latent (cache_mla_latent=True)")
        if ctx.num_attention_layers != self.num_layers:
            problems.append(f"num_layers {ctx.num_attention_layers} != {self.num_layers}")
        if ctx.kv_channels != self.head_dim:
            problems.append(f"kv_channels {ctx.kv_channels} != head_dim {self.head_dim}")
        if ctx.num_attention_heads_per_partition != self.num_kv_heads:
            problems.append(f"num_attention_heads (per partition) "
                            f"{ctx.num_attention_heads_per_partition} != num_key_value_heads "
                            f"{self.num_kv_heads}")
        if ctx.params_dtype != self.dtype:
            problems.append(f"params_dtype {ctx.params_dtype} != model dtype {self.dtype}")
        if ctx.device != self.device:
            problems.append(f"device {ctx.device} != model device {self.device}")
        if problems:
            raise ValueError("the context does not match the model: " + "; ".join(problems))

    def attention_for(self, ctx: Any) -> PagedAttention:
        """The paged attention object for ``ctx`` (built once per block size and device)."""
        key = (ctx.block_size_tokens, ctx.device)
        if self._attention is None or self._attention_key != key:
            self._attention = PagedAttention(
                num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, block_size=ctx.block_size_tokens, device=ctx.device,
                softmax_scale=self.head_dim ** -0.5, backend=self.attention_backend_request,
                dtype=self.dtype)
            self._attention_key = key
        return self._attention

    @property
    def attention_backend(self) -> Optional[str]:
        """The paged attention backend that runs (``None`` before the first forward)."""
        return None if self._attention is None else self._attention.backend

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ctx: Any, *, last_token_only: bool = True) -> torch.Tensor:
        """Run the step's tokens through the model.

        Returns ``[active_requests, vocab]`` last-token logits (``last_token_only``: picked on
        the hidden states before the LM head, as Megatron's GPT model does with
        ``materialize_only_last_token_logits``), or ``[1, padded_tokens, vocab]`` logits of every
        token. Logits are in the model dtype.
        """
        self.check_context(ctx)
        meta = ctx.active_attn_metadata
        if meta is None:
            raise RuntimeError("call ctx.initialize_attention_state() before forward()")
        input_ids, _ = ctx.current_input_and_position_ids()
        n = input_ids.shape[1]
        attention = self.attention_for(ctx)
        attention.plan(cu_query_lengths=meta.cu_query_seq_lengths,
                       kv_seq_lengths=meta.kv_seq_lengths, block_table=meta.block_table,
                       max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                       num_tokens=n, num_decode_requests=ctx.num_decode_requests,
                       dtype=self.dtype)
        table, cos_sin = self.rope_tables(ctx.max_sequence_length)
        Hq, Hkv, D = self.num_q_heads, self.num_kv_heads, self.head_dim

        hidden = F.embedding(input_ids[0], self.embed)                         # [n, hidden]
        for index, w in enumerate(self.layers):
            layer_number = index + 1
            x = _rms_norm(hidden, w.input_norm, self.eps)
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
            key_cache, value_cache = ctx.key_value_cache(layer_number)
            attn = attention(query.reshape(n, Hq, D), key_cache, value_cache)   # [n, Hq, D]
            hidden = hidden + F.linear(attn.reshape(n, Hq * D), w.o, w.o_bias)
            x = _rms_norm(hidden, w.post_norm, self.eps)
            mlp = self.act(F.linear(x, w.gate, w.gate_bias)) * F.linear(x, w.up, w.up_bias)
            hidden = hidden + F.linear(mlp, w.down, w.down_bias)
        hidden = _rms_norm(hidden, self.final_norm, self.eps)
        if last_token_only:
            return F.linear(ctx.last_token_logits(hidden.unsqueeze(0)), self.lm_head)
        return F.linear(hidden, self.lm_head).unsqueeze(0)

    __call__ = forward
