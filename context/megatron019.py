"""Megatron-Core 0.19's constructor: ``DynamicInferenceContext(model_config, inference_config)``.

0.19 builds the context from a Megatron ``TransformerConfig`` (or ``MLATransformerConfig``) and
an ``InferenceConfig`` (``context/config.py``). ``constructor_arguments`` turns that pair into
the keyword arguments of the 0.16 form, which stays the one path that checks, sizes and builds
(``construction.settle``), plus what 0.19 derives differently: the block counts
(``block_counts``, taken by ``sizing.memory_layout`` instead of its own division) and the
attributes 0.19's context has beyond 0.16's (``attributes``). The derivations are 0.19's
(``megatron/core/inference/contexts/dynamic_context.py``, ``__init__``, at ``core_v0.19.0``):

* KV heads: ``num_query_groups or num_attention_heads`` (per tensor-parallel rank, one when
  the ranks outnumber them: the 0.16 form's rule); head size ``kv_channels``.
* Tensor/pipeline sizes from ``inference_config.pg_collection`` when given, else from the
  model config's ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size``.
* Layers of this pipeline stage: Megatron's ``get_num_layers_to_build(model_config,
  vp_stage=None, pp_rank=...)`` under pipeline parallelism (the caller passes a Megatron
  config, so Megatron is there to ask), all of them otherwise; hybrids: the layer type list.
* MLA: ``cache_mla_latents`` of an MLA config caches the latent; block size 64 is asserted.
* Blocks: ``buffer_size_gb`` and ``paused_buffer_size_gb`` (``None``: no paused budget) in
  blocks of KV plus, for hybrids, one request's Mamba state per block; with
  ``mamba_memory_ratio`` that share of the budget goes to Mamba states and the rest to KV
  blocks; a hybrid with an explicit ``max_requests`` gets exactly that many Mamba states and
  the rest as KV blocks; at least 2 blocks. Under pipeline parallelism the counts are the MIN
  over the ranks (the 0.16 form's one all-reduce, which covers the pipeline group).
* ``max_requests`` (when not given): one per block less the dummy block, capped by the Mamba
  states, rounded down to the tensor-parallel size and ``REQUEST_ROUNDER``.
* 0.19's assertions, with its messages, raise ``ConfigAssertionError`` (a ``ValueError`` and
  an ``AssertionError``, as 0.19 asserts them) before anything is built.

``num_speculative_tokens`` goes to the speculative steps (docs/SEMANTICS.md §19); a hybrid's
Mamba memory per request then counts 0.19's ``k + 1`` intermediate states too.

What 0.19 supports that dynctx does not yet (GDN layers) raises
``NotImplementedError`` naming the field; docs/SEMANTICS.md §16 lists every difference.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from .sizing import GIB, layer_layout

#: The 0.16 form's keywords a 0.19 caller may still pass beside the two configs: dynctx's own
#: options, which neither config holds.
DYNCTX_OPTIONS = ("device", "kernel_backend", "fused_rope_kv_append", "vocab_size", "validate",
                  "kv_offload_gb", "prefix_caching_host_tier")

#: The 0.16 form's required keywords (defaulted to None in the signature, which also takes the
#: 0.19 pair).
REQUIRED = ("params_dtype", "num_layers", "kv_channels", "num_attention_heads",
            "max_sequence_length", "buffer_size_gb")

#: 0.19 reads these model-config fields, which megatron-core 0.16.1's ``TransformerConfig``
#: lacks; their 0.19 defaults.
MODEL_FIELDS_019 = dict(inference_cuda_graph_scope=None, moe_enable_routing_replay=False,
                        inference_moe_token_dispatcher_type=None,
                        inference_grouped_gemm_backend="vllm")

#: 0.19's cap on the Mamba states extracted per request and step (mamba_slot_allocator.py).
MAX_INTERMEDIATE_OFFSETS_PER_REQUEST = 3


class ConfigAssertionError(ValueError, AssertionError):
    """A 0.19 assertion of the constructor failed: a ``ValueError`` naming the field, and an
    ``AssertionError`` too, as 0.19 asserts it (code written for 0.19 catches that)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigAssertionError(message)


