"""Any ``transformers`` decoder whose attention goes through transformers' attention seam, run
through a ``DynamicInferenceContext`` by the model's own modelling code.

transformers 5 routes every attention layer through one seam: the module computes its queries,
keys and values (its own projections, norms and rotary embedding), calls
``cache.update(key, value, layer_idx, ...)`` and then the function that
``ALL_ATTENTION_FUNCTIONS`` (``transformers.AttentionInterface``) holds for
``config._attn_implementation``, with its ``scaling``, its ``sliding_window`` and, for gpt-oss,
its sinks (``s_aux``). transformers' own continuous batching plugs its paged cache in there,
and so does vLLM's "Transformers modeling backend"; so do we:

* ``GenericAdapter.forward(ctx)`` calls the model on the step's packed tokens
  (``current_input_and_position_ids``: one row of ``n`` tokens, each with its own position),
  with a ``DynctxCache`` as the cache, ``logits_to_keep`` the last token of each request (the
  rows ``ctx.last_token_logits`` picks) and the step in a keyword argument (``dynctx_step``)
  that the model's code hands down to the attention function, as it does for transformers'
  own continuous batching arguments;
* ``DynctxCache.update`` writes the layer's K/V through ``ctx.append_key_value_cache`` and
  returns the layer's paged K/V cache (``ctx.key_value_cache``);
* the attention function registered as ``"dynctx_paged"`` runs ``PagedAttention`` (planned
  once per step over ``ctx.active_attn_metadata``) on the paged cache with the layer's scale,
  window and sinks.

For the call, ``config._attn_implementation`` is ``"dynctx_paged"`` (and put back after), so
transformers' mask functions see an implementation without one and build no mask: the paged
attention's causality, windows and request boundaries come from the step's metadata. Everything
else is the model's code: embeddings (scaled or not), norms, rotary embeddings of every layer
type, MoE routing, soft-capped final logits.

What a model needs (``seam_problems`` says what it lacks, and ``from_transformers`` raises
``NotImplementedError`` naming the model and each missing piece): a causal LM
(``logits_to_keep`` in its forward) whose class declares ``_supports_attention_backend`` (its
attention modules call the seam), causal attention modules with a ``layer_idx``, one per layer;
layers that are all ``full_attention`` or ``sliding_attention`` (no Mamba or linear-attention
layers: those keep state the seam does not carry); rotary frequencies that do not depend on the
batch's longest sequence (not ``dynamic``/``longrope``); no attention logit soft-capping; its
weights on the device and in the dtype of the context; under tensor parallelism, a
``base_model_tp_plan`` of column- and row-parallel layers (``models/tp_plan.py``). Every
forward also checks that each layer wrote its K/V and called the attention function once, so a
model that bypasses the seam raises instead of giving wrong tokens.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch

from ..kernels.devices import same_device
from ._common import SINGLE, PagedMhaAdapter, TensorParallel, mha_cache_problems
from .paged_attention import resolve_attention_backend
from .tp_plan import shard_by_plan

ATTENTION_NAME = "dynctx_paged"
# Layer types whose attention is the seam's (config.layer_types).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Rotary types whose frequencies depend on the longest sequence of the batch: in a packed step
# of several requests they would differ from the same request alone.
BATCH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
# Backends that compute sliding windows and sinks (models/paged_attention.py).
WINDOW_BACKENDS = ("torch", "torch_static", "triton")


def _paged_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: Any, scaling: Any = None,
                             dropout: float = 0.0, sliding_window: Optional[int] = None,
                             softcap: Optional[float] = None, s_aux: Any = None,
                             dynctx_step: Any = None, **kwargs: Any) -> tuple:
    """The attention function of the seam: ``query`` ``[1, Hq, n, D]``, ``key``/``value`` the
    layer's paged cache (what ``DynctxCache.update`` returned) -> ``([1, n, Hq, D], None)``."""
    if dynctx_step is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} runs inside "
                           "GenericAdapter.forward only (no dynctx_step was passed)")
    return dynctx_step.attend(module, query, key, value, scaling=scaling,
                              sliding_window=sliding_window, softcap=softcap, sinks=s_aux), None


