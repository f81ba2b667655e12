"""The constructor's work: the arguments checked and settled, then the parts built from them.

``settle`` takes ``DynamicInferenceContext``'s keyword arguments and returns ``ContextSettings``:
Megatron-Core's plain attributes of the context (``attributes``, copied onto it) and what its
parts are built from (the layer and memory layouts, the CUDA graph ladder, the kernel backend,
prefix caching). Every check raises ``TypeError``/``ValueError`` naming the argument, the value
and the limit (``sizing``, ``compat``, ``parallel``, ``prefix_cache`` hold them), before
anything is allocated; under tensor or pipeline parallelism the block counts and the settings
that steer the bookkeeping are agreed over the ranks in the one all-reduce of
``parallel.CountAgreement``. ``build_parts`` then builds the parts (``ContextParts``), none of
which refers back to the context, nor to another in a cycle: a context is freed by reference
counting alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Optional, Tuple

import torch

from dynctx.kernels.backend import resolve_backend
from dynctx.kernels.devices import indexed_device, parse_device

from . import compat, prefix_options
from .device_state import DeviceState
from .errors import get_mem_size_str
from .forward_pass import ForwardPass
from .graph_ladder import CUDAGraphLadder, context_cuda_graph_ladder
from .inputs import check_row_moves
from .kv_cache import KVCache
from .kv_group_sizing import windowed_requests_rule
from .kv_groups import GroupSpec, build_grouped_kv, group_spec, sized_with_groups
from .kv_scales import check_kv_scales, resolve_kv_cache_dtype
from .mamba_states import MambaMetadata, MambaStates
from .offload import Offload, check_offload_args
from .parallel import CountAgreement, ParallelGroups
from .request_table import RequestTable
from .sizing import (
    LayerLayout,
    MemoryLayout,
    check_fits,
    check_metadata_types,
    check_scalars,
    config_from_model,
    layer_layout,
    memory_layout,
    positive_int,
)
from .speculative import check_speculative_tokens
from .step_builder import StepBuilder


def resolve_device(device: Any) -> torch.device:
    """``device`` as the context stores it, indexed (``kernels.devices.indexed_device``: a
    bare ``"cuda"`` is the current GPU's ``cuda:N``); None: the current CUDA device, else the
    CPU."""
    if device is None:
        return indexed_device("cuda" if torch.cuda.is_available() else "cpu")
    device = parse_device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r}: no CUDA device is available "
                           "(torch.cuda.is_available() is False); pass device='cpu'")
    return indexed_device(device)


@dataclass(frozen=True)
class ContextSettings:
    """What ``settle`` decided: ``attributes`` (name -> value, Megatron-Core's plain attributes
    of the context) and the inputs of its parts."""

    attributes: dict
    layers: LayerLayout
    memory: MemoryLayout
    ladder: CUDAGraphLadder
    backend: str
    prefix_caching: Tuple[bool, str, Optional[float]]   # enable, policy, Mamba GiB
    snapshots: int                                      # hybrid prefix snapshots (-1: none)
    # KV groups (context/kv_groups.py): the spec and each windowed group's blocks, or None.
    groups: Optional[Tuple[GroupSpec, list]] = None


def settle(*, agreement: CountAgreement, groups: ParallelGroups, default_max_tokens: int,
           request_rounder: int, params_dtype: torch.dtype, num_layers: int, kv_channels: int,
           num_attention_heads: int, max_sequence_length: int, buffer_size_gb: float,
           paused_buffer_size_gb: Optional[float], max_requests: Optional[int],
           max_tokens: Optional[int], block_size_tokens: int, cache_mla_latent: bool,
           kv_lora_rank: Optional[int], qk_pos_emb_head_dim: Optional[int],
           num_cuda_graphs: Optional[int], materialize_only_last_token_logits: Optional[bool],
           mamba_inference_state_config: Any, use_cuda_graphs_for_non_decode_steps: bool,
           use_flashinfer_fused_rope: Optional[bool], unified_memory_level: Optional[int],
           cuda_graph_max_tokens: Optional[int], cuda_graph_mixed_prefill_count: Optional[int],
           metrics_writer: Any, request_metadata_types: Any, device: Any,
           kernel_backend: Optional[str], fused_rope_kv_append: bool,
           vocab_size: Optional[int], validate: bool, enable_prefix_caching: Any,
           prefix_caching_eviction_policy: Any, prefix_caching_mamba_gb: Any,
           block_counts: Optional[Tuple[int, int]] = None,
           num_speculative_tokens: Any = 0, kv_cache_dtype: Any = None,
           kv_scales: Any = "dynamic", kv_offload_gb: Any = 0,
           kv_cache_management_mode: Any = None, kv_layer_windows: Any = None,
           kv_groups: Any = True, prefix_caching_host_tier: Any = None) -> ContextSettings:
    """Check and settle ``DynamicInferenceContext``'s arguments (``agreement``, ``groups``: the
    ranks' agreement and the parallel groups, from ``parallel.parallel_groups``;
    ``default_max_tokens``, ``request_rounder``: the class's).

    The context's arguments (keyword only, Megatron-Core's names):
        params_dtype: dtype of the KV cache.
        num_layers: layers on this pipeline stage (hybrids: ignored, the layer type list
            decides); layer numbers passed to the cache methods are this stage's, 1-based.
        tensor_model_parallel_size, pipeline_model_parallel_size, pg_collection: the
            tensor-parallel and pipeline groups: ``pg_collection.tp`` / ``.pp``, else
            Megatron-Core's ``parallel_state`` when the caller initialised it, else (tensor
            parallelism only) the default ``torch.distributed`` group of exactly
            ``tensor_model_parallel_size`` ranks (``context/parallel.py``). Every rank sizes its
            buffer to the smallest block count of its tensor and pipeline groups (one MIN
            all-reduce per group at construction, none per step), so all ranks allocate, pause
            and evict alike. ``tensor_model_parallel_size > 1`` without ``torch.distributed``
            sizes one rank's shard in one process.
        kv_channels: head dimension.
        num_attention_heads: heads the cache STORES, i.e. the KV heads (GQA query groups),
            as Megatron-Core's callers pass it; each tensor-parallel rank stores
            ``max(1, num_attention_heads // tensor_model_parallel_size)`` of them (a head is
            replicated when the ranks outnumber the KV heads; one count must divide the other).
            The MLA latent is not divided (every rank caches all of it); Mamba state shapes
            are per rank (``mamba_inference_state_config`` gives this rank's head shard).
        max_sequence_length: prompt + generated tokens of one request, at most. As in
            Megatron-Core, ``add_request`` accepts a request whose prompt +
            ``num_tokens_to_generate`` exceeds it (the engine refuses those at admission) and
            refuses only a prompt longer than it; ``update_requests`` finishes a request that
            reaches it (``max_length_finished_request_ids``). A warning says when the active
            budget cannot hold one such request.
        buffer_size_gb: GiB of KV blocks (per rank).
        paused_buffer_size_gb: GiB of the paused budget (Megatron-Core 0.16). When None:
            half of the buffer at ``unified_memory_level=0``; at level 1 a paused region as
            large as the buffer on top of it (ordinary device memory on CUDA; CPU tensors
            behave as level 0).
        max_requests: request rows; default: about one block per request.
        max_tokens: tokens of one forward pass (default ``DEFAULT_MAX_TOKENS``).
        block_size_tokens: tokens per KV block.
        cache_mla_latent, kv_lora_rank, qk_pos_emb_head_dim: MLA latent cache.
        materialize_only_last_token_logits: stored for the model (as in Megatron-Core).
        use_flashinfer_fused_rope: True: FlashInfer (error where it cannot run); None:
            FlashInfer where it can run, else ours; False: ours.
        unified_memory_level: 0 or 1 (see ``paused_buffer_size_gb``).
        mamba_inference_state_config: makes the model a hybrid: its ``layer_type_list``
            decides which layers are attention (``*``) and Mamba (``M``); every request gets a
            Mamba state slot.
        metrics_writer: any object with a wandb-style ``log(dict)``; receives the utilization
            stats after every ``update_requests``.
        request_metadata_types: ``[(label, dtype, on_device)]``; default
            ``DynamicInferenceRequest.get_metadata_types()``.
        device: where the state lives (default: the current CUDA device, else the CPU).
        kernel_backend: ``"auto"`` (Triton on CUDA, torch references on a CPU), ``"triton"``
            or ``"torch"``; None reads ``$DYNCTX_KERNEL_BACKEND``.
        fused_rope_kv_append: model adapters rotate K and append K/V in one launch.
        vocab_size: when given, token ids are checked against it: prompt tokens always (they
            are on the host), sampled tokens when ``validate`` is on.
        validate: turn on the checks that need a device read-back (sampled token ids in range,
            NaN/inf logits); off by default so that a decode step keeps its one sync.
        enable_prefix_caching, prefix_caching_eviction_policy ("ref_zero" or "lru"),
            prefix_caching_mamba_gb: prefix caching, off by default (docs/SEMANTICS.md §17).
        num_speculative_tokens: draft tokens a decode request forwards beside its pending one
            (Megatron-Core 0.19; ``< block_size_tokens``; 0: none), docs/SEMANTICS.md §19: the
            block table gets one more column, decode steps ``1 + k`` tokens a request.
        kv_cache_dtype: None (``params_dtype``), ``"fp8"`` / ``torch.float8_e4m3fn`` or
            ``torch.float8_e5m2``: the KV (or MLA latent) buffer's dtype; ``buffer_size_gb``
            counts blocks in it. Mamba states keep their own dtypes.
        kv_scales: an FP8 cache's scales: ``"dynamic"`` (per layer, from the first prefill),
            ``"dynamic_per_head"``, or given ``[2, layers(, heads)]`` (``context/kv_scales.py``,
            docs/SEMANTICS.md §20).
        kv_offload_gb: GiB of host memory for KV offload (0, the default: none): evicted
            requests keep their blocks there and resume without recompute
            (``context/offload.py``, docs/SEMANTICS.md §21).
        kv_cache_management_mode: what a suspend does with the KV cache (0.19's enum or its
            value; None: ``"recompute"``, the context's tensors freed and the requests
            recomputed); ``"offload"`` keeps the requests' KV in host memory (with
            ``kv_offload_gb=0`` a host pool as large as the device's blocks and Mamba
            states); ``"persist"``: the engine's suspend keeps the context.
        prefix_caching_host_tier: the prefix cache's cached blocks spill to the host pool
            (``context/host_tier.py``); None: with prefix caching and ``kv_offload_gb > 0``.
        kv_layer_windows: each attention layer's sliding window (an int >= 1: the keys a query
            sees, its own included) or None (a full layer), in the layers' order; with windowed
            and full layers and ``kv_groups`` (default True), one KV group per distinct window,
            whose windowed groups free the blocks their window no longer reads
            (``context/kv_groups.py``, docs/SEMANTICS.md §22); None: one group.
        kv_groups: False keeps one group (every block of every layer) whatever the windows.
        The options of ``compat.OPTIONS`` are Megatron-Core's and raise or warn as listed there.
    ``block_counts``: this rank's ``(blocks, paused blocks)`` as Megatron-Core 0.19's form
    derives them (``megatron019.constructor_arguments``), instead of the buffer's division.
    """
    args = check_scalars(
        params_dtype=params_dtype, num_layers=num_layers, kv_channels=kv_channels,
        num_attention_heads=num_attention_heads, max_sequence_length=max_sequence_length,
        block_size_tokens=block_size_tokens, buffer_size_gb=buffer_size_gb,
        paused_buffer_size_gb=paused_buffer_size_gb, tensor_model_parallel_size=groups.tp,
        unified_memory_level=unified_memory_level, cache_mla_latent=cache_mla_latent,
        kv_lora_rank=kv_lora_rank, qk_pos_emb_head_dim=qk_pos_emb_head_dim, validate=validate,
        fused_rope_kv_append=fused_rope_kv_append, kernel_backend=kernel_backend,
        use_flashinfer_fused_rope=use_flashinfer_fused_rope, metrics_writer=metrics_writer,
        use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
        materialize_only_last_token_logits=materialize_only_last_token_logits)
    compat.check_options(dict(cuda_graph_max_tokens=cuda_graph_max_tokens), stacklevel=5)
    speculative = check_speculative_tokens(num_speculative_tokens, args["block_size_tokens"])
    offload_gb, management_mode, host_tier = check_offload_args(
        kv_offload_gb, kv_cache_management_mode, host_tier=prefix_caching_host_tier,
        enable_prefix_caching=enable_prefix_caching)
    prefix_caching = prefix_options.check_prefix_caching_args(
        enable_prefix_caching, prefix_caching_eviction_policy, prefix_caching_mamba_gb)
    device = resolve_device(device)
    backend = resolve_backend(kernel_backend, device)
    if use_flashinfer_fused_rope is True:
        from dynctx.kernels.rope_flashinfer import flashinfer_rope_available

        if not flashinfer_rope_available(device):
            raise RuntimeError(
                "use_flashinfer_fused_rope=True needs flashinfer and a CUDA device; "
                "pass None (FlashInfer where it can run, else ours) or False")
    types = check_metadata_types(request_metadata_types)
    vocab_size = None if vocab_size is None else positive_int("vocab_size", vocab_size)
    tp = args["tp"]
    layers = layer_layout(args["num_layers"], mamba_inference_state_config, params_dtype)
    # KV heads per rank; a rank holds one (replicated) head when tp exceeds them.
    heads_per_partition = max(1, args["num_attention_heads"] // tp)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, params_dtype)
    # (The MLA latent has one scale per layer for each of its two parts.)
    scale_spec = check_kv_scales(kv_scales, kv_dtype, layers.num_attention_layers,
                                 1 if cache_mla_latent else heads_per_partition,
                                 bool(cache_mla_latent))

    kv_spec = group_spec(kv_layer_windows, kv_groups,
                         num_attention_layers=layers.num_attention_layers,
                         max_sequence_length=args["max_sequence_length"],
                         speculative=speculative,
                         mla=bool(cache_mla_latent),
                         hybrid=layers.is_hybrid_model)
    host_tier = prefix_options.host_tier_with_groups(host_tier, prefix_caching_host_tier,
                                                     kv_spec, kv_layer_windows)
    # The settings that steer the bookkeeping agree over the ranks, and the hybrid prefix
    # cache's snapshot count is reduced with the block counts (one all-reduce).
    agreement.extra = [prefix_options.prefix_snapshot_count(prefix_caching, layers)]
    agreement.same = dict(
        zip(("enable_prefix_caching", "prefix_caching_eviction_policy"), prefix_caching),
        num_cuda_graphs=num_cuda_graphs, validate=bool(validate), vocab_size=vocab_size,
        num_speculative_tokens=speculative,
        kv_groups=None if kv_spec is None else repr((kv_spec.windows, kv_spec.layers)),
        use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
        cuda_graph_mixed_prefill_count=cuda_graph_mixed_prefill_count)
    # With KV groups, group 0 takes the bytes the windowed groups leave (context/kv_groups.py).
    memory, windowed_blocks = sized_with_groups(kv_spec, lambda: memory_layout(
        layers=layers, kv_dtype=kv_dtype, block_size_tokens=args["block_size_tokens"],
        heads_per_partition=heads_per_partition, kv_channels=args["kv_channels"],
        cache_mla_latent=bool(cache_mla_latent), kv_lora_rank=args["kv_lora_rank"],
        qk_pos_emb_head_dim=args["qk_pos_emb_head_dim"],
        unified_memory_level=unified_memory_level, device=device,
        buffer_size_gb=buffer_size_gb, paused_buffer_size_gb=paused_buffer_size_gb,
        max_requests=max_requests, max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        max_sequence_length=args["max_sequence_length"], tp=tp,
        request_rounder=request_rounder, reduce_counts=agreement if groups.groups else None,
        block_counts=block_counts, derive_requests=None if max_requests is not None else
        windowed_requests_rule(kv_spec, block_size=args["block_size_tokens"],
                               max_tokens=max_tokens or default_max_tokens)),
        max_sequence_length=args["max_sequence_length"], block_size=args["block_size_tokens"],
        attention_layers=layers.num_attention_layers)
    if speculative:
        # 0.19: a block taken early may lie one past what max_sequence_length needs.
        memory = replace(memory, max_kv_block_count=memory.max_kv_block_count + 1)
    # CUDA graph batch dimensions: Megatron's ladder (context/graph_ladder.py).
    ladder = context_cuda_graph_ladder(
        num_cuda_graphs=num_cuda_graphs, max_requests=memory.max_requests,
        max_tokens=memory.max_tokens, max_sequence_length=args["max_sequence_length"],
        tp_size=tp, use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
        cuda_graph_mixed_prefill_count=cuda_graph_mixed_prefill_count,
        tokens_per_decode=1 + speculative)

    attributes = dict(
        device=device, kernel_backend=kernel_backend, request_metadata_types=types,
        params_dtype=params_dtype, kv_cache_dtype=kv_dtype, kv_scales_spec=scale_spec,
        num_layers=args["num_layers"],
        layer_map=layers.layer_map, num_attention_layers=layers.num_attention_layers,
        num_mamba_layers=layers.num_mamba_layers, is_hybrid_model=layers.is_hybrid_model,
        mamba_conv_states_shape=layers.mamba_conv_states_shape,
        mamba_ssm_states_shape=layers.mamba_ssm_states_shape,
        mamba_bytes_per_request=layers.mamba_bytes_per_request,
        layer_types=list(layers.layer_types),
        pipeline_model_parallel_size=groups.pp, pipeline_parallel_group=groups.pp_group,
        tensor_parallel_group=groups.tp_group, kv_channels=args["kv_channels"],
        hidden_size_per_attention_head=args["kv_channels"],
        num_attention_heads=args["num_attention_heads"], tensor_model_parallel_size=tp,
        num_attention_heads_per_partition=heads_per_partition,
        max_sequence_length=args["max_sequence_length"],
        block_size_tokens=args["block_size_tokens"], cache_mla_latent=bool(cache_mla_latent),
        kv_lora_rank=args["kv_lora_rank"], qk_pos_emb_head_dim=args["qk_pos_emb_head_dim"],
        materialize_only_last_token_logits=materialize_only_last_token_logits,
        use_flashinfer_fused_rope=use_flashinfer_fused_rope,
        use_cuda_graphs_for_non_decode_steps=use_cuda_graphs_for_non_decode_steps,
        cuda_graph_mixed_prefill_count=cuda_graph_mixed_prefill_count,
        metrics_writer=metrics_writer, fused_rope_kv_append=bool(fused_rope_kv_append),
        vocab_size=vocab_size, validate=bool(validate), num_speculative_tokens=speculative,
        kv_offload_gb=offload_gb, kv_cache_management_mode=management_mode,
        prefix_caching_host_tier=host_tier, enable_prefix_caching=prefix_caching[0],
        prefix_caching_eviction_policy=prefix_caching[1],
        prefix_caching_mamba_gb=prefix_caching[2], kv_groups=kv_spec is not None,
        kv_layer_windows=None if kv_layer_windows is None else list(kv_layer_windows),
        block_size_bytes=memory.block_size_bytes, kv_reduced_dim=memory.kv_reduced_dim,
        unified_memory_level=memory.unified_memory_level, buffer_size_gb=buffer_size_gb,
        paused_buffer_size_gb=paused_buffer_size_gb, max_tokens=memory.max_tokens,
        max_kv_block_count=memory.max_kv_block_count, num_cuda_graphs=num_cuda_graphs,
        cuda_graph_batch_dimensions_list=list(ladder.cuda_graph_batch_dimensions_list),
        cuda_graph_token_counts=(None if ladder.cuda_graph_token_counts is None
                                 else list(ladder.cuda_graph_token_counts)))
    if layers.is_hybrid_model:
        attributes.update(mamba_conv_states_dtype=layers.mamba_conv_states_dtype,
                          mamba_ssm_states_dtype=layers.mamba_ssm_states_dtype)
    return ContextSettings(attributes, layers, memory, ladder, backend, prefix_caching,
                           agreement.extra[0],
                           None if kv_spec is None else (kv_spec, windowed_blocks))


class ContextParts(NamedTuple):
    """The parts of one context (``mamba``, ``mamba_metadata``: None unless a hybrid), and
    what they do together: allocate, release (suspend) and reset."""

    table: RequestTable
    device: DeviceState
    kv: KVCache
    steps: StepBuilder
    forward: ForwardPass
    mamba: Optional[MambaStates]
    mamba_metadata: Optional[MambaMetadata]
    asks: tuple = ()    # ((the arguments that ask, device bytes), ...): sizing.check_fits
    offload: Optional[Offload] = None   # KV offload's host copies (kv_offload_gb > 0)

    def allocate(self) -> None:
        """Every tensor, then the request table's host rows over the arena (empty); first of
        all, a device without room for them is refused (``sizing.check_fits``)."""
        check_fits(self.device.device, list(self.asks))
        self.device.allocate()
        self.kv.allocate()
        if self.mamba is not None:
            self.mamba.allocate()
        if self.offload is not None:
            self.offload.allocate()
        self.table.bind(*self.device.table_views())

    def release(self) -> None:
        """Drop every tensor and the requests in flight (suspend); in OFFLOAD mode their KV
        (and Mamba states) go to the host first, for their re-adds after the resume."""
        if self.offload is not None:
            if self.offload.mode == "offload":
                self.offload.save_all(self.table)
            self.offload.release()
        self.device.release()
        self.kv.release()
        if self.mamba is not None:
            self.mamba.release()
        self.table.unbind()
        self.forward.reset_attention_state()
        self.forward.step = self.steps.prepared = None

    def reset(self, keep_cache: bool = False) -> None:
        """Every row, block and slot free; the step forgotten (the KV bytes are kept);
        ``keep_cache``: the allocator and the prefix cache kept (``RequestTable.reset``)."""
        self.steps.prepared = None
        if self.offload is not None:
            self.offload.reset(keep_cache)
        self.table.reset(keep_cache)
        self.device.reset()
        if self.forward.kv_groups is not None:
            self.forward.kv_groups.settle(self.table)
        self.forward.reset_attention_state()
        self.forward.step = None

    def kv_offload_stats(self) -> dict:
        """KV offload's counters and the host pool's free blocks (``Offload.stats_dict``);
        empty without offload."""
        return {} if self.offload is None else self.offload.stats_dict()

    def commit_add(self, plan) -> None:
        """``RequestTable.commit_add``, then KV offload's restore of a saved request."""
        self.table.commit_add(plan)
        if self.offload is not None and not plan.is_continuation:
            self.offload.commit_add(self.table, plan)

    def set_host_views(self, value: bool) -> None:
        self.device.set_host_views(value)
        self.steps.prepared = None

    def move_rows(self, src_idxs: Any, dst_idxs: Any, next_tokens: Any, swap: bool,
                  new_speculative_tokens: Any = None) -> None:
        """Megatron-Core's row helpers: rows ``dst_idxs`` take (``swap``: exchange) the
        bookkeeping of rows ``src_idxs`` (checked first: ``inputs.check_row_moves``): the
        fields, metadata, block-table rows and pending tokens, and ``next_tokens[dst] =
        next_tokens[src]`` on the tensor given (None: ours only), and so the columns of
        ``new_speculative_tokens`` (0.19's ``[k, rows]``)."""
        self.device.check_allocated()
        dst, src = check_row_moves(src_idxs, dst_idxs, next_tokens, swap,
                                   self.table.max_requests, new_speculative_tokens)
        self.table.permute_rows(dst, src)
        self.device.permute_pending(dst, src, next_tokens, new_speculative_tokens)