@dataclass(frozen=True)
class Megatron019Arguments:
    """What ``constructor_arguments`` derived: the 0.16 form's ``keywords``, the
    ``block_counts`` ``(blocks, paused blocks)`` before the ranks' MIN (None: the 0.16 form's
    own division) and 0.19's extra ``attributes`` of the context."""

    keywords: Dict[str, Any]
    block_counts: Optional[Tuple[int, int]]
    attributes: Dict[str, Any]

    def finish(self, ctx: Any) -> None:
        """Give the built context 0.19's attributes (``self.attributes``, and what 0.19 derives
        from the final counts)."""
        ctx.__dict__.update(self.attributes)
        if getattr(ctx, "is_hybrid_model", False):
            ctx.max_mamba_intermediate_states_per_step = max_mamba_intermediate_states_per_step(
                ctx.max_tokens, ctx.block_size_tokens, ctx.max_requests)


def constructor_arguments(arguments: Dict[str, Any], init: Any, *, request_rounder: int,
                          default_max_tokens: int) -> Megatron019Arguments:
    """The constructor's ``arguments`` (every parameter of ``init``, as given or defaulted) as
    the 0.16 form's keywords: the 0.16 form checked for its required keywords, the 0.19 form
    (``model_config``, ``inference_config``) derived as the module docstring says."""
    model_config = arguments.pop("model_config")
    inference_config = arguments.pop("inference_config")
    if model_config is None and inference_config is None:
        missing = [name for name in REQUIRED if arguments[name] is None]
        if missing:
            raise TypeError(f"DynamicInferenceContext() needs model_config and inference_config "
                            f"(Megatron-Core 0.19's form) or the keyword arguments "
                            f"{', '.join(missing)} (0.16's form)")
        return Megatron019Arguments(arguments, None, _counters_only())
    if model_config is None or inference_config is None:
        raise TypeError("DynamicInferenceContext(model_config, inference_config) needs both "
                        f"(model_config={type(model_config).__name__}, inference_config="
                        f"{type(inference_config).__name__})")
    defaults = {name: p.default for name, p in inspect.signature(init).parameters.items()}
    extra = sorted(name for name, value in arguments.items()
                   if name not in DYNCTX_OPTIONS and value is not defaults[name])
    if extra:
        raise TypeError(f"DynamicInferenceContext(model_config, inference_config) takes no 0.16 "
                        f"keyword arguments besides {', '.join(DYNCTX_OPTIONS)}; got "
                        f"{', '.join(extra)}")
    return _from_configs(model_config, inference_config, arguments,
                         request_rounder=request_rounder, default_max_tokens=default_max_tokens)


def _counters_only() -> Dict[str, Any]:
    return dict(config=None)  # num_speculative_tokens: the construction's own attribute


def _layers_of_this_stage(model_config: Any, pg_collection: Any, pp_size: int) -> int:
    """0.19's ``get_num_layers_to_build(model_config, vp_stage=None, pp_rank=...)``: Megatron's
    own function under pipeline parallelism or a custom layout, all layers otherwise."""
    if pp_size == 1 and getattr(model_config, "pipeline_model_parallel_layout", None) is None:
        return int(model_config.num_layers)
    block = importlib.import_module("megatron.core.transformer.transformer_block")
    pp_rank = None
    if pg_collection is not None:
        pp_rank = torch.distributed.get_rank(group=pg_collection.pp)
    return int(block.get_num_layers_to_build(model_config, vp_stage=None, pp_rank=pp_rank))


def _group_size(group: Any) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group=group)


#: What 0.19 reads of every model config (an MLA config's latent sizes when it caches them).
MODEL_FIELDS = ("num_layers", "kv_channels", "num_attention_heads", "num_query_groups",
                "params_dtype", "hidden_size", "tensor_model_parallel_size",
                "pipeline_model_parallel_size")