def _register_attention() -> None:
    """Register the attention function with transformers (idempotent; the function holds no
    state: each call finds its step in its arguments)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention_forward)


class DynctxCache:
    """The cache object the model's attention modules call ``update`` on: K/V go into the
    context, and the layer's paged cache comes back for the attention function."""

    def __init__(self, step: "_SeamStep"):
        self.step = step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple:
        """``key_states``/``value_states`` ``[1, Hkv, n, D]`` -> ``(K cache, V cache)``
        ``[num_blocks, block_size, Hkv, D]`` of layer ``layer_idx`` (0-based)."""
        return self.step.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError(
            f"{self.step.adapter.model_name} asks its cache for a sequence length "
            "(cache.get_seq_length()), which a dynctx step of several packed requests, each at "
            "its own positions, does not have: the generic path passes position_ids and needs "
            "a model that uses them")


class _SeamStep:
    """One forward's state: the context, the planned attention, and which layers have gone
    through the seam (each layer once: its K/V written, then its attention)."""

    def __init__(self, adapter: "GenericAdapter", ctx: Any, attention: Any, n: int,
                 layer_attention: Optional[list] = None):
        self.adapter, self.ctx, self.attention, self.n = adapter, ctx, attention, n
        # With KV groups: each layer's planned attention (its group's block table).
        self.layer_attention = layer_attention
        # Per layer: the paged (K, V) cache views update returned (None: not updated yet).
        self.caches: List[Optional[tuple]] = [None] * adapter.num_layers
        self.attended = [False] * adapter.num_layers

    def _layer(self, layer_idx: Any, what: str) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) \
                or not 0 <= layer_idx < self.adapter.num_layers:
            raise ValueError(f"{self.adapter.model_name}: {what} for layer_idx={layer_idx!r}, "
                             f"outside the {self.adapter.num_layers} layers of the context")
        return layer_idx

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               layer_idx: int) -> tuple:
        layer = self._layer(layer_idx, "cache.update")
        adapter = self.adapter
        expected = (1, adapter.num_kv_heads, self.n, adapter.head_dim)
        for name, states in (("key", key_states), ("value", value_states)):
            if tuple(states.shape) != expected:
                raise ValueError(
                    f"{adapter.model_name} layer {layer}: cache.update got {name} states of "
                    f"shape {tuple(states.shape)}, expected [1, kv heads, tokens, head_dim] = "
                    f"{list(expected)}")
        if self.caches[layer] is not None:
            raise RuntimeError(f"{adapter.model_name} layer {layer}: cache.update called twice "
                               "in one forward")
        number = layer + 1
        self.ctx.append_key_value_cache(number, key_states[0].transpose(0, 1),
                                        value_states[0].transpose(0, 1))
        self.caches[layer] = self.ctx.key_value_cache(number)
        return self.caches[layer]

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               *, scaling: Any, sliding_window: Optional[int], softcap: Optional[float],
               sinks: Any) -> torch.Tensor:
        adapter = self.adapter
        layer = self._layer(getattr(module, "layer_idx", None), "the attention function")
        name = f"{adapter.model_name} layer {layer}"
        if self.caches[layer] is None or self.attended[layer]:
            raise RuntimeError(f"{name}: the attention function must follow one cache.update "
                               "of the same layer in each forward (the seam's order)")
        self.attended[layer] = True
        cache_k, cache_v = self.caches[layer]
        if key is not cache_k or value is not cache_v:
            raise RuntimeError(f"{name}: the attention function did not get the paged cache "
                               "that cache.update returned (the model changed K/V in between)")
        if softcap is not None:
            raise NotImplementedError(f"{name}: attention logit soft-capping (softcap="
                                      f"{softcap}) is not in dynctx's paged attention")
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"{name}: sliding_window={sliding_window!r} must be an int >= 1 "
                             "(keys a query sees, its own included)")
        if query.dim() != 4 or query.shape[0] != 1 or query.shape[2] != self.n:
            raise ValueError(f"{name}: query of shape {tuple(query.shape)}, expected [1, heads, "
                             f"{self.n}, head_dim]")
        key_scale, value_scale = self.ctx.key_value_cache_scales(layer + 1)   # FP8 only
        attention = self.attention if self.layer_attention is None else \
            self.layer_attention[layer]
        out = attention(query[0].transpose(0, 1), key, value,
                             softmax_scale=None if scaling is None else float(scaling),
                             window=sliding_window, sinks=sinks, key_scale=key_scale,
                             value_scale=value_scale)                      # [n, Hq, D]
        return out.unsqueeze(0)

    def check_complete(self) -> None:
        missing = [i for i in range(self.adapter.num_layers)
                   if self.caches[i] is None or not self.attended[i]]
        if missing:
            raise RuntimeError(
                f"{self.adapter.model_name}: layers {missing} did not go through the attention "
                "seam (cache.update, then the attention function) in this forward; dynctx "
                "cannot run this model's attention")


