"""What the model adapters share: weight loading from ``transformers``, the Llama RMSNorm, the
activation table, the rotary tables, the context checks, and ``PagedAdapter``, the base class
that owns the attention object, the start of a step (context check, attention plan, embedding)
and its end (final norm, LM head, last-token logits)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..kernels.devices import indexed_device, same_device
from .paged_attention import PagedAttention

ROPE_MODES = ("table", "cos_sin")
# RoPE types whose inverse frequencies do not depend on the sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class TensorParallel:
    """This rank's place in a tensor-parallel group, and the shard and reduce operations of
    Megatron's column- and row-parallel linear layers, over ``torch.distributed``.

    ``size == 1`` (the default, ``TensorParallel()``): one process holds the whole model and
    every method is the identity. Weights are sharded from the full ``transformers`` tensors:
    ``shard(w, dim, parts)`` keeps this rank's part (column-parallel layers shard their output
    rows, row-parallel ones their input columns); ``row_linear`` runs a row-parallel layer
    (local matmul, one ``all_reduce`` sum over the group, then the bias once)."""

    def __init__(self, size: int = 1, rank: int = 0, group: Any = None):
        self.size, self.rank, self.group = int(size), int(rank), group

    @classmethod
    def from_group(cls, size: Optional[int], group: Any = None) -> "TensorParallel":
        """This rank's ``TensorParallel`` of ``size`` ranks: ``group`` (a process group), or
        the default ``torch.distributed`` group, which must then have ``size`` ranks. ``size``
        None or 1 (and no group of more ranks): ``TensorParallel()``."""
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                                 or size < 1):
            raise ValueError(f"tensor_model_parallel_size={size!r} must be an int >= 1 or None")
        if group is None and (size or 1) == 1:
            return cls()
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"tensor_model_parallel_size={size} needs torch.distributed initialised, one "
                "process per rank: launch with torchrun (python -m torch.distributed.run "
                f"--nproc-per-node {size} ...) and call "
                "torch.distributed.init_process_group() first")
        group = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        if size is not None and world != size:
            raise ValueError(f"tensor_model_parallel_size={size} but the tensor-parallel group "
                             f"has {world} ranks (pass the group of exactly {size} ranks as "
                             "pg_collection.tp)")
        if world == 1:
            return cls()
        return cls(world, dist.get_rank(group), group)

    def part(self, total: int, name: str) -> int:
        """``total // size``; ``ValueError`` naming ``name`` when ``size`` does not divide it."""
        if total % self.size:
            raise ValueError(f"{name}={total} must be divisible by "
                             f"tensor_model_parallel_size={self.size}")
        return total // self.size

    def shard(self, tensor: Optional[torch.Tensor], dim: int, parts: int,
              index: Optional[int] = None) -> Optional[torch.Tensor]:
        """Part ``index`` (default: this rank) of ``tensor`` cut into ``parts`` equal parts
        along ``dim``, contiguous (``None`` stays ``None``; identity for one rank)."""
        if tensor is None or parts == 1:
            return tensor
        index = self.rank if index is None else index
        step = tensor.shape[dim] // parts
        return tensor.narrow(dim, index * step, step).contiguous()

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (one ``all_reduce``); returns it."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def row_linear(self, x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
        """A row-parallel linear layer: ``x`` and ``weight`` hold this rank's input columns;
        the partial products are summed over the group, then ``bias`` is added once."""
        if self.size == 1:
            return F.linear(x, weight, bias)
        out = self.reduce(F.linear(x, weight))
        return out if bias is None else out + bias


SINGLE = TensorParallel()