def _check_configs(model_config: Any, config: Any) -> None:
    """The configs have what 0.19 reads, and the numbers it computes with are numbers:
    ``TypeError``/``ValueError`` naming the config and the field before any derivation
    (0.19's own asserts follow in ``_from_configs``)."""
    from .config import InferenceConfig

    for name, value, wanted in (
            ("model_config", model_config, MODEL_FIELDS),
            ("inference_config", config, [f.name for f in fields(InferenceConfig)])):
        missing = [field for field in wanted if not hasattr(value, field)]
        if missing:
            raise TypeError(f"{name}={type(value).__name__} lacks {', '.join(missing[:4])}"
                            f"{' ...' if len(missing) > 4 else ''} (0.19's form takes a Megatron "
                            "TransformerConfig and an InferenceConfig)")
    for field, optional in (("block_size_tokens", False), ("num_speculative_tokens", False),
                            ("max_requests", True), ("max_tokens", True)):
        value = getattr(config, field)
        if not (optional and value is None) and (
                isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise TypeError(f"inference_config.{field}={value!r} must be an int"
                            f"{' or None' if optional else ''}")
    for field, optional in (("buffer_size_gb", False), ("paused_buffer_size_gb", True),
                            ("mamba_memory_ratio", True)):
        value = getattr(config, field)
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                             np.floating)):
            raise TypeError(f"inference_config.{field}={value!r} must be a number"
                            f"{' or None' if optional else ''}")
        if not math.isfinite(value):
            raise ValueError(f"inference_config.{field}={value!r} must be finite")


def _from_configs(model_config: Any, config: Any, arguments: Dict[str, Any], *,
                  request_rounder: int, default_max_tokens: int) -> Megatron019Arguments:
    _check_configs(model_config, config)
    block_size = config.block_size_tokens
    cache_mla = (type(model_config).__name__ == "MLATransformerConfig"
                 or hasattr(model_config, "kv_lora_rank")) and bool(
                     getattr(model_config, "cache_mla_latents", False))
    if cache_mla:
        _check(block_size == 64, "Flash MLA requires a block size of 64. Set "
               "--inference-dynamic-batching-block-size 64 to fix this assert")
    heads = model_config.num_query_groups or model_config.num_attention_heads
    pg = config.pg_collection
    if pg is not None:
        tp_size, pp_size = _group_size(pg.tp), _group_size(pg.pp)
    else:
        tp_size = model_config.tensor_model_parallel_size
        pp_size = model_config.pipeline_model_parallel_size
    k = config.num_speculative_tokens
    _check(k < block_size, f"num_speculative_tokens ({k}) must be < block_size_tokens "
           f"({block_size})")
    mamba = config.mamba_inference_state_config
    if mamba is not None and "G" in list(mamba.layer_type_list):
        raise NotImplementedError("GDN layers are not supported for inference.")
    num_layers = (int(model_config.num_layers) if mamba is not None
                  else _layers_of_this_stage(model_config, pg, pp_size))
    if mamba is None and num_layers == 0:
        raise NotImplementedError(
            "Using `DynamicInferenceContext` with no attention is not supported.")
    params_dtype = model_config.params_dtype
    layers = layer_layout(num_layers, mamba, params_dtype)
    per_partition = heads // tp_size if heads >= tp_size else 1
    itemsize = params_dtype.itemsize
    if cache_mla:
        block_bytes = (itemsize * layers.num_attention_layers * block_size
                       * (model_config.kv_lora_rank + model_config.qk_pos_emb_head_dim))
    else:
        block_bytes = (itemsize * 2 * layers.num_attention_layers * block_size * per_partition
                       * model_config.kv_channels)
    blocks, paused, mamba_max = _block_counts(config, layers, block_bytes, k)
    max_requests = config.max_requests
    if max_requests is None and mamba_max < blocks - 1 + (paused if
                                                         config.unified_memory_level else 0):
        max_requests = mamba_max // tp_size * tp_size
        max_requests = max_requests // request_rounder * request_rounder
    if max_requests is not None:
        _check(max_requests % tp_size == 0, f"max_requests must be divisible by tp_size "
               f"({tp_size}), but got {max_requests}")
        max_tokens = config.max_tokens or default_max_tokens
        _check(max_tokens >= max_requests, f"max_tokens ({max_tokens}) must be >= max_requests "
               f"({max_requests}), to have consistency between cuda graph sizes and the block "
               "table size.")
    keywords = dict(
        arguments, params_dtype=params_dtype, num_layers=num_layers,
        kv_channels=model_config.kv_channels, num_attention_heads=heads,
        max_sequence_length=config.max_sequence_length, buffer_size_gb=config.buffer_size_gb,
        paused_buffer_size_gb=config.paused_buffer_size_gb or 0, max_requests=max_requests,
        max_tokens=config.max_tokens or default_max_tokens, block_size_tokens=block_size,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        pg_collection=pg, cache_mla_latent=cache_mla,
        kv_lora_rank=getattr(model_config, "kv_lora_rank", None) if cache_mla else None,
        qk_pos_emb_head_dim=(getattr(model_config, "qk_pos_emb_head_dim", None)
                             if cache_mla else None),
        num_cuda_graphs=config.num_cuda_graphs,
        materialize_only_last_token_logits=config.materialize_only_last_token_logits,
        mamba_inference_state_config=mamba,
        use_cuda_graphs_for_non_decode_steps=config.use_cuda_graphs_for_non_decode_steps,
        use_flashinfer_fused_rope=config.use_flashinfer_fused_rope,
        unified_memory_level=config.unified_memory_level,
        cuda_graph_mixed_prefill_count=config.cuda_graph_mixed_prefill_count,
        metrics_writer=config.metrics_writer,
        request_metadata_types=config.request_metadata_types,
        enable_prefix_caching=config.enable_prefix_caching,
        prefix_caching_eviction_policy=config.prefix_caching_eviction_policy,
        prefix_caching_mamba_gb=config.prefix_caching_mamba_gb, num_speculative_tokens=k,
        kv_cache_management_mode=config.kv_cache_management_mode)
    attributes = {name: getattr(model_config, name, default)
                  for name, default in MODEL_FIELDS_019.items()}
    attributes.update(
        config=config, num_speculative_tokens=k, hidden_size=model_config.hidden_size,
        enable_chunked_prefill=config.enable_chunked_prefill,
        prefix_caching_coordinator_policy=config.prefix_caching_coordinator_policy,
        prefix_caching_routing_alpha=config.prefix_caching_routing_alpha,
        kv_cache_management_mode=config.kv_cache_management_mode,
        static_kv_memory_pointers=config.static_kv_memory_pointers)
    if mamba is not None:
        attributes["mamba_chunk_size"] = getattr(mamba, "mamba_chunk_size", 128)
    return Megatron019Arguments(keywords, (blocks, paused), attributes)


