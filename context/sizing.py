"""What the constructor decides before anything is allocated: the layer layout and the sizes.

``layer_layout`` reads the layer types (attention, Mamba, MLP, MoE) and the Mamba state shapes;
``memory_layout`` turns ``buffer_size_gb`` and friends into block, request, token and block-table
counts (docs/DESIGN.md, the memory model's one rule). Both are pure and raise ``ValueError``
naming the argument, the value and the limit; nothing here allocates.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

from dynctx.kernels.backend import check_backend_name

from ._fields import _LAYER_SYMBOLS
from .batch_dimensions import MambaInferenceStateConfig
from .errors import get_mem_size_str

GIB = 1024 ** 3
# One host block table (int32 rows x columns) may take at most this many bytes; the context
# keeps four such tables (host, two device copies, the step's attention copy).
MAX_BLOCK_TABLE_BYTES = 1 * GIB


def caller_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that names
    the first frame outside dynctx (the user's line that built the context), however deep in
    dynctx the warning is made."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("dynctx."):
        frame, level = frame.f_back, level + 1
    return level

def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


@dataclass(frozen=True)
class LayerLayout:
    """Layer bookkeeping: ``layer_types`` (``*`` attention, ``M`` Mamba, ``-`` MLP, ``E`` MoE),
    ``layer_map`` (global 0-based index -> index within its type) and the Mamba state shapes."""

    layer_types: tuple
    layer_map: dict
    num_attention_layers: int
    num_mamba_layers: int
    is_hybrid_model: bool
    mamba_conv_states_shape: Optional[tuple] = None
    mamba_ssm_states_shape: Optional[tuple] = None
    mamba_conv_states_dtype: Optional[torch.dtype] = None
    mamba_ssm_states_dtype: Optional[torch.dtype] = None
    mamba_bytes_per_request: int = 0

    def index(self, layer_number: int, kind: str = "*") -> int:
        """Index within its type of a 1-based layer number of this stage, checked to be of
        ``kind`` (``*`` attention, ``M`` Mamba)."""
        layers = len(self.layer_types)
        if isinstance(layer_number, bool) or not isinstance(layer_number, (int, np.integer)) \
                or not 1 <= layer_number <= layers:
            raise ValueError(f"layer_number={layer_number!r} must be an int in [1, {layers}] "
                             "(1-based, local to this stage)")
        actual = self.layer_types[int(layer_number) - 1]
        if actual != kind:
            raise ValueError(f"layer_number={layer_number} is a {_LAYER_SYMBOLS[actual]} layer, "
                             f"not a {_LAYER_SYMBOLS[kind]} layer")
        return self.layer_map[int(layer_number) - 1]


def check_metadata_types(types: Any) -> list:
    """``request_metadata_types`` as a list of ``(label, dtype, on_device)`` (None: the
    request's defaults), each label a ``SamplingParams`` field and each dtype one a host arena
    holds; ``TypeError``/``ValueError`` naming the entry otherwise."""
    from .requests import DynamicInferenceRequest, SamplingParams
    from .staging import numpy_dtype

    if types is None:
        return DynamicInferenceRequest.get_metadata_types()
    if isinstance(types, (str, bytes)) or not hasattr(types, "__iter__"):
        raise TypeError(f"request_metadata_types={types!r} must be a list of (label, "
                        "torch.dtype, on_device) tuples")
    types = list(types)
    fields = vars(SamplingParams())
    for i, entry in enumerate(types):
        name = f"request_metadata_types[{i}]={entry!r}"
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise TypeError(f"{name} must be a (label, torch.dtype, on_device) tuple")
        label, dtype, on_device = entry
        if not isinstance(label, str) or label not in fields:
            raise ValueError(f"{name}: the label must name a SamplingParams field")
        if not isinstance(dtype, torch.dtype) or not isinstance(on_device, (bool, np.bool_)):
            raise TypeError(f"{name}: give a torch.dtype and a bool")
        numpy_dtype(dtype)
    return types


def layer_layout(num_layers: int, mamba: Optional[MambaInferenceStateConfig],
                 params_dtype: torch.dtype) -> LayerLayout:
    if mamba is not None and not isinstance(mamba, MambaInferenceStateConfig):
        raise TypeError(f"mamba_inference_state_config must be a MambaInferenceStateConfig or "
                        f"None, got {type(mamba).__name__}")
    if mamba is None:
        layer_types = ["*"] * num_layers
        conv_shape = ssm_shape = conv_dtype = ssm_dtype = None
    else:
        layer_types = list(mamba.layer_type_list)
        unknown = set(layer_types) - set(_LAYER_SYMBOLS)
        if unknown:
            raise ValueError(f"mamba_inference_state_config.layer_type_list has unknown "
                             f"symbols {sorted(unknown)}; known: {_LAYER_SYMBOLS}")
        shapes = []
        for name in ("mamba_conv_states_shape", "mamba_ssm_states_shape"):
            shape = getattr(mamba, name)
            if shape is None or not len(shape) or not all(
                    isinstance(d, (int, np.integer)) and d > 0 for d in shape):
                raise ValueError(f"mamba_inference_state_config.{name}={shape!r} must be a "
                                 "tuple of positive ints")
            shapes.append(tuple(int(d) for d in shape))
        conv_shape, ssm_shape = shapes
        for name in ("conv_states_dtype", "ssm_states_dtype"):
            value = getattr(mamba, name, None)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"mamba_inference_state_config.{name}={value!r} must be a "
                                "torch.dtype or None (params_dtype)")
        chunk = getattr(mamba, "mamba_chunk_size", 128)
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ValueError(f"mamba_inference_state_config.mamba_chunk_size={chunk!r} must be "
                             "an int >= 1")
        conv_dtype = getattr(mamba, "conv_states_dtype", None) or params_dtype
        ssm_dtype = getattr(mamba, "ssm_states_dtype", None) or params_dtype
    attention = [i for i, t in enumerate(layer_types) if t == "*"]
    mamba_layers = [i for i, t in enumerate(layer_types) if t == "M"]
    if not attention:
        raise NotImplementedError("a model without attention layers has no KV cache: "
                                  "layer_type_list needs at least one '*'")
    layer_map = {g: local for local, g in enumerate(attention)}
    layer_map.update({g: local for local, g in enumerate(mamba_layers)})
    mamba_bytes = 0
    if mamba is not None:
        conv_item = torch.empty((), dtype=conv_dtype).element_size()
        ssm_item = torch.empty((), dtype=ssm_dtype).element_size()
        mamba_bytes = len(mamba_layers) * (conv_item * math.prod(conv_shape)
                                           + ssm_item * math.prod(ssm_shape))
    return LayerLayout(tuple(layer_types), layer_map, len(attention), len(mamba_layers),
                       mamba is not None, conv_shape, ssm_shape, conv_dtype, ssm_dtype,
                       mamba_bytes)


def gib_at_least(n_bytes: float) -> float:
    """The smallest 4-digit GiB value whose ``int(value * GIB)`` holds ``n_bytes``."""
    value = n_bytes / GIB
    scale = 10.0 ** (3 - math.floor(math.log10(value)))
    value = math.ceil(value * scale) / scale
    while int(value * GIB) < n_bytes:
        value += 1 / scale
    return float(f"{value:.4g}")


def gib_at_most(n_bytes: float) -> float:
    """The largest 4-digit GiB value not above ``n_bytes``."""
    if n_bytes <= 0:
        return 0.0
    value = n_bytes / GIB
    scale = 10.0 ** (3 - math.floor(math.log10(value)))
    return float(f"{math.floor(value * scale) / scale:.4g}")


@dataclass(frozen=True)
class MemoryLayout:
    """Counts the context is sized by, and the arguments they came from (``advice``)."""

    block_size_bytes: int
    kv_reduced_dim: Optional[int]
    unified_memory_level: int
    total_blocks: int
    paused_blocks: int
    max_requests: int
    max_tokens: int
    max_kv_block_count: int
    bytes_per_block: int = 0
    buffer_blocks: int = 0           # the blocks of buffer_size_gb
    paused_buffer_size_gb: Optional[float] = None

    def advice(self, more_blocks: int) -> str:
        """Which argument gives the active budget ``more_blocks`` more blocks, and its value:
        ``buffer_size_gb``, or (at level 0, where the paused budget is part of the buffer) a
        smaller ``paused_buffer_size_gb``."""
        active = self.total_blocks - self.paused_blocks - 1 + more_blocks
        unit = get_mem_size_str(self.bytes_per_block)
        if self.paused_buffer_size_gb is None:
            # The active budget is half the buffer (level 0), or the buffer less one block.
            blocks = 2 * active + 1 if self.unified_memory_level == 0 else active + 1
            least = gib_at_least(blocks * self.bytes_per_block)
            text = (f"raise buffer_size_gb to at least {least} ({blocks} blocks of {unit}; with "
                    "paused_buffer_size_gb=None half of them are the paused budget)")
            if self.unified_memory_level == 0 and self.buffer_blocks - 1 - active >= 0:
                paused = (self.buffer_blocks - 1 - active) * self.bytes_per_block
                text += f", or pass paused_buffer_size_gb={gib_at_most(paused)} (or less)"
            return text
        least = gib_at_least((self.buffer_blocks + more_blocks) * self.bytes_per_block)
        text = (f"raise buffer_size_gb to at least {least} ({more_blocks} more blocks of "
                f"{unit})")
        if self.unified_memory_level == 0 and self.paused_blocks >= more_blocks:
            paused = (self.paused_blocks - more_blocks) * self.bytes_per_block
            text += f", or lower paused_buffer_size_gb to at most {gib_at_most(paused)}"
        return text


_level1_warned = False


def _warn_level1_once(paused_bytes: int) -> None:
    """``unified_memory_level=1`` is Megatron-Core's default; say once per process what it means
    here and how to choose."""
    global _level1_warned
    if _level1_warned:
        return
    _level1_warned = True
    warnings.warn(
        "unified_memory_level=1 (Megatron-Core's default) puts the paused region in CUDA "
        "managed memory, which dynctx does not use: the paused region "
        f"({get_mem_size_str(paused_bytes)}) is ordinary device memory allocated on top of "
        "buffer_size_gb. Pass unified_memory_level=0 to keep paused requests inside "
        "buffer_size_gb, or paused_buffer_size_gb to size the paused region yourself. "
        "(Shown once per process.)", stacklevel=caller_stacklevel())


def memory_layout(*, layers: LayerLayout, kv_dtype: torch.dtype, block_size_tokens: int,
                  heads_per_partition: int, kv_channels: int, cache_mla_latent: bool,
                  kv_lora_rank: Optional[int], qk_pos_emb_head_dim: Optional[int],
                  unified_memory_level: Optional[int], device: torch.device,
                  buffer_size_gb: float, paused_buffer_size_gb: Optional[float],
                  max_requests: Optional[int], max_tokens: Optional[int], default_max_tokens: int,
                  max_sequence_length: int, tp: int, request_rounder: int,
                  reduce_counts: Optional[Callable[[list, dict], list]] = None,
                  block_counts: Optional[Tuple[int, int]] = None,
                  derive_requests: Optional[Callable[[int], int]] = None) -> MemoryLayout:
    """The block, request, token and block-table counts of the constructor's arguments.

    ``reduce_counts(counts, same)`` (tensor or pipeline parallelism) maps this rank's
    ``[block count, paused block count]`` to the ones every rank uses (the minimum over the
    tensor and pipeline groups; Megatron-Core reduces the block count over the pipeline), and
    checks that the values of ``same`` (the explicit ``max_requests``, ``max_tokens``, ...) are
    equal on every rank, so that all ranks allocate, pause and evict alike. ``block_counts``
    ``(blocks, paused blocks)``: this rank's counts as a caller derived them (Megatron-Core
    0.19's form: ``context/megatron019.py``), instead of the buffer sizes' division. Blocks are
    sized in ``kv_dtype``, the cache's (an FP8 cache's blocks take half the bytes of bf16's).
    ``derive_requests(blocks)``: the ``max_requests`` to derive when it is not given (before
    rounding; default: one request per block, the dummy excepted), as KV groups whose every
    layer is windowed derive it (``kv_group_sizing.windowed_requests_rule``)."""
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    kv_reduced_dim = None
    if cache_mla_latent:
        kv_reduced_dim = kv_lora_rank + qk_pos_emb_head_dim
        block_size_bytes = (itemsize * layers.num_attention_layers * block_size_tokens
                            * kv_reduced_dim)
    else:
        block_size_bytes = (itemsize * 2 * layers.num_attention_layers * block_size_tokens
                            * heads_per_partition * kv_channels)
    level = 0 if unified_memory_level is None else unified_memory_level
    if level == 1 and device.type != "cuda":
        level = 0  # CPU tensors behave as level 0.
    buffer_bytes = int(buffer_size_gb * GIB)
    # Hybrids budget one request's Mamba state per block (as the reference does).
    bytes_per_block = block_size_bytes + layers.mamba_bytes_per_request
    block_count = buffer_bytes // bytes_per_block
    paused_count = (None if paused_buffer_size_gb is None
                    else int(paused_buffer_size_gb * GIB) // bytes_per_block)
    if block_counts is not None:
        block_count, paused_count = block_counts
    if reduce_counts is not None:
        same = dict(max_requests=-1 if max_requests is None else max_requests,
                    max_tokens=max_tokens or default_max_tokens,
                    block_size_tokens=block_size_tokens,
                    max_sequence_length=max_sequence_length, unified_memory_level=level,
                    paused_buffer_size_gb_given=int(paused_buffer_size_gb is not None))
        block_count, reduced_paused = reduce_counts(
            [block_count, -1 if paused_count is None else paused_count], same)
        paused_count = None if paused_count is None else reduced_paused
    if block_count < 2:
        warnings.warn(
            f"buffer_size_gb={buffer_size_gb} ({get_mem_size_str(buffer_bytes)}) holds "
            f"{block_count} block(s) of {get_mem_size_str(bytes_per_block)}; the context needs "
            "at least 2 (one is the dummy block that padding tokens write into), so it uses 2 "
            f"({get_mem_size_str(2 * bytes_per_block)}): raise buffer_size_gb to size it "
            "yourself", stacklevel=caller_stacklevel())
        block_count = 2
    if paused_count is not None:
        total_count = block_count + paused_count if level == 1 else block_count
    else:
        blocks = 2 * block_count if level == 1 else block_count
        active = max(1, (blocks - 1) // 2)
        paused_count = active
        total_count = 2 * active + 1
    active_count = total_count - paused_count - 1
    if active_count < 1:
        raise ValueError(
            f"paused_buffer_size_gb={paused_buffer_size_gb} leaves no active blocks: "
            f"{total_count} blocks in all, {paused_count} paused (block of "
            f"{get_mem_size_str(block_size_bytes)})")
    blocks_per_request = math.ceil(max_sequence_length / block_size_tokens)
    if active_count < blocks_per_request:
        # Refusing would break callers that size a context for short requests only; the
        # update refuses (before any change) the step where no request can run.
        warnings.warn(
            f"max_sequence_length={max_sequence_length} needs {blocks_per_request} blocks of "
            f"{block_size_tokens} tokens for one request, but the active budget holds "
            f"{active_count} ({get_mem_size_str(active_count * block_size_bytes)} of "
            f"buffer_size_gb={buffer_size_gb}; the paused budget is {paused_count} blocks): a "
            "long request may pause with no way to resume, and update_requests then raises "
            "'no request can run'. Raise buffer_size_gb (or lower paused_buffer_size_gb), or "
            "lower max_sequence_length", stacklevel=caller_stacklevel())
    if level == 1:
        _warn_level1_once(paused_count * bytes_per_block)

    derived = max_requests is None
    if derived:
        value = total_count - 1 if derive_requests is None else derive_requests(total_count)
        value -= value % tp
        value -= value % request_rounder
        max_requests = max(value, tp)
    max_requests = positive_int("max_requests", max_requests)
    if max_requests % tp:
        raise ValueError(f"max_requests={max_requests} must be divisible by "
                         f"tensor_model_parallel_size={tp} (each rank holds an equal share of "
                         "the decode requests, as Megatron-Core's sequence-parallel layers "
                         "need)")
    max_tokens = positive_int("max_tokens", max_tokens or default_max_tokens)
    if max_tokens < max_requests:
        how = (f" (max_requests was derived from buffer_size_gb: one request per block, "
               f"{total_count - 1} blocks; pass max_requests=<= {max_tokens} to set it)"
               if derived else "")
        raise ValueError(f"max_tokens={max_tokens} must be >= max_requests={max_requests} "
                         f"(every request needs a token slot at decode){how}")
    # No request can hold more blocks than the buffer has: the table is never wider.
    columns = min(blocks_per_request, total_count - 1)
    table_bytes = 4 * max_requests * columns
    if table_bytes > MAX_BLOCK_TABLE_BYTES:
        raise ValueError(
            f"the block table of max_requests={max_requests} x {columns} blocks "
            f"(max_sequence_length={max_sequence_length} / block_size_tokens="
            f"{block_size_tokens}, at most the {total_count - 1} blocks of the buffer) needs "
            f"{get_mem_size_str(table_bytes)} per copy (four copies), "
            f"over the limit of {get_mem_size_str(MAX_BLOCK_TABLE_BYTES)}: lower max_requests or "
            "max_sequence_length, or raise block_size_tokens")
    return MemoryLayout(block_size_bytes, kv_reduced_dim, level, total_count, paused_count,
                        max_requests, max_tokens, columns, bytes_per_block, block_count,
                        paused_buffer_size_gb)


def available_bytes(device: torch.device) -> Optional[int]:
    """What ``device`` can still give: on CUDA ``torch.cuda.mem_get_info``'s free bytes plus
    what torch's caching allocator holds unused; on a CPU the available memory (Linux's
    ``MemAvailable``, else the free pages); None when it cannot be known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(device: torch.device, asks: list) -> None:
    """Refuse, before anything is allocated, tensors that ``device`` cannot hold: ``asks`` is
    ``[(the arguments that ask, bytes)]``; ``ValueError`` naming each and what ``device`` has
    (instead of the allocator's message once part of the context is built)."""
    need = sum(n_bytes for _, n_bytes in asks)
    have = available_bytes(device)
    if have is None or need <= have:
        return
    shares = "; ".join(f"{what}: {get_mem_size_str(n_bytes)}" for what, n_bytes in asks
                       if n_bytes)
    raise ValueError(f"the context needs {get_mem_size_str(need)} on {device} ({shares}), but "
                     f"{device} has {get_mem_size_str(have)} available: lower the largest "
                     "(buffer_size_gb sizes the KV blocks)")