def kv_head_shard(tp: TensorParallel, num_q_heads: int, num_kv_heads: int) -> tuple:
    """``(local query heads, local KV heads, index of the local KV part, KV parts)`` of this
    rank: query heads are divided; KV heads are divided too, or, when the ranks outnumber them,
    each rank holds the one KV head its query heads use (replicated, as Megatron allows)."""
    local_q = tp.part(num_q_heads, "num_attention_heads")
    if num_kv_heads >= tp.size:
        return local_q, tp.part(num_kv_heads, "num_key_value_heads"), tp.rank, tp.size
    if tp.size % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} must divide "
                         f"tensor_model_parallel_size={tp.size} when it is smaller")
    return local_q, 1, tp.rank // (tp.size // num_kv_heads), num_kv_heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def gated_mlp(act: Callable, x: torch.Tensor, w: Any,
              tp: TensorParallel = SINGLE) -> torch.Tensor:
    """SwiGLU-style MLP ``down(act(gate(x)) * up(x))`` over ``w``'s ``gate``/``up``/``down``
    weights and biases (under tensor parallelism: this rank's ``gate``/``up`` rows and
    ``down`` columns, ``down`` row-parallel)."""
    hidden = act(F.linear(x, w.gate, w.gate_bias)) * F.linear(x, w.up, w.up_bias)
    return tp.row_linear(hidden, w.down, w.down_bias)


def shard_gated_mlp(tp: TensorParallel, w: Any, intermediate: int, name: str) -> Any:
    """``w`` (``gate``/``up``/``down`` weights and biases) with this rank's part of the
    ``intermediate`` channels: ``gate``/``up`` column-parallel, ``down`` row-parallel (its
    bias whole, added once)."""
    if tp.size == 1:
        return w
    parts = tp.size
    tp.part(intermediate, name)
    for key in ("gate", "gate_bias", "up", "up_bias"):
        setattr(w, key, tp.shard(getattr(w, key), 0, parts))
    w.down = tp.shard(w.down, 1, parts)
    return w


def activation(table: dict, name: str, value: str) -> Callable:
    """``table[value]``; ``NotImplementedError`` naming the config field ``name`` otherwise."""
    if value not in table:
        raise NotImplementedError(f"{name}={value!r}: supported {sorted(table)}")
    return table[value]


# ---------------------------------------------------------------------- weight loading
def check_model_class(hf_model: Any, expected: str, adapter: str) -> None:
    name = type(hf_model).__name__
    if name != expected:
        raise NotImplementedError(f"{adapter} takes a {expected}, got {name}")


def static_rotary(hf_model: Any) -> Any:
    """The model's rotary embedding module, after checking that tensor parallelism is off and
    that its frequencies do not depend on the sequence length."""
    config = hf_model.config
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise NotImplementedError(f"pretraining_tp={config.pretraining_tp} is not supported")
    rotary = hf_model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type={rope_type!r}: its frequencies depend on the sequence length; "
            f"supported {STATIC_ROPE_TYPES}")
    return rotary