def build_parts(settings: ContextSettings) -> ContextParts:
    """The parts of a context of ``settings`` (nothing allocated yet: ``allocate`` each)."""
    attrs, layers, memory = settings.attributes, settings.layers, settings.memory
    rows, tokens, device = memory.max_requests, memory.max_tokens, attrs["device"]
    enable, policy, mamba_gb = settings.prefix_caching
    mamba = None
    if layers.is_hybrid_model:
        if enable:
            prefix_options.warn_without_snapshots(settings.snapshots, mamba_gb,
                                                  layers.mamba_bytes_per_request)
        mamba = MambaStates(layers, max_requests=rows, max_tokens=tokens, device=device,
                            kernel_backend=attrs["kernel_backend"],
                            snapshot_count=settings.snapshots,
                            speculative=attrs["num_speculative_tokens"])
    table = RequestTable(
        total_blocks=memory.total_blocks, paused_blocks=memory.paused_blocks, max_requests=rows,
        max_kv_block_count=memory.max_kv_block_count, block_size=attrs["block_size_tokens"],
        max_tokens=tokens, metadata_labels=[label for label, _, _ in
                                            attrs["request_metadata_types"]],
        hybrid=layers.is_hybrid_model, slots=None if mamba is None else mamba.slots,
        prefix_caching=policy if enable else None,
        snapshots=None if mamba is None else mamba.snapshots, budget_advice=memory.advice,
        speculative=attrs["num_speculative_tokens"])
    state = DeviceState(device=device, backend=settings.backend, max_requests=rows,
                        max_tokens=tokens, max_kv_block_count=memory.max_kv_block_count,
                        metadata_types=attrs["request_metadata_types"],
                        hybrid=layers.is_hybrid_model,
                        speculative=attrs["num_speculative_tokens"])
    mla = attrs["cache_mla_latent"]
    cache = dict(heads=attrs["num_attention_heads_per_partition"], head_dim=attrs["kv_channels"],
                 dtype=attrs["params_dtype"], device=device, backend=settings.backend,
                 kernel_backend=attrs["kernel_backend"],
                 mla=(attrs["kv_lora_rank"], attrs["qk_pos_emb_head_dim"]) if mla else None,
                 kv_dtype=attrs["kv_cache_dtype"], scales=attrs["kv_scales_spec"])
    if settings.groups is None:
        kv = KVCache(layers=layers.num_attention_layers, total_blocks=memory.total_blocks,
                     block_size=attrs["block_size_tokens"], **cache)
    else:
        spec, windowed_blocks = settings.groups
        kv = build_grouped_kv(spec, main_blocks=memory.total_blocks,
                              windowed_blocks=windowed_blocks,
                              block_size=attrs["block_size_tokens"], max_requests=rows,
                              columns=memory.max_kv_block_count, max_tokens=tokens, **cache)
        kv.allocator = table.allocator
        if table.prefix_cache is not None:
            table.prefix_cache.window_reads = kv.hit_blocks
    steps = StepBuilder(rows, settings.ladder,
                        tokens_per_decode=1 + attrs["num_speculative_tokens"])
    # Megatron-Core builds it with the context; its step fields are filled per step.
    metadata = None if mamba is None else MambaMetadata(mamba, table, state)
    forward = ForwardPass(table=table, device=state, steps=steps, kv=kv, layers=layers,
                          settings=attrs, mamba=mamba, mamba_metadata=metadata,
                          kv_groups=None if settings.groups is None else kv)
    table.offload = offload = Offload.build(
        kv_offload_gb=attrs["kv_offload_gb"], mode=attrs["kv_cache_management_mode"], kv=kv,
        mamba=mamba, block_size=attrs["block_size_tokens"], max_requests=rows, device=device,
        table=table if attrs["prefix_caching_host_tier"] else None)
    return ContextParts(table, state, kv, steps, forward, mamba, metadata,
                        _asks(attrs, memory, state, kv, mamba), offload)