def max_mamba_intermediate_states_per_step(max_tokens: int, block_size_tokens: int,
                                           max_requests: int) -> int:
    """0.19's per-step bound on Mamba intermediate-state extractions: one per block of the
    token budget, at most ``MAX_INTERMEDIATE_OFFSETS_PER_REQUEST`` per request."""
    for name, value, low in (("max_tokens", max_tokens, 0),
                             ("block_size_tokens", block_size_tokens, 1),
                             ("max_requests", max_requests, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    return min(math.ceil(max_tokens / block_size_tokens),
               MAX_INTERMEDIATE_OFFSETS_PER_REQUEST * max_requests)


def _block_counts(config: Any, layers: Any, block_bytes: int,
                  speculative: int = 0) -> Tuple[int, int, float]:
    """0.19's ``(block count, paused block count, Mamba request cap)`` of this rank, before
    the ranks' MIN (module docstring); ``speculative`` (k > 0) adds the ``k + 1``
    intermediate Mamba states to a request's Mamba memory, as 0.19 does."""
    buffer_bytes = int(config.buffer_size_gb * GIB)
    paused_bytes = (0 if config.paused_buffer_size_gb is None
                    else int(config.paused_buffer_size_gb * GIB))
    mamba_bytes = layers.mamba_bytes_per_request * (speculative + 2 if speculative else 1)
    mamba_max = math.inf
    ratio = config.mamba_memory_ratio
    if ratio is not None:
        _check(layers.is_hybrid_model, f"mamba_memory_ratio={ratio} needs a hybrid model "
               "(inference_config.mamba_inference_state_config)")
        _check(0 < ratio < 1, f"mamba_memory_ratio={ratio} must lie in (0, 1)")
        mamba_max = int((buffer_bytes + paused_bytes) * ratio // mamba_bytes)
        divisor = block_bytes
    elif layers.is_hybrid_model and config.max_requests is not None:
        total = buffer_bytes + paused_bytes
        needed = config.max_requests * mamba_bytes
        _check(needed < total, f"Not enough memory for {config.max_requests} mamba requests. "
               f"Need {needed / GIB:.2f} GB for mamba states, but total buffer is "
               f"{total / GIB:.2f} GB.")
        mamba_max, ratio, divisor = config.max_requests, needed / total, block_bytes
    else:
        ratio, divisor = 0.0, block_bytes + mamba_bytes
    buffer_bytes = int(buffer_bytes * (1.0 - ratio))
    paused_bytes = int(paused_bytes * (1.0 - ratio))
    return max(2, buffer_bytes // divisor), paused_bytes // divisor, mamba_max
