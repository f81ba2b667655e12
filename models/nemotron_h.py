"""NemotronH (Mamba2 + attention hybrid) model adapter that runs a step's packed tokens through a
hybrid ``DynamicInferenceContext``.

The weights come from a ``transformers`` ``NemotronHForCausalLM``; the math follows its
pure-torch path (``NemotronHBlock``: pre-norm mixer plus residual; ``NemotronHMamba2Mixer``;
``NemotronHAttention``; ``NemotronHMLP``):

* attention layers (``*``): Q/K/V projections, **no rotary embedding** (NemotronH attention
  has no position encoding; causality alone orders the tokens), the KV append and paged
  attention over the block table, as in the Llama adapter;
* Mamba2 layers (``M``): ``in_proj`` -> ``(gate, xBC, dt)``; a causal depthwise conv1d (+ bias,
  SiLU) over ``xBC`` continuing from the request's conv state (its last ``d_conv`` inputs);
  ``dt = clamp(softplus(dt + dt_bias), min=time_step_min)``, ``A = -exp(A_log)``; the
  selective-state recurrence ``h = exp(dt A) h + dt B x``, ``y = C h + D x`` per head (B and C
  shared by the ``nheads / n_groups`` heads of a group) from the request's SSM state; then the
  gated group RMSNorm ``norm(y * silu(gate))`` and ``out_proj``;
* MLP layers (``-``): ``down(act(up(x)))`` (``relu2`` by default).

Mamba states live in the context's slots (``mamba_states_cache``): per layer the step gathers
every sequence's conv/SSM state by slot (``ctx.gather_mamba_states``; a new request's slot was
zeroed by ``initialize_attention_state``, a continuation chunk finds the state its previous chunk
left), runs its tokens and scatters the final states back (``ctx.scatter_mamba_states``). The
step's token order is the context's: decode rows (one token each), then the regular prefills
(``mamba_metadata.cu_seqlens``), then the continuation chunk (``device_chunked_prefill``).
Regular prefills gather their state by slot too instead of assuming zero: a new request's slot
is zero already, and a continuation the metadata happens to list as a regular prefill (the
context marks the last active row as the continuation, and the engine may add new requests
after a final chunk) still resumes from its saved state.

The recurrence is a readable per-token loop, vectorised over the sequences of a group (decode
rows as one group of length 1, prefills padded to the longest); transformers' full forward uses a
chunked scan of the same recurrence, so the two agree up to fp32 rounding.

Not supported: MoE layers (``E``) and multi-token-prediction layers (``NotImplementedError``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ._common import (
    ACTIVATIONS,
    SINGLE,
    PagedMhaAdapter,
    TensorParallel,
    activation,
    check_model_class,
    mha_cache_problems,
    placement,
    shard_attention,
    weight_taker,
)

_ACTIVATIONS = {"relu2": lambda x: torch.square(F.relu(x)), "relu": F.relu, **ACTIVATIONS}
_LAYER_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' NemotronHRMSNorm: normalise and scale in fp32, then cast back."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * hidden).to(x.dtype)


def _gated_group_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                          group_size: int, eps: float) -> torch.Tensor:
    """transformers' NemotronHRMSNormGated: ``y * silu(gate)`` normalised per group of
    ``group_size`` channels in fp32, cast back to ``y``'s dtype, then scaled."""
    dtype = y.dtype
    hidden = y.float() * F.silu(gate.float())
    shape = hidden.shape
    grouped = hidden.view(*shape[:-1], shape[-1] // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view(shape).to(dtype)


def _mamba_shard(tp: TensorParallel, w: SimpleNamespace, config: Any) -> None:
    """This rank's Mamba heads (and their groups) of a Mamba layer's weights ``w``, in place.

    ``in_proj``'s rows are ``[gate (d_inner), x (d_inner), B (G*N), C (G*N), dt (H)]`` and the
    conv's channels ``[x, B, C]``: each part keeps this rank's heads (``head_dim`` channels
    each) or groups (``d_state`` channels each); ``dt_bias``, ``A``, ``D`` and the gated norm
    keep this rank's heads; ``out_proj`` is row-parallel (its columns of this rank's heads)."""
    if tp.size == 1:
        return
    H, P, G, N = (config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                  config.ssm_state_size)
    d_inner = H * P
    local_inner, local_groups = d_inner // tp.size, G * N // tp.size

    def span(offset: int, width: int) -> torch.Tensor:
        return torch.arange(offset + tp.rank * width, offset + (tp.rank + 1) * width)

    x, b, c = span(0, local_inner), span(d_inner, local_groups), \
        span(d_inner + G * N, local_groups)
    conv_rows = torch.cat((x, b, c))
    proj_rows = torch.cat((span(0, local_inner), d_inner + conv_rows,
                           span(2 * d_inner + 2 * G * N, H // tp.size)))

    def pick(tensor: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
        return None if tensor is None else tensor.index_select(0, rows.to(tensor.device))

    w.in_proj, w.in_proj_bias = pick(w.in_proj, proj_rows), pick(w.in_proj_bias, proj_rows)
    w.conv_weight, w.conv_bias = pick(w.conv_weight, conv_rows), pick(w.conv_bias, conv_rows)
    for key in ("dt_bias", "A", "D"):
        setattr(w, key, tp.shard(getattr(w, key), 0, tp.size))
    w.norm_weight = tp.shard(w.norm_weight, 0, tp.size)
    w.out_proj = tp.shard(w.out_proj, 1, tp.size)


class NemotronHLayerWeights(SimpleNamespace):
    """One block's tensors; ``kind`` is ``M``, ``*`` or ``-``."""


class NemotronHAdapter(PagedMhaAdapter):
    """A NemotronH causal LM whose forward reads and writes a hybrid ``DynamicInferenceContext``.

    Build it with ``NemotronHAdapter.from_transformers(hf_model)``; the context needs
    ``mamba_inference_state_config=adapter.mamba_inference_state_config``
    (``Engine.from_transformers`` passes it). Call ``forward(ctx)`` after
    ``ctx.initialize_attention_state()``.
    """

    def __init__(self, *, config: Any, layer_types: List[str], embed: torch.Tensor,
                 layers: list, final_norm: torch.Tensor, lm_head: torch.Tensor,
                 attention_backend: str = "auto", tensor_parallel: TensorParallel = SINGLE):
        self.tp = tp = tensor_parallel
        self._init_weights(config=config, embed=embed, layers=layers, final_norm=final_norm,
                           lm_head=lm_head, eps=config.layer_norm_epsilon,
                           attention_backend=attention_backend)
        self.layer_types = list(layer_types)
        self.num_layers = len(self.layer_types)
        self.num_attention_layers = self.layer_types.count("*")
        self._init_heads(config)
        self.mlp_act = activation(_ACTIVATIONS, "mlp_hidden_act", config.mlp_hidden_act)
        self.mamba_act = activation(_ACTIVATIONS, "mamba_hidden_act", config.mamba_hidden_act)
        # Mamba2 dimensions (as NemotronHMamba2Mixer derives them), of this rank's heads and
        # groups under tensor parallelism (_mamba_shard).
        self.mamba_heads = tp.part(config.mamba_num_heads, "mamba_num_heads")
        self.mamba_head_dim = config.mamba_head_dim
        self.d_state = config.ssm_state_size
        self.n_groups = tp.part(config.n_groups, "n_groups")
        self.d_conv = config.conv_kernel
        self.d_inner = self.mamba_heads * self.mamba_head_dim
        self.conv_dim = self.d_inner + 2 * self.n_groups * self.d_state
        self.dt_min = float(config.time_step_min)  # the mixer's time_step_limit lower bound

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_transformers(cls, hf_model: Any, *, device: Optional[torch.device | str] = None,
                          dtype: Optional[torch.dtype] = None, rope: Optional[str] = None,
                          attention_backend: str = "auto",
                          tensor_parallel: TensorParallel = SINGLE) -> "NemotronHAdapter":
        """Take the weights of a ``transformers`` ``NemotronHForCausalLM`` (moved to ``device`` and
        cast to ``dtype`` when given). ``rope`` is accepted for the engine's uniform call and
        ignored: NemotronH attention has no rotary embedding.

        With ``tensor_parallel`` of more than one rank, this rank's shard: the Mamba heads and
        their groups (``n_groups`` must be divisible by the ranks, as in Megatron: the gated
        norm works per group), the attention heads and the MLP channels; the Mamba states in
        the context are then this rank's heads' (``mamba_inference_state_config``)."""
        check_model_class(hf_model, "NemotronHForCausalLM", "NemotronHAdapter")
        config = hf_model.config
        tp = tensor_parallel
        if tp.size > 1:
            tp.part(config.mamba_num_heads, "mamba_num_heads")
            tp.part(config.n_groups, "n_groups")
        block_types = list(config.layers_block_type)
        unknown = sorted(set(block_types) - set(_LAYER_SYMBOLS))
        if unknown:
            raise NotImplementedError(f"NemotronH layer types {unknown} are not supported")
        if "moe" in block_types:
            raise NotImplementedError("NemotronH MoE layers ('E') are not supported yet")
        if "full_attention" not in block_types:
            raise NotImplementedError("a NemotronH model without attention layers has no KV cache "
                                      "for the context")
        if getattr(config, "num_nextn_predict_layers", 0):
            raise NotImplementedError("multi-token-prediction layers are not supported")
        if getattr(config, "sliding_window", None):
            raise NotImplementedError("sliding-window attention is not supported")
        device, dtype = placement(hf_model, device, dtype)
        take = weight_taker(device, dtype)

        layers = []
        for block in hf_model.model.layers:
            kind = _LAYER_SYMBOLS[block.block_type]
            m = block.mixer
            w = NemotronHLayerWeights(kind=kind, norm=take(block.norm.weight))
            if kind == "*":
                vars(w).update(q=take(m.q_proj.weight), q_bias=take(m.q_proj.bias),
                         k=take(m.k_proj.weight), k_bias=take(m.k_proj.bias),
                         v=take(m.v_proj.weight), v_bias=take(m.v_proj.bias),
                         o=take(m.o_proj.weight), o_bias=take(m.o_proj.bias))
                shard_attention(tp, w, num_q_heads=config.num_attention_heads,
                                num_kv_heads=config.num_key_value_heads)
            elif kind == "-":
                vars(w).update(up=take(m.up_proj.weight), up_bias=take(m.up_proj.bias),
                         down=take(m.down_proj.weight), down_bias=take(m.down_proj.bias))
                if tp.size > 1:
                    tp.part(w.up.shape[0], "intermediate_size")
                    w.up, w.up_bias = tp.shard(w.up, 0, tp.size), tp.shard(w.up_bias, 0, tp.size)
                    w.down = tp.shard(w.down, 1, tp.size)
            else:
                vars(w).update(in_proj=take(m.in_proj.weight), in_proj_bias=take(m.in_proj.bias),
                         conv_weight=take(m.conv1d.weight[:, 0]),             # [conv_dim, K]
                         conv_bias=take(m.conv1d.bias),
                         dt_bias=take(m.dt_bias),
                         # transformers keeps A, dt and the scan in fp32.
                         A=-torch.exp(m.A_log.detach().float()).to(device),
                         D=take(m.D), norm_weight=take(m.norm.weight),
                         norm_group=m.norm.group_size, norm_eps=m.norm.variance_epsilon,
                         out_proj=take(m.out_proj.weight), out_proj_bias=take(m.out_proj.bias))
                _mamba_shard(tp, w, config)
            layers.append(w)
        return cls(config=config, layer_types=[w.kind for w in layers],
                   embed=take(hf_model.model.embeddings.weight), layers=layers,
                   final_norm=take(hf_model.model.norm_f.weight),
                   lm_head=take(hf_model.lm_head.weight), attention_backend=attention_backend,
                   tensor_parallel=tp)

    @property
    def conv_shape(self) -> Tuple[int, int]:
        return (self.conv_dim, self.d_conv)

    @property
    def ssm_shape(self) -> Tuple[int, int, int]:
        return (self.mamba_heads, self.mamba_head_dim, self.d_state)

    @property
    def mamba_inference_state_config(self):
        """The context's ``MambaInferenceStateConfig``: the layer symbols, conv state
        ``(conv_dim, d_conv)`` and SSM state ``(nheads, headdim, d_state)``."""
        from dynctx.context import MambaInferenceStateConfig

        return MambaInferenceStateConfig(tuple(self.layer_types), self.conv_shape, self.ssm_shape)

    # ------------------------------------------------------------------ context checks
    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm(x, weight, eps)

    def _cache_problems(self, ctx: Any) -> list:
        problems = []
        if not getattr(ctx, "is_hybrid_model", False):
            problems.append("the context is not hybrid (pass mamba_inference_state_config)")
        else:
            if list(ctx.layer_types) != self.layer_types:
                problems.append(f"layer types {''.join(ctx.layer_types)} != "
                                f"{''.join(self.layer_types)}")
            if tuple(ctx.mamba_conv_states_shape) != self.conv_shape:
                problems.append(f"conv state shape {tuple(ctx.mamba_conv_states_shape)} != "
                                f"{self.conv_shape}")
            if tuple(ctx.mamba_ssm_states_shape) != self.ssm_shape:
                problems.append(f"ssm state shape {tuple(ctx.mamba_ssm_states_shape)} != "
                                f"{self.ssm_shape}")
        return problems + mha_cache_problems(ctx, head_dim=self.head_dim,
                                             num_kv_heads=self.num_kv_heads)

    def _step_ready(self, ctx: Any) -> bool:
        return ctx.active_attn_metadata is not None and ctx.mamba_metadata is not None

    # ------------------------------------------------------------------ Mamba
    def mamba_plan(self, ctx: Any) -> list:
        """The step's Mamba sequence groups: ``[(slots [R] int32, starts [R], lengths [R])]``
        with host ``starts``/``lengths`` (token offsets in the step); decode rows form one
        group, regular prefills and the continuation chunk another."""
        meta = ctx.mamba_metadata
        num_decode, num_regular = (int(v) for v in meta.device_decode_prefill)
        # Speculative steps (docs/SEMANTICS.md §19): a decode row forwards 1 + its drafts (k,
        # or its own count).
        if getattr(ctx, "num_speculative_tokens", 0):
            paused = ctx.paused_request_count
            per_row = ctx.host_query_lengths()[paused:paused + num_decode].tolist()
        else:
            per_row = [1] * num_decode
        decode_tokens = sum(per_row)
        groups = []
        if num_decode:
            starts = [0] * num_decode
            for i in range(1, num_decode):
                starts[i] = starts[i - 1] + per_row[i - 1]
            groups.append((meta.batch_indices_decode[:num_decode], starts, per_row))
        slots, starts, lengths = [], [], []
        if num_regular:
            cu = meta.cu_seqlens[:num_regular + 1].tolist()
            slots.append(meta.batch_indices_prefill[:num_regular])
            starts += [decode_tokens + c for c in cu[:-1]]
            lengths += [b - a for a, b in zip(cu[:-1], cu[1:])]
        if meta.batch_indices_chunked_prefill is not None:
            offset, count = (int(v) for v in meta.device_chunked_prefill)
            slots.append(meta.batch_indices_chunked_prefill[:1])
            starts.append(decode_tokens + offset)
            lengths.append(count)
        if slots:
            groups.append((torch.cat(slots), starts, lengths))
        return groups

    def _mamba_group(self, ctx: Any, layer_number: int, w: NemotronHLayerWeights,
                     proj: torch.Tensor, out: torch.Tensor, slots: torch.Tensor,
                     starts: List[int], lengths: List[int], intermediate: bool = False) -> None:
        """Run sequences ``starts[i]:starts[i] + lengths[i]`` of ``proj`` (the in_proj output
        ``[n, d_inner + conv_dim + nheads]``) from their slot states; write the gated, normed
        SSM output ``[.., d_inner]`` into ``out`` and the final states back to the slots."""
        R, L = len(starts), max(lengths)
        device = proj.device
        H, P, N, G, K = (self.mamba_heads, self.mamba_head_dim, self.d_state, self.n_groups,
                         self.d_conv)
        offs = torch.arange(L, device=device)
        start_t = torch.tensor(starts, device=device)
        len_t = torch.tensor(lengths, device=device)
        valid = offs[None, :] < len_t[:, None]                                   # [R, L]
        index = torch.where(valid, start_t[:, None] + offs[None, :], 0)          # [R, L]
        rows = proj[index]                                                       # [R, L, *]
        gate, xbc, dt = rows.split([self.d_inner, self.conv_dim, H], dim=-1)
        xbc = torch.where(valid[..., None], xbc, 0)

        conv_state, ssm_state = ctx.gather_mamba_states(layer_number, slots)    # [R, C, K], ...
        # Causal depthwise conv continuing from the last K inputs of the previous tokens.
        history = torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
        conv = F.conv1d(history, w.conv_weight[:, None, :], w.conv_bias,
                        groups=self.conv_dim)[:, :, -L:]                         # [R, C, L]
        xbc_conv = self.mamba_act(conv).transpose(1, 2)                          # [R, L, C]
        # New conv state: the K inputs ending at each sequence's last token.
        last = (len_t[:, None] + torch.arange(K, device=device)[None, :])        # [R, K]
        new_conv = history.gather(2, last[:, None, :].expand(-1, self.conv_dim, -1))

        x, B, C = xbc_conv.split([self.d_inner, G * N, G * N], dim=-1)
        x = x.reshape(R, L, H, P).float()
        B = B.reshape(R, L, G, N).float().repeat_interleave(H // G, dim=2)      # [R, L, H, N]
        C = C.reshape(R, L, G, N).float().repeat_interleave(H // G, dim=2)
        dt = F.softplus(dt.float() + w.dt_bias.float()).clamp(min=self.dt_min)   # [R, L, H]
        dA = torch.exp(dt * w.A)                                                 # [R, L, H]
        state = ssm_state.float()                                                # [R, H, P, N]
        ys, states = [], []
        for t in range(L):
            new = state * dA[:, t, :, None, None] \
                + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
            state = torch.where(valid[:, t, None, None, None], new, state)
            states.append(state)
            ys.append(torch.einsum("rhpn,rhn->rhp", state, C[:, t]))
        if intermediate:
            # Speculative decode rows: the state after each of their 1 + k tokens, for the
            # rewind to restore the one after the accepted tokens (docs/SEMANTICS.md §19).
            inter_conv, inter_ssm = ctx.mamba_states_cache(layer_number, intermediate=True)
            windows = history.unfold(2, K, 1)[:, :, 1:L + 1]                     # [R, C, L, K]
            slot_ids = slots.long()
            inter_conv[slot_ids, :L] = windows.transpose(1, 2).to(inter_conv.dtype)
            inter_ssm[slot_ids, :L] = torch.stack(states, dim=1).to(inter_ssm.dtype)
        y = torch.stack(ys, dim=1) + x * w.D.float()[:, None]                   # [R, L, H, P]
        y = _gated_group_rms_norm(y.reshape(R, L, self.d_inner), gate, w.norm_weight,
                                  w.norm_group, w.norm_eps)
        ctx.scatter_mamba_states(layer_number, slots, new_conv.to(conv_state.dtype).contiguous(),
                                 state.to(ssm_state.dtype).contiguous())
        out[index[valid]] = y[valid].to(out.dtype)

    def mamba_mixer(self, ctx: Any, layer_number: int, w: NemotronHLayerWeights,
                    x: torch.Tensor, groups: list) -> torch.Tensor:
        n = x.shape[0]
        proj = F.linear(x, w.in_proj, w.in_proj_bias)
        out = x.new_zeros(n, self.d_inner)         # padding tokens stay zero
        speculative = bool(getattr(ctx, "num_speculative_tokens", 0))
        for index, (slots, starts, lengths) in enumerate(groups):
            # The decode group (first, when there is one) of a speculative step keeps its
            # intermediate states.
            decode_group = index == 0 and ctx.num_decode_requests > 0
            self._mamba_group(ctx, layer_number, w, proj, out, slots, starts, lengths,
                              intermediate=speculative and decode_group)
        return self.tp.row_linear(out, w.out_proj, w.out_proj_bias)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, ctx: Any, *, last_token_only: bool = True) -> torch.Tensor:
        """Run the step's tokens through the model; returns ``[active_requests, vocab]``
        last-token logits or (``last_token_only=False``) ``[1, padded_tokens, vocab]``."""
        hidden, n, attention = self._start_step(ctx)                          # [n, hidden]
        groups = self.mamba_plan(ctx)
        Hq, Hkv, D = self.num_q_heads, self.num_kv_heads, self.head_dim

        for index, w in enumerate(self.layers):
            layer_number = index + 1
            x = _rms_norm(hidden, w.norm, self.eps)
            if w.kind == "M":
                out = self.mamba_mixer(ctx, layer_number, w, x, groups)
            elif w.kind == "*":
                query = F.linear(x, w.q, w.q_bias).view(n, Hq, D)
                key = F.linear(x, w.k, w.k_bias).view(n, 1, Hkv, D)
                value = F.linear(x, w.v, w.v_bias).view(n, 1, Hkv, D)
                ctx.append_key_value_cache(layer_number, key, value)
                attn = self._attend_mha(ctx, attention, layer_number, query, n)  # [n, Hq * D]
                out = self.tp.row_linear(attn, w.o, w.o_bias)
            else:
                out = self.tp.row_linear(self.mlp_act(F.linear(x, w.up, w.up_bias)), w.down,
                                         w.down_bias)
            hidden = hidden + out
        return self._logits(ctx, hidden, last_token_only)

    __call__ = forward