def _asks(attrs: dict, memory: MemoryLayout, state: DeviceState, kv: KVCache,
          mamba: Optional[MambaStates]) -> tuple:
    """What the parts will allocate on the device, each named by the arguments that size it."""
    sized_by = [f"buffer_size_gb={attrs['buffer_size_gb']}"]
    if attrs["paused_buffer_size_gb"] is not None:
        sized_by.append(f"paused_buffer_size_gb={attrs['paused_buffer_size_gb']}")
    if memory.unified_memory_level == 1:
        sized_by.append("unified_memory_level=1")
    asks = [(f"KV blocks, {memory.total_blocks} of {get_mem_size_str(memory.block_size_bytes)} "
             f"({', '.join(sized_by)})", kv.nbytes())]
    if mamba is not None:
        snapshots = "" if mamba.snapshots is None else \
            f" and prefix_caching_mamba_gb={attrs['prefix_caching_mamba_gb']}"
        asks.append((f"Mamba states (max_requests={memory.max_requests}{snapshots})",
                     mamba.nbytes()))
    asks.append((f"bookkeeping (max_requests={memory.max_requests}, max_tokens="
                 f"{memory.max_tokens}, max_sequence_length={attrs['max_sequence_length']})",
                 state.nbytes()))
    return tuple(asks)


def from_config(cls, inference_config: Any, model: Any, max_batch_size: int,
                buffer_size_gb: float = 40, num_cuda_graphs: Optional[int] = None,
                mamba_inference_state_config: Any = None, unified_memory_level: int = 0,
                **kwargs: Any):
    """``DynamicInferenceContext.from_config``: a context from plain configs
    (``sizing.config_from_model`` says what it reads); extra keyword arguments go to the
    constructor."""
    return cls(**config_from_model(inference_config, model, max_batch_size),
               buffer_size_gb=buffer_size_gb, num_cuda_graphs=num_cuda_graphs,
               materialize_only_last_token_logits=False,
               mamba_inference_state_config=mamba_inference_state_config,
               use_flashinfer_fused_rope=None, unified_memory_level=unified_memory_level,
               **kwargs)