def placement(hf_model: Any, device: Optional[torch.device | str],
              dtype: Optional[torch.dtype]) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` to take the weights to: the given ones, else the model's."""
    param = next(hf_model.parameters())
    return indexed_device(device if device is not None else param.device), (dtype or param.dtype)


def weight_taker(device: torch.device, dtype: torch.dtype
                 ) -> Callable[..., Optional[torch.Tensor]]:
    """``take(tensor, as_dtype=None)``: the tensor detached, on ``device``, in ``as_dtype`` or
    ``dtype`` (``None`` stays ``None``; shared with the model when nothing changes)."""

    def take(tensor: Optional[torch.Tensor], as_dtype: Optional[torch.dtype] = None
             ) -> Optional[torch.Tensor]:
        if tensor is None:
            return None
        return tensor.detach().to(device=device, dtype=as_dtype or dtype)

    return take


# ---------------------------------------------------------------------- context checks
def mha_cache_problems(ctx: Any, *, head_dim: int, num_kv_heads: int,
                       num_layers: Optional[int] = None) -> list:
    """Mismatches between a K/V cache context and an MHA/GQA model (``num_layers`` checked when
    given)."""
    problems = []
    if ctx.cache_mla_latent:
        problems.append("the context caches an MLA latent (cache_mla_latent=True)")
    if num_layers is not None and ctx.num_attention_layers != num_layers:
        problems.append(f"num_layers {ctx.num_attention_layers} != {num_layers}")
    if ctx.kv_channels != head_dim:
        problems.append(f"kv_channels {ctx.kv_channels} != head_dim {head_dim}")
    if ctx.num_attention_heads_per_partition != num_kv_heads:
        problems.append(f"num_attention_heads (per partition) "
                        f"{ctx.num_attention_heads_per_partition} != num_key_value_heads "
                        f"{num_kv_heads}")
    return problems


def shard_attention(tp: TensorParallel, w: Any, *, num_q_heads: int, num_kv_heads: int) -> Any:
    """``w``'s ``q``/``k``/``v`` (column-parallel: this rank's heads' rows, biases alike) and
    ``o`` (row-parallel: the columns of this rank's query heads; ``o_bias`` whole, added once)
    for this rank (``kv_head_shard``)."""
    if tp.size == 1:
        return w
    _, _, kv_index, kv_parts = kv_head_shard(tp, num_q_heads, num_kv_heads)
    for key in ("q", "q_bias"):
        setattr(w, key, tp.shard(getattr(w, key), 0, tp.size))
    for key in ("k", "k_bias", "v", "v_bias"):
        setattr(w, key, tp.shard(getattr(w, key), 0, kv_parts, kv_index))
    w.o = tp.shard(w.o, 1, tp.size)
    return w


class PagedAdapter:
    """Base of the adapters. A subclass calls ``_init_weights`` (and ``_init_rope`` when it has
    rotary embeddings), defines ``_cache_problems(ctx)`` and ``_new_attention(ctx)``, and runs
    its layers between ``_start_step`` and ``_logits``.

    Under tensor parallelism (``tp``, a ``TensorParallel`` of more than one rank) the adapter
    holds this rank's shard of the attention heads and MLP channels and all-reduces after
    every row-parallel layer; the embedding, the norms and the LM head are whole on every
    rank, so every rank computes the same logits."""

    # Which path ``Engine.from_transformers`` took: a dedicated adapter (this class's
    # subclasses) or the generic one (``models/generic.py``).
    path = "dedicated"
    # Whether the attention's ``plan`` takes the model dtype.
    _plan_with_dtype = True
    tp: TensorParallel = SINGLE

    def _init_weights(self, *, config: Any, embed: torch.Tensor, layers: list,
                      final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float,
                      attention_backend: str) -> None:
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.eps = eps
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.attention_backend_request = attention_backend
        self._attention = None
        self._attention_key = None

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    # ------------------------------------------------------------------ rotary tables
    def _init_rope(self, *, inv_freq: torch.Tensor, rope_mscale: float, rope: str) -> None:
        self.inv_freq = inv_freq.float().to(self.device)
        self.rope_mscale = float(rope_mscale)
        self.rope = rope
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope_tables(self, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(angle table [max_seq, 1, 1, D] fp32, cos/sin cache [max_seq, D] fp32)`` over the
        rotary dims ``D``.

        Megatron's half-split ``cat(freqs, freqs)`` angles, ``position * inv_freq`` in fp32 as
        transformers computes them; the cos/sin cache carries the rope ``attention_scaling``
        (mscale), the angle table does not (the context applies ``mscale``)."""
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
        problems = self._cache_problems(ctx)
        if ctx.params_dtype != self.dtype:
            problems.append(f"params_dtype {ctx.params_dtype} != model dtype {self.dtype}")
        if not same_device(ctx.device, self.device):
            problems.append(f"device {ctx.device} != model device {self.device}")
        if problems:
            raise ValueError("the context does not match the model: " + "; ".join(problems))

    def _attention_cache_key(self, ctx: Any) -> Any:
        return (ctx.block_size_tokens, ctx.device)

    def attention_for(self, ctx: Any) -> Any:
        """The paged attention object for ``ctx`` (built once per block size and device)."""
        key = self._attention_cache_key(ctx)
        if self._attention is None or self._attention_key != key:
            self._attention = self._new_attention(ctx)
            self._attention_key = key
        return self._attention

    @property
    def attention_backend(self) -> Optional[str]:
        """The paged attention backend that runs (``None`` before the first forward)."""
        return None if self._attention is None else self._attention.backend

    # ------------------------------------------------------------------ step driver
    def _step_ready(self, ctx: Any) -> bool:
        return ctx.active_attn_metadata is not None

    def _plan_step(self, ctx: Any) -> tuple[int, Any]:
        """Check the context and plan the step's attention: ``(n, attention)``, ``n`` the
        step's padded token count."""
        self.check_context(ctx)
        if not self._step_ready(ctx):
            raise RuntimeError("call ctx.initialize_attention_state() before forward()")
        meta = ctx.active_attn_metadata
        n = ctx.current_input_and_position_ids()[0].shape[1]
        attention = self.attention_for(ctx)
        extra = dict(dtype=self.dtype) if self._plan_with_dtype else {}
        # The decode paths take one query a request: a speculative step's decode requests
        # (1 + k queries each, docs/SEMANTICS.md §19) run on the varlen path with the prefills,
        # unless none has drafts (a plain decode step: every query length 1).
        decode = ctx.num_decode_requests
        if getattr(ctx, "num_speculative_tokens", 0) and meta.max_seqlen_q != 1:
            decode = 0
        attention.plan(cu_query_lengths=meta.cu_query_seq_lengths,
                       kv_seq_lengths=meta.kv_seq_lengths, block_table=meta.block_table,
                       max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                       num_tokens=n, num_decode_requests=decode, **extra)
        return n, attention

    def _start_step(self, ctx: Any) -> tuple[torch.Tensor, int, Any]:
        """Check the context, plan the step's attention and embed its tokens: ``(hidden [n,
        hidden], n, attention)``."""
        n, attention = self._plan_step(ctx)
        input_ids, _ = ctx.current_input_and_position_ids()
        return F.embedding(input_ids[0], self.embed), n, attention

    def _logits(self, ctx: Any, hidden: torch.Tensor, last_token_only: bool) -> torch.Tensor:
        """Final norm and LM head: ``[active_requests, vocab]`` last-token logits (picked on the
        hidden states before the LM head) or ``[1, n, vocab]``."""
        hidden = self._norm(hidden, self.final_norm, self.eps)
        if last_token_only:
            return F.linear(ctx.last_token_logits(hidden.unsqueeze(0)), self.lm_head)
        return F.linear(hidden, self.lm_head).unsqueeze(0)


class PagedMhaAdapter(PagedAdapter):
    """An adapter whose attention layers use the K/V cache and ``PagedAttention`` (needs
    ``num_q_heads``, ``num_kv_heads`` and ``head_dim``)."""

    def _init_heads(self, config: Any) -> None:
        """Heads of this rank: ``num_q_heads``/``num_kv_heads`` are the local ones (all of
        them without tensor parallelism); ``context_kv_heads`` is the model's KV head count,
        what the context is built with (it divides it by the ranks itself)."""
        q_heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // q_heads
        self.context_kv_heads = kv_heads
        self.num_q_heads, self.num_kv_heads, _, _ = kv_head_shard(self.tp, q_heads, kv_heads)

    def _new_attention(self, ctx: Any) -> PagedAttention:
        return PagedAttention(
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, block_size=ctx.block_size_tokens, device=ctx.device,
            softmax_scale=self.head_dim ** -0.5, backend=self.attention_backend_request,
            dtype=self.dtype)

    def _attend_mha(self, ctx: Any, attention: PagedAttention, layer_number: int,
                    query: torch.Tensor, n: int) -> torch.Tensor:
        """Paged attention of ``query`` over layer ``layer_number``'s cache (this step's K/V
        appended): ``[n, Hq * D]``."""
        Hq, D = self.num_q_heads, self.head_dim
        key_cache, value_cache = ctx.key_value_cache(layer_number)
        key_scale, value_scale = ctx.key_value_cache_scales(layer_number)     # FP8 only
        attn = attention(query.reshape(n, Hq, D), key_cache, value_cache,
                         key_scale=key_scale, value_scale=value_scale)         # [n, Hq, D]
        return attn.reshape(n, Hq * D)


__all__ = ["ACTIVATIONS", "ROPE_MODES", "SINGLE", "STATIC_ROPE_TYPES", "PagedAdapter",
           "PagedMhaAdapter", "TensorParallel", "activation", "check_model_class", "gated_mlp",
           "kv_head_shard", "mha_cache_problems", "placement", "rms_norm", "shard_attention",
           "shard_gated_mlp", "static_rotary", "weight_taker"]
