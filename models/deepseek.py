"""DeepSeek-V2 and DeepSeek-V3 model adapter (multi-head latent attention, MLA) that runs a
step's packed tokens through a ``DynamicInferenceContext`` built with ``cache_mla_latent=True``.

The weights come from a ``transformers`` ``DeepseekV2ForCausalLM`` or ``DeepseekV3ForCausalLM``:
the same MLA attention; they differ in the MoE router (V2: softmax scores, greedy or
group-limited top-k, weights times ``routed_scaling_factor``; V3: sigmoid scores, the expert
choice on scores plus the ``e_score_correction_bias``, groups ranked by the sum of their two best
choices, the chosen experts' scores renormalised when ``norm_topk_prob``, then scaled) and in
V3's ``rope_interleave`` flag. Per layer:

* queries: ``q_proj`` (or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` when
  ``q_lora_rank`` is set), split per head into ``q_nope`` and ``q_pe``;
* keys/values are compressed: ``kv_a_proj_with_mqa`` gives ``[latent (kv_lora_rank), k_pe
  (qk_rope_head_dim)]``; the latent goes through ``kv_a_layernorm``; ``k_pe`` is one head shared
  by every query head;
* rope on ``q_pe`` and ``k_pe`` through the context (``apply_rotary_emb_query/key`` with
  Megatron's angle table, or ``apply_fused_qk_rotary_emb`` with a cos/sin cache), with
  ``config.multi_latent_attention=True`` (see "Rope layout" below);
* ``[latent_normed, k_pe_rotated]`` (``[n, 1, kv_lora_rank + rope]``) is written with
  ``append_key_value_cache`` (the MLA latent-append kernel);
* paged attention reads each request's latent rows from its blocks (the step's block table)
  and attends causally (see "Attention forms");
* ``o_proj``, the residual, the MLP (dense SwiGLU, or DeepSeek-V2's MoE with shared experts),
  and last-token logits through ``ctx.last_token_logits``.

Rope layout. transformers' V2 rotates ``q_pe``/``k_pe`` as complex numbers over the pairs
``(2i, 2i+1)`` and leaves them interleaved (V3 with ``rope_interleave``, the default, rotates the
same pairs and writes them half-split; V3 without it rotates the half-split pairs ``(i, i +
D/2)`` of the raw layout, Megatron's ordinary rope, which the adapter then applies).
Megatron's MLA layout (``mla_layout``) rotates the same pairs with the same angles but writes the
result half-split (``[even dims, odd dims]``).
The two differ only by one fixed permutation of the rope dims, applied to queries and keys
alike, so every ``q_pe . k_pe`` dot product (all attention ever uses) is the same; the cached
``k_pe`` is simply in the half-split order. The angle table is Megatron's ``cat(freqs, freqs)``
(``position * inv_freq`` in fp32, as transformers computes it) and the rope
``attention_scaling`` goes in as ``mscale`` (transformers multiplies both q and k by it).

Attention forms (``attention_form=``):

* ``"decompress"`` (default, the readable one): gather each request's latent rows from its
  blocks, decompress them with ``kv_b_proj`` into per-head ``k_nope`` and ``v``, append the
  shared ``k_pe`` to every head's key, and run causal softmax attention in fp32;
* ``"absorbed"``: fold ``kv_b_proj``'s key half into the query (``q_nope @ W_UK`` per head),
  attend over the latent rows directly as one shared KV head (MQA over ``[latent, k_pe]``),
  then apply ``kv_b_proj``'s value half to the attended latent. Same result up to rounding.

Both run in torch on any device (``attention_backend`` must be ``"auto"``, ``"torch"`` or
``"torch_static"``: the one torch path there is already the padded, capturable one); the index
work per step (which tokens of which request see which cached positions) is the torch paged
attention's (``paged_attention_torch.TorchRowGroup``), built once per step.
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
    PagedAdapter,
    TensorParallel,
    activation,
    gated_mlp,
    placement,
    rms_norm,
    shard_gated_mlp,
    static_rotary,
    weight_taker,
)
from .paged_attention_torch import TorchRowGroup, torch_row_groups

ATTENTION_FORMS = ("decompress", "absorbed")
_TOPK_METHODS = ("greedy", "group_limited_greedy")
_MODEL_CLASSES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class DeepseekLayerWeights(SimpleNamespace):
    """One decoder layer's tensors (biases None when the model has none; ``moe`` None for a
    dense MLP layer)."""


class MlaPagedAttention:
    """Causal multi-head latent attention of the step's packed queries over the paged latent
    cache ``[num_blocks, block_size, kv_lora_rank + rope]``, in torch.

    Call ``plan`` once per step (shared by all layers), then the object once per layer.
    """

    def __init__(self, *, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, block_size: int, softmax_scale: float,
                 form: str = "decompress"):
        if form not in ATTENTION_FORMS:
            raise ValueError(f"attention_form={form!r} must be one of {ATTENTION_FORMS}")
        self.num_heads = num_heads
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rank = kv_lora_rank
        self.block_size = block_size
        self.scale = softmax_scale
        self.form = form
        self.backend = "torch_static"
        self._groups: Optional[list] = None

    def plan(self, *, cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
             block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, num_tokens: int,
             num_decode_requests: int = 0) -> None:
        """Index tensors of one step: decode requests (one query each) apart from the
        prefills, as the torch paged attention does."""
        self._groups = torch_row_groups(
            cu_query_lengths=cu_query_lengths, kv_seq_lengths=kv_seq_lengths,
            block_table=block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            num_tokens=num_tokens, num_decode_requests=num_decode_requests,
            block_size=self.block_size)

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                 kv_b: torch.Tensor, latent_scales: tuple = (None, None)) -> torch.Tensor:
        """``q_nope`` ``[n, H, nope]``, ``q_pe`` ``[n, H, rope]`` (rotated), ``latent_cache``
        ``[blocks, bs, rank + rope]`` (this step's rows appended), ``kv_b`` the ``kv_b_proj``
        weight ``[H * (nope + v), rank]`` -> ``[n, H, v]`` in ``q_nope``'s dtype. An FP8 cache
        comes with ``latent_scales``, the latent's and the rope part's ``[1]`` scales
        (``ctx.key_value_cache_scales``): its rows are read as ``q * scale``."""
        if self._groups is None:
            raise RuntimeError("MlaPagedAttention: call plan() for the step first")
        if latent_scales[0] is not None:
            columns = torch.cat((latent_scales[0].expand(self.rank),
                                 latent_scales[1].expand(self.rope)))
            latent_cache = latent_cache.float() * columns
        n, H = q_nope.shape[0], self.num_heads
        w = kv_b.float().view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]               # [H, nope|v, rank]
        if self.form == "decompress":
            out = q_nope.new_zeros(n + 1, H, self.v_dim)               # spare row: empty slots
            for group in self._groups:
                self._attend_decompressed(group, q_nope, q_pe, latent_cache, w_uk, w_uv, out)
            return out[:-1]
        # Absorbed: queries in latent space, the latent rows as one shared KV head; the value
        # is the whole cached row (its rope part is dropped after attention).
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_uk)  # [n, H, rank]
        query = torch.cat((q_latent, q_pe.float()), dim=-1)            # [n, H, rank + rope]
        cache = latent_cache.float().unsqueeze(2)                      # [blocks, bs, 1, r + p]
        attended = query.new_zeros(n + 1, H, self.rank + self.rope)
        for group in self._groups:
            group.attend(query, cache, cache, attended, self.scale)
        out = torch.einsum("nhr,hvr->nhv", attended[:n, :, :self.rank], w_uv)
        return out.to(q_nope.dtype)

    def _attend_decompressed(self, group: TorchRowGroup, q_nope: torch.Tensor,
                             q_pe: torch.Tensor, latent_cache: torch.Tensor, w_uk: torch.Tensor,
                             w_uv: torch.Tensor, out: torch.Tensor) -> None:
        rows = group.blocks.shape[0]
        H = self.num_heads
        # Each request's cached rows in position order: [rows, max_k, rank + rope].
        cached = latent_cache[group.blocks].reshape(rows, -1, latent_cache.shape[-1])
        cached = cached[:, :group.max_k].float()
        # Slots past a request's length hold stale bytes (possibly NaN): zero them.
        valid = group.key_valid[:, :, 0]                               # [rows, k, 1]
        cached = torch.where(valid, cached, torch.zeros((), device=cached.device))
        latent, k_pe = cached[..., :self.rank], cached[..., self.rank:]
        k_nope = torch.einsum("rkc,hdc->rkhd", latent, w_uk)           # [rows, k, H, nope]
        value = torch.einsum("rkc,hvc->rkhv", latent, w_uv)            # [rows, k, H, v]
        key = torch.cat((k_nope, k_pe[:, :, None, :].expand(-1, -1, H, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)[group.gather_tokens].float()  # [rows, q, H, d]
        scores = torch.einsum("rqhd,rkhd->rhqk", query, key) * self.scale
        scores = scores.masked_fill(~group.allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = probs.masked_fill(~group.allowed, 0.0)                 # empty slots: NaN -> 0
        result = torch.einsum("rhqk,rkhv->rqhv", probs, value)         # [rows, q, H, v]
        out[group.scatter_tokens.reshape(-1)] = result.reshape(-1, H, self.v_dim).to(out.dtype)


class DeepseekV2Adapter(PagedAdapter):
    """A DeepSeek-V2 or DeepSeek-V3 causal LM whose forward reads and writes a
    ``DynamicInferenceContext`` with an MLA latent cache.

    Build it with ``DeepseekV2Adapter.from_transformers(hf_model)``; the context needs
    ``context_kwargs`` (``cache_mla_latent=True``, ``kv_lora_rank``, ``qk_pos_emb_head_dim``;
    ``Engine.from_transformers`` passes them). Call ``forward(ctx)`` after
    ``ctx.initialize_attention_state()``.
    """

    def __init__(self, *, config: Any, embed: torch.Tensor, layers: list,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, inv_freq: torch.Tensor,
                 rope_mscale: float, softmax_scale: float, rope: str = "table",
                 attention_backend: str = "auto", attention_form: str = "decompress",
                 tensor_parallel: TensorParallel = SINGLE):
        self.tp = tensor_parallel
        if rope not in ROPE_MODES:
            raise ValueError(f"rope={rope!r} must be one of {ROPE_MODES}")
        if attention_backend not in ("auto", "torch", "torch_static"):
            raise NotImplementedError(
                f"attention_backend={attention_backend!r}: MLA attention runs in torch only "
                "('auto', 'torch' or 'torch_static', which are the same padded torch path)")
        if attention_form not in ATTENTION_FORMS:
            raise ValueError(f"attention_form={attention_form!r} must be one of {ATTENTION_FORMS}")
        self._init_weights(config=config, embed=embed, layers=layers, final_norm=final_norm,
                           lm_head=lm_head, eps=config.rms_norm_eps,
                           attention_backend=attention_backend)
        self.num_layers = config.num_hidden_layers
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = self.tp.part(config.num_attention_heads, "num_attention_heads")
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        # What Engine.from_transformers sizes the context with: the cache holds one latent row
        # of kv_lora_rank + rope per token and layer (the "KV heads" do not matter for it).
        self.head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.num_kv_heads = 1
        self.context_kwargs = dict(cache_mla_latent=True, kv_lora_rank=self.kv_lora_rank,
                                   qk_pos_emb_head_dim=self.qk_rope_head_dim)
        self.act = activation(ACTIVATIONS, "hidden_act", getattr(config, "hidden_act", "silu"))
        self._init_rope(inv_freq=inv_freq, rope_mscale=rope_mscale, rope=rope)
        self.softmax_scale = float(softmax_scale)
        self.attention_form = attention_form
        # V2, and V3 with rope_interleave: the MLA layout (pairs (2i, 2i+1), half-split out).
        self.rope_config = SimpleNamespace(
            rotary_interleaved=False,
            multi_latent_attention=bool(getattr(config, "rope_interleave", True)))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_transformers(cls, hf_model: Any, *, device: Optional[torch.device | str] = None,
                          dtype: Optional[torch.dtype] = None, rope: str = "table",
                          attention_backend: str = "auto",
                          attention_form: str = "decompress",
                          tensor_parallel: TensorParallel = SINGLE) -> "DeepseekV2Adapter":
        """Take the weights of a ``transformers`` ``DeepseekV2ForCausalLM`` or
        ``DeepseekV3ForCausalLM`` (moved to ``device`` and cast to ``dtype`` when given; shared
        with the model otherwise). The MoE router weight (and V3's correction bias) stays fp32,
        as transformers keeps it.

        With ``tensor_parallel`` of more than one rank, this rank's shard: the query heads
        (``q_proj``/``q_b_proj`` rows, ``kv_b_proj`` rows, ``o_proj`` columns), the MLP channels
        and each expert's channels (the router, the latent projection ``kv_a_proj_with_mqa``
        and ``q_a_proj`` are whole: the latent cache is the same on every rank)."""
        if type(hf_model).__name__ not in _MODEL_CLASSES:
            raise NotImplementedError(f"DeepseekV2Adapter takes a {' or a '.join(_MODEL_CLASSES)}"
                                      f", got {type(hf_model).__name__}")
        config = hf_model.config
        tp = tensor_parallel
        tp.part(config.num_attention_heads, "num_attention_heads")  # checked before any copy
        rotary = static_rotary(hf_model)
        take = weight_taker(*placement(hf_model, device, dtype))

        def bias(linear: Any) -> Optional[torch.Tensor]:
            return take(getattr(linear, "bias", None))

        def dense(mlp: Any, name: str) -> SimpleNamespace:
            w = SimpleNamespace(gate=take(mlp.gate_proj.weight), gate_bias=bias(mlp.gate_proj),
                                up=take(mlp.up_proj.weight), up_bias=bias(mlp.up_proj),
                                down=take(mlp.down_proj.weight), down_bias=bias(mlp.down_proj))
            return shard_gated_mlp(tp, w, w.gate.shape[0], name)

        def by_head(weight: torch.Tensor, dim: int) -> torch.Tensor:
            return tp.shard(weight, dim, tp.size)

        layers = []
        for layer in hf_model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            w = DeepseekLayerWeights(
                input_norm=take(layer.input_layernorm.weight),
                post_norm=take(layer.post_attention_layernorm.weight),
                kv_a=take(attn.kv_a_proj_with_mqa.weight), kv_a_bias=bias(attn.kv_a_proj_with_mqa),
                kv_a_norm=take(attn.kv_a_layernorm.weight),
                kv_a_eps=attn.kv_a_layernorm.variance_epsilon,
                kv_b=by_head(take(attn.kv_b_proj.weight), 0),
                o=by_head(take(attn.o_proj.weight), 1), o_bias=bias(attn.o_proj),
                q=None, q_a=None, q_a_bias=None, q_a_norm=None, q_a_eps=None, q_b=None,
                mlp=None, moe=None)
            if attn.q_lora_rank is None:
                w.q = by_head(take(attn.q_proj.weight), 0)
            else:
                w.q_a, w.q_a_bias = take(attn.q_a_proj.weight), bias(attn.q_a_proj)
                w.q_a_norm = take(attn.q_a_layernorm.weight)
                w.q_a_eps = attn.q_a_layernorm.variance_epsilon
                w.q_b = by_head(take(attn.q_b_proj.weight), 0)
            if hasattr(mlp, "experts"):
                gate = mlp.gate
                # V3's router: sigmoid scores and a correction bias (no topk_method).
                bias_v3 = getattr(gate, "e_score_correction_bias", None)
                method = "sigmoid_grouped" if bias_v3 is not None else gate.topk_method
                if method not in _TOPK_METHODS + ("sigmoid_grouped",):
                    raise NotImplementedError(f"topk_method={method!r}: supported "
                                              f"{_TOPK_METHODS}")
                w.moe = SimpleNamespace(
                    router=take(gate.weight, torch.float32), top_k=gate.top_k,
                    num_experts=gate.num_experts, topk_method=method,
                    num_group=gate.num_group, topk_group=gate.topk_group,
                    scaling=float(gate.routed_scaling_factor),
                    score_bias=take(bias_v3, torch.float32),
                    norm_topk_prob=bool(getattr(gate, "norm_topk_prob", False)),
                    gate_up=take(mlp.experts.gate_up_proj), down=take(mlp.experts.down_proj),
                    shared=dense(mlp.shared_experts, "the shared experts' intermediate size"))
                if tp.size > 1:
                    # Each expert's channels: gate and up rows of gate_up_proj, down columns.
                    channels = w.moe.gate_up.shape[1] // 2
                    tp.part(channels, "moe_intermediate_size")
                    gate, up = w.moe.gate_up.split(channels, dim=1)
                    w.moe.gate_up = torch.cat((tp.shard(gate, 1, tp.size),
                                               tp.shard(up, 1, tp.size)), dim=1)
                    w.moe.down = tp.shard(w.moe.down, 2, tp.size)
            else:
                w.mlp = dense(mlp, "intermediate_size")
            layers.append(w)
        softmax_scale = hf_model.model.layers[0].self_attn.scaling
        return cls(config=config, embed=take(hf_model.model.embed_tokens.weight), layers=layers,
                   final_norm=take(hf_model.model.norm.weight),
                   lm_head=take(hf_model.lm_head.weight), inv_freq=rotary.inv_freq,
                   rope_mscale=getattr(rotary, "attention_scaling", 1.0),
                   softmax_scale=softmax_scale, rope=rope, attention_backend=attention_backend,
                   attention_form=attention_form, tensor_parallel=tp)

    # ------------------------------------------------------------------ attention
    _plan_with_dtype = False

    def _cache_problems(self, ctx: Any) -> list:
        problems = []
        if not ctx.cache_mla_latent:
            problems.append("the context must cache the MLA latent (cache_mla_latent=True)")
        else:
            if ctx.kv_lora_rank != self.kv_lora_rank:
                problems.append(f"kv_lora_rank {ctx.kv_lora_rank} != {self.kv_lora_rank}")
            if ctx.qk_pos_emb_head_dim != self.qk_rope_head_dim:
                problems.append(f"qk_pos_emb_head_dim {ctx.qk_pos_emb_head_dim} != "
                                f"qk_rope_head_dim {self.qk_rope_head_dim}")
        if ctx.fused_rope_kv_append:
            problems.append("fused_rope_kv_append=True is for the MHA cache, not MLA")
        if ctx.num_attention_layers != self.num_layers:
            problems.append(f"num_layers {ctx.num_attention_layers} != {self.num_layers}")
        return problems

    def _attention_cache_key(self, ctx: Any) -> Any:
        return ctx.block_size_tokens

    def _new_attention(self, ctx: Any) -> MlaPagedAttention:
        return MlaPagedAttention(
            num_heads=self.num_heads, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            kv_lora_rank=self.kv_lora_rank, block_size=ctx.block_size_tokens,
            softmax_scale=self.softmax_scale, form=self.attention_form)

    # ------------------------------------------------------------------ MLP
    def _dense_mlp(self, x: torch.Tensor, m: SimpleNamespace) -> torch.Tensor:
        return gated_mlp(self.act, x, m, self.tp)

    @staticmethod
    def _route_v3(x: torch.Tensor, m: SimpleNamespace) -> tuple:
        """DeepSeek-V3's router as transformers runs it: fp32 sigmoid scores; experts chosen on
        scores + correction bias within the ``topk_group`` groups whose two best choices sum
        highest; weights are the chosen experts' scores (renormalised when
        ``norm_topk_prob``) times ``routed_scaling_factor``."""
        scores = F.linear(x.float(), m.router).sigmoid()                       # [n, experts]
        choice = scores + m.score_bias
        n = scores.shape[0]
        grouped = choice.view(n, m.num_group, m.num_experts // m.num_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)                  # [n, groups]
        group_idx = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, -1)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        experts = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.scaling, experts

    def _moe(self, x: torch.Tensor, m: SimpleNamespace) -> torch.Tensor:
        """DeepSeek's MoE as transformers runs it: the router (V2: fp32 softmax, greedy or
        group-limited top-k, weights times ``routed_scaling_factor``, not renormalised; V3:
        ``_route_v3``), the routed experts plus the shared experts."""
        if m.topk_method == "sigmoid_grouped":
            weights, experts = self._route_v3(x, m)
            return self._experts(x, m, weights, experts)
        scores = F.linear(x.float(), m.router).softmax(dim=-1)                # [n, experts]
        if m.topk_method == "group_limited_greedy":
            n = scores.shape[0]
            group_scores = scores.view(n, m.num_group, -1).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(n, m.num_group, m.num_experts
                                                         // m.num_group).reshape(n, -1)
            scores = scores.masked_fill(~score_mask.bool(), 0.0)
        weights, experts = torch.topk(scores, k=m.top_k, dim=-1, sorted=False)
        return self._experts(x, m, weights * m.scaling, experts)

    def _experts(self, x: torch.Tensor, m: SimpleNamespace, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
        """The routed experts (``experts`` ``[n, top_k]`` with fp32 ``weights``) plus the
        shared experts."""
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            token, slot = torch.where(experts == expert)
            gate, up = F.linear(x[token], m.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, m.down[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        if self.tp.size == 1:
            return out + self._dense_mlp(x, m.shared)
        # This rank's channels of the routed and the shared experts: one all-reduce for both.
        s = m.shared
        shared = F.linear(self.act(F.linear(x, s.gate, s.gate_bias)) * F.linear(x, s.up, s.up_bias),
                          s.down)
        out = self.tp.reduce(out + shared)
        return out if s.down_bias is None else out + s.down_bias

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ctx: Any, *, last_token_only: bool = True) -> torch.Tensor:
        """Run the step's tokens through the model.

        Returns ``[active_requests, vocab]`` last-token logits (``last_token_only``), or
        ``[1, padded_tokens, vocab]`` logits of every token, in the model dtype.
        """
        hidden, n, attention = self._start_step(ctx)                          # [n, hidden]
        table, cos_sin = self.rope_tables(ctx.max_sequence_length)
        H, nope, rope, rank = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                               self.kv_lora_rank)

        for index, w in enumerate(self.layers):
            layer_number = index + 1
            x = rms_norm(hidden, w.input_norm, self.eps)
            if w.q is not None:
                q = F.linear(x, w.q)
            else:
                q = F.linear(rms_norm(F.linear(x, w.q_a, w.q_a_bias), w.q_a_norm, w.q_a_eps),
                             w.q_b)
            q = q.view(n, H, nope + rope)
            q_nope, q_pe = q[..., :nope], q[..., nope:]                        # views
            compressed = F.linear(x, w.kv_a, w.kv_a_bias)                      # [n, rank + rope]
            latent = rms_norm(compressed[:, :rank], w.kv_a_norm, w.kv_a_eps)  # [n, rank]
            k_pe = compressed[:, None, rank:]                                  # [n, 1, rope] view
            # Rope in place on the q_pe / k_pe views (MLA layout: see the module docstring).
            if self.rope == "table":
                ctx.apply_rotary_emb_key(k_pe, table, self.rope_config, mscale=self.rope_mscale)
                ctx.apply_rotary_emb_query(q_pe, table, self.rope_config, mscale=self.rope_mscale)
            else:
                ctx.apply_fused_qk_rotary_emb(q_pe, k_pe, cos_sin, self.rope_config)
            row = torch.cat((latent, k_pe[:, 0]), dim=-1).unsqueeze(1)          # [n, 1, r + p]
            ctx.append_key_value_cache(layer_number, row, None)
            latent_cache, _ = ctx.key_value_cache(layer_number)
            attn = attention(q_nope, q_pe, latent_cache, w.kv_b,
                             ctx.key_value_cache_scales(layer_number))          # [n, H, v]
            hidden = hidden + self.tp.row_linear(attn.reshape(n, H * self.v_head_dim), w.o,
                                                 w.o_bias)
            x = rms_norm(hidden, w.post_norm, self.eps)
            hidden = hidden + (self._moe(x, w.moe) if w.moe is not None
                               else self._dense_mlp(x, w.mlp))
        return self._logits(ctx, hidden, last_token_only)

    __call__ = forward


def mla_block_bytes(config: Any, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one cache block of a DeepSeek-V2/V3 model's MLA latent cache (all layers)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (itemsize * config.num_hidden_layers * block_size
            * (config.kv_lora_rank + config.qk_rope_head_dim))


__all__ = ["ATTENTION_FORMS", "DeepseekV2Adapter", "MlaPagedAttention", "mla_block_bytes"]