# ---------------------------------------------------------------------- what a model needs
def attention_modules(hf_model: Any) -> Dict[int, Any]:
    """The model's attention modules by ``layer_idx``: the modules that hold a ``layer_idx``
    and an ``is_causal`` flag (what the seam's attention modules carry)."""
    found: Dict[int, Any] = {}
    for module in hf_model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and hasattr(module, "is_causal") and index not in found:
            found[index] = module
    return found


def _rope_types(hf_model: Any) -> List[str]:
    types = []
    for module in hf_model.modules():
        kind = getattr(module, "rope_type", None)
        if isinstance(kind, dict):
            types.extend(str(v) for v in kind.values())
        elif isinstance(kind, str):
            types.append(kind)
    return types


def layer_windows(hf_model: Any) -> List[Optional[int]]:
    """Each layer's sliding window as the model declares it (the attention module's
    ``sliding_window``, else the config's), None for a full layer."""
    config = hf_model.config
    modules = attention_modules(hf_model)
    default = getattr(config, "sliding_window", None)
    return [getattr(modules[i], "sliding_window", default) if i in modules else None
            for i in range(config.num_hidden_layers)]


def seam_problems(hf_model: Any) -> List[str]:
    """What ``hf_model`` lacks for the generic path (empty: it runs)."""
    problems = []
    config = hf_model.config
    cls = type(hf_model)
    if getattr(config, "is_encoder_decoder", False):
        problems.append("it is an encoder-decoder model (the context serves decoders)")
    if "logits_to_keep" not in inspect.signature(hf_model.forward).parameters:
        problems.append("its forward takes no logits_to_keep (not a causal LM head)")
    if not getattr(cls, "_supports_attention_backend", False):
        problems.append("its attention does not go through transformers' AttentionInterface "
                        f"({cls.__name__}._supports_attention_backend is not set)")
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        problems.append(f"config.num_hidden_layers={layers!r}")
        return problems
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        problems.append(f"it has layers of type {other} (only {list(ATTENTION_LAYER_TYPES)} go "
                        "through the seam)")
    modules = attention_modules(hf_model)
    absent = [i for i in range(layers) if i not in modules]
    if absent:
        problems.append(f"layers {absent} have no attention module with a layer_idx")
    bidirectional = [i for i, m in sorted(modules.items()) if not m.is_causal]
    if bidirectional:
        problems.append(f"layers {bidirectional} attend bidirectionally (is_causal=False)")
    rope = sorted({t for t in _rope_types(hf_model) if t in BATCH_DEPENDENT_ROPE_TYPES})
    if rope:
        problems.append(f"its rotary embedding type {rope} depends on the batch's longest "
                        "sequence")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        problems.append(f"attention logit soft-capping (attn_logit_softcapping={softcap})")
    return problems


def _has_sinks(hf_model: Any) -> bool:
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor)
               for m in attention_modules(hf_model).values())