def config_from_model(inference_config: Any, model: Any, max_batch_size: int) -> dict:
    """The constructor arguments ``DynamicInferenceContext.from_config`` reads from configs.

    Reads ``model.config`` (or ``model`` itself) for ``num_layers``, ``kv_channels``,
    ``num_query_groups`` (else ``num_attention_heads``), ``params_dtype``,
    ``tensor_model_parallel_size`` and, for learned absolute positions,
    ``max_position_embeddings``; and ``inference_config`` for ``inference_max_seq_length``
    (else ``max_sequence_length``) and optionally ``params_dtype``.
    """
    config = getattr(model, "config", model)

    def need(obj, *names):
        for name in names:
            value = getattr(obj, name, None)
            if value is not None:
                return value
        raise ValueError(f"from_config: {type(obj).__name__} has none of {names}")

    max_seq = getattr(inference_config, "inference_max_seq_length", None) or \
        getattr(inference_config, "max_sequence_length", None)
    if getattr(config, "position_embedding_type", None) == "learned_absolute":
        model_max = need(config, "max_position_embeddings")
        max_seq = min(model_max, max_seq) if max_seq else model_max
        if max_batch_size > model_max:
            raise ValueError(f"max_batch_size={max_batch_size} exceeds the model's "
                             f"max_position_embeddings={model_max}")
    if max_seq is None:
        max_seq = need(config, "max_sequence_length", "max_position_embeddings")
    max_seq = max(max_seq, max_batch_size)
    dtype = getattr(inference_config, "params_dtype", None) or need(config, "params_dtype")
    return dict(params_dtype=dtype, num_layers=need(config, "num_layers"),
                kv_channels=need(config, "kv_channels"),
                num_attention_heads=need(config, "num_query_groups", "num_attention_heads"),
                max_sequence_length=max_seq,
                tensor_model_parallel_size=getattr(config, "tensor_model_parallel_size", None))


def check_scalars(*, params_dtype: Any, num_layers: Any, kv_channels: Any,
                  num_attention_heads: Any, max_sequence_length: Any, block_size_tokens: Any,
                  buffer_size_gb: Any, paused_buffer_size_gb: Any, tensor_model_parallel_size: Any,
                  unified_memory_level: Any, cache_mla_latent: bool, kv_lora_rank: Any,
                  qk_pos_emb_head_dim: Any, kernel_backend: Any = None,
                  materialize_only_last_token_logits: Any = None,
                  use_flashinfer_fused_rope: Any = None, metrics_writer: Any = None,
                  **flags: Any) -> dict:
    """The constructor's scalar arguments, checked (``ValueError`` naming each; ``flags`` and
    ``cache_mla_latent`` are bools, ``TypeError`` otherwise: ``"no"`` would turn them on;
    ``materialize_only_last_token_logits`` a bool or None; ``kernel_backend`` one of the
    kernel backends or None); returns them normalised (ints, ``tp`` for the tensor-parallel
    size)."""
    for name, value in (("materialize_only_last_token_logits",
                         materialize_only_last_token_logits),
                        ("use_flashinfer_fused_rope", use_flashinfer_fused_rope)):
        if value is not None:  # None: the default (Megatron-Core's Optional[bool])
            flags[name] = value
    if metrics_writer is not None and not callable(getattr(metrics_writer, "log", None)):
        raise TypeError(f"metrics_writer={metrics_writer!r} must be None or have a callable "
                        "log(dict) (wandb-style)")
    for name, value in dict(flags, cache_mla_latent=cache_mla_latent).items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name}={value!r} must be a bool")
    check_backend_name(kernel_backend, "kernel_backend")
    if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
        raise ValueError(f"params_dtype={params_dtype!r} must be a floating torch.dtype")
    out = {name: positive_int(name, value) for name, value in (
        ("num_layers", num_layers), ("kv_channels", kv_channels),
        ("num_attention_heads", num_attention_heads),
        ("max_sequence_length", max_sequence_length), ("block_size_tokens", block_size_tokens))}
    if isinstance(buffer_size_gb, bool) or not isinstance(buffer_size_gb, (int, float)) \
            or not math.isfinite(buffer_size_gb) or buffer_size_gb <= 0:
        raise ValueError(f"buffer_size_gb={buffer_size_gb!r} must be a positive number")
    if paused_buffer_size_gb is not None and (
            not isinstance(paused_buffer_size_gb, (int, float))
            or not math.isfinite(paused_buffer_size_gb) or paused_buffer_size_gb < 0):
        raise ValueError(f"paused_buffer_size_gb={paused_buffer_size_gb!r} must be >= 0 or None")
    tp = 1 if tensor_model_parallel_size is None else positive_int(
        "tensor_model_parallel_size", tensor_model_parallel_size)
    heads = out["num_attention_heads"]
    if (heads % tp if heads >= tp else tp % heads):
        raise ValueError(f"num_attention_heads={num_attention_heads} (the KV heads) must be "
                         f"divisible by tensor_model_parallel_size={tp}, or divide it (then "
                         "each rank holds one replicated KV head)")
    if unified_memory_level is not None and (
            isinstance(unified_memory_level, bool) or unified_memory_level not in (0, 1)
            or not isinstance(unified_memory_level, (int, np.integer))):
        raise ValueError(f"unified_memory_level={unified_memory_level!r} must be 0 or 1")
    if cache_mla_latent:
        kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
        qk_pos_emb_head_dim = positive_int("qk_pos_emb_head_dim", qk_pos_emb_head_dim)
    out.update(tp=tp, kv_lora_rank=kv_lora_rank, qk_pos_emb_head_dim=qk_pos_emb_head_dim)
    return out