class GenericAdapter(PagedMhaAdapter):
    """A ``transformers`` causal LM run by its own modelling code through the attention seam
    (module docstring). Build it with ``GenericAdapter.from_transformers(hf_model)``; call
    ``forward(ctx)`` after ``ctx.initialize_attention_state()``.

    ``path`` is ``"generic"`` (the dedicated adapters say ``"dedicated"``); ``model_name`` is
    the model's class name. ``windows`` lists each layer's sliding window (None: full) and
    ``has_sinks`` whether its attention has sinks."""

    path = "generic"

    def __init__(self, hf_model: Any, *, attention_backend: str = "auto",
                 tensor_parallel: TensorParallel = SINGLE):
        self.tp = tensor_parallel
        config = hf_model.config
        self.hf_model = hf_model
        self.model_name = type(hf_model).__name__
        self.config = config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        param = next(hf_model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_layers = config.num_hidden_layers
        self._init_heads(config)
        modules = attention_modules(hf_model)
        self.head_dim = int(getattr(modules[0], "head_dim", self.head_dim))
        self.windows = layer_windows(hf_model)
        self.has_sinks = _has_sinks(hf_model)
        # The context keeps one KV group per distinct window (context/kv_groups.py); the
        # engine passes these to the context it builds.
        self.context_kwargs = ({"kv_layer_windows": list(self.windows)}
                               if any(w is not None for w in self.windows) else {})
        self._group_attention: list = []
        self._group_attention_key = None
        self.attention_backend_request = self._backend_for(attention_backend)
        self._attention = None
        self._attention_key = None
        self._cache_argument = "cache" if "cache" in inspect.signature(
            hf_model.forward).parameters else "past_key_values"
        self._positions: Optional[torch.Tensor] = None
        _register_attention()

    def __repr__(self) -> str:
        return f"GenericAdapter({self.model_name})"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_transformers(cls, hf_model: Any, *, device: Optional[torch.device | str] = None,
                          dtype: Optional[torch.dtype] = None, rope: str = "table",
                          attention_backend: str = "auto",
                          tensor_parallel: TensorParallel = SINGLE) -> "GenericAdapter":
        """Wrap ``hf_model`` (its modules run as they are: ``device`` and ``dtype``, when
        given, must be the model's; ``rope`` must be the default, as the model's own rotary
        code runs). ``NotImplementedError`` naming the model and what it lacks when its
        attention does not go through the seam (``seam_problems``); ``ValueError`` for a
        window below 1, naming the layer. With ``tensor_parallel`` of more than one rank the
        adapter runs a copy of the model holding this rank's shard, cut by the model's own
        ``base_model_tp_plan`` (``models/tp_plan.py``)."""
        name = type(hf_model).__name__
        if rope != "table":
            raise ValueError(f"rope={rope!r}: {name} takes the generic transformers path, which "
                             "runs the model's own rotary embedding (rope chooses a dedicated "
                             "adapter's route)")
        problems = seam_problems(hf_model)
        if problems:
            raise NotImplementedError(f"{name} cannot run on dynctx's generic transformers path: "
                                      + "; ".join(problems))
        for layer, window in enumerate(layer_windows(hf_model)):
            if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                       or window < 1):
                raise ValueError(f"{name} layer {layer}: sliding_window={window!r} must be an "
                                 "int >= 1 (keys a query sees, its own included) or None")
        param = next(hf_model.parameters())
        wanted = None if device is None else torch.device(device)
        if wanted is not None and (wanted.type != param.device.type or (
                wanted.index is not None and wanted.index != param.device.index)):
            raise ValueError(f"device={device}: {name} runs its own modules on the generic path "
                             f"and its weights are on {param.device}; move the model first")
        if dtype is not None and dtype != param.dtype:
            raise ValueError(f"dtype={dtype}: {name} runs its own modules on the generic path "
                             f"and its weights are {param.dtype}; cast the model first")
        if hf_model.training:
            raise ValueError(f"{name} is in training mode: call model.eval() first")
        if tensor_parallel.size > 1:
            # This rank's shard, by the model's own plan, in a copy (models/tp_plan.py).
            hf_model = shard_by_plan(hf_model, tensor_parallel)
        return cls(hf_model, attention_backend=attention_backend, tensor_parallel=tensor_parallel)

    @staticmethod
    def needs_window_backend(hf_model: Any) -> bool:
        """Whether ``hf_model`` has sliding windows or sinks (which FlashInfer and flash-attn do
        not compute; our Triton kernels and the torch versions do)."""
        return any(w is not None for w in layer_windows(hf_model)) or _has_sinks(hf_model)

    def _backend_for(self, requested: str) -> str:
        """``requested``, except that ``"auto"`` takes the torch attention where the auto choice
        has no windows or sinks (``WINDOW_BACKENDS`` have them); an explicit such backend raises
        ``NotImplementedError``."""
        needs = [what for what, given in (
            ("sliding windows (layers "
             f"{[i for i, w in enumerate(self.windows) if w is not None]})",
             any(w is not None for w in self.windows)),
            ("attention sinks", self.has_sinks)) if given]
        if not needs:
            return requested
        if requested == "auto":
            chosen = resolve_attention_backend("auto", self.device, 1, self.dtype)
            return chosen if chosen in WINDOW_BACKENDS else "torch"
        if requested not in WINDOW_BACKENDS:
            raise NotImplementedError(
                f"{self.model_name} has {' and '.join(needs)}, which attention backend "
                f"{requested!r} does not compute; use 'triton', 'torch' (or 'torch_static' under "
                "CUDA graphs), or 'auto'")
        return requested

    # ------------------------------------------------------------------ context checks
    def _cache_problems(self, ctx: Any) -> list:
        problems = mha_cache_problems(ctx, head_dim=self.head_dim,
                                      num_kv_heads=self.num_kv_heads, num_layers=self.num_layers)
        if ctx.fused_rope_kv_append:
            problems.append("fused_rope_kv_append=True: the generic path runs the model's own "
                            "rotary embedding")
        return problems

    # ------------------------------------------------------------------ forward
    @contextmanager
    def _seam(self) -> Iterator[None]:
        """The model's config names our attention function for the duration of a forward."""
        config = self.hf_model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous

    def _last_token_indices(self, ctx: Any, n: int) -> torch.Tensor:
        """The token rows ``ctx.last_token_logits`` picks (one per request of the step, or of
        the graph), as indices for ``logits_to_keep``: the rows of ``[0, n)`` gathered from an
        fp32 column of positions (exact below 2**24 tokens)."""
        if self._positions is None or self._positions.shape[1] < n \
                or not same_device(self._positions.device, ctx.device):
            size = max(n, int(ctx.max_tokens))
            self._positions = torch.arange(size, dtype=torch.float32,
                                           device=ctx.device).view(1, size, 1)
        return ctx.last_token_logits(self._positions[:, :n]).view(-1).long()

    def _group_attentions(self, ctx: Any, n: int, attention: Any) -> Optional[list]:
        """With KV groups (``active_attn_metadata.kv_group_block_tables``), each layer's
        attention planned over its group's block table (group 0's is ``attention``); None
        without groups."""
        meta = ctx.active_attn_metadata
        tables = getattr(meta, "kv_group_block_tables", None)
        if tables is None:
            return None
        key = self._attention_cache_key(ctx)
        if self._group_attention_key != key:
            self._group_attention, self._group_attention_key = [], key
        while len(self._group_attention) < len(tables) - 1:
            self._group_attention.append(self._new_attention(ctx))
        planned = [attention]
        extra = dict(dtype=self.dtype) if self._plan_with_dtype else {}
        for table, group_attention in zip(tables[1:], self._group_attention):
            group_attention.plan(cu_query_lengths=meta.cu_query_seq_lengths,
                                 kv_seq_lengths=meta.kv_seq_lengths, block_table=table,
                                 max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                                 num_tokens=n, num_decode_requests=ctx.num_decode_requests,
                                 **extra)
            planned.append(group_attention)
        return [planned[group] for group in meta.kv_group_of_layer]

    @torch.no_grad()
    def forward(self, ctx: Any, *, last_token_only: bool = True) -> torch.Tensor:
        """Run the step's tokens through the model's own code.

        Returns ``[active_requests, vocab]`` last-token logits (``last_token_only``: the model's
        LM head runs on those rows only, through ``logits_to_keep``), or ``[1, padded_tokens,
        vocab]`` logits of every token, in the model's output dtype."""
        n, attention = self._plan_step(ctx)
        input_ids, position_ids = ctx.current_input_and_position_ids()
        keep = self._last_token_indices(ctx, n) if last_token_only else 0
        step = _SeamStep(self, ctx, attention, n, self._group_attentions(ctx, n, attention))
        with self._seam():
            output = self.hf_model(input_ids=input_ids, position_ids=position_ids,
                                   use_cache=True, logits_to_keep=keep, dynctx_step=step,
                                   **{self._cache_argument: DynctxCache(step)})
        step.check_complete()
        logits = output.logits
        return logits[0] if last_token_only else logits

    __call__ = forward


__all__ = ["ATTENTION_LAYER_TYPES", "ATTENTION_NAME", "BATCH_DEPENDENT_ROPE_TYPES",
           "DynctxCache", "GenericAdapter", "attention_modules", "layer_windows",
           "seam_problems"]
