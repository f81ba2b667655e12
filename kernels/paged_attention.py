"""Causal GQA attention of a step's packed queries over a paged KV cache: the launcher.

``paged_attention`` checks its arguments and runs two kernels, each in a file of its own:

* **decode** (``paged_attention_decode.py``): requests with at most one query each, by
  flash-decoding over splits of their keys, merged by ``paged_attention_merge.py``;
* **varlen** (``paged_attention_varlen.py``): prefill, chunked prefill and the rest of a mixed
  step, causal, in tiles of query tokens. In a mixed step the leading ``num_decode_requests``
  (the context puts decode requests first) still take the decode kernel.

A layer may ask for a sliding ``window`` ``W`` (a query at position ``p`` sees the keys ``j``
with ``p - j < W``, its own included; 0 for all, a runtime argument, so no build per ``W``),
and per-head ``sinks`` (gpt-oss: one logit per query head that joins the softmax denominator
and carries no value). Both kernels skip the key tiles wholly outside a window.

Both walk keys with ``_attend_key_tile`` (``paged_attention_tile.py``) and read only the slots
``< kv_seq_lengths[i]`` of a request: block-table entries past them (``-1`` or stale) are never
dereferenced, and stale or NaN bytes in the cache never reach an output. Scores, softmax and
accumulation are fp32; the two matrix products take the cache dtype (fp32 products are exact
IEEE, never TF32). An FP8 cache (``kernels/fp8.py``) is read in the query's dtype, exactly,
with its per-KV-head K scale folded into the softmax scale and its V scale into the output.
Rows of padding tokens (from ``cu_query_lengths[num_requests]`` on) are not
written: zeros when the launcher allocates the output, the caller's bytes when it passes ``out``.
This file also holds the torch reference, the tune case both tunings share and their
registration.
"""

from __future__ import annotations

import torch

from . import autotune
from ._common import FLOAT_DTYPES, check_same_device, custom_op
from .autotune import KernelConfig, KernelTuning, TuneCase
from .backend import resolve_backend
from .devices import same_device
from .fp8 import check_head_scale, dequantize_ref, is_fp8
from .launch_plan import PlanCache
from .paged_attention_decode import (
    launch_decode,
    paged_attention_decode_configs,
    paged_attention_decode_default_config,
    paged_attention_decode_presets,
    paged_attention_decode_tune_key,
)
from .paged_attention_plan import AttentionPlan, length_classes
from .paged_attention_tile import ATTENTION_TOLERANCE, MAX_GROUP, MAX_HEAD_DIM
from .paged_attention_varlen import (
    launch_varlen,
    paged_attention_varlen_configs,
    paged_attention_varlen_default_config,
    paged_attention_varlen_presets,
    paged_attention_varlen_tune_key,
)

# Per launch key (launch_plan.py): the checks passed, the configs, the grids, the arguments.
_PLANS = PlanCache("paged_attention")


def _describe(tensor) -> str:
    return str(tuple(tensor.shape)) if isinstance(tensor, torch.Tensor) else type(tensor).__name__


def _check_index(name: str, tensor, dims: int, min_rows: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D int32 tensor, got {_describe(tensor)}")
    if tensor.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {tensor.dtype}")
    if tensor.shape[0] < min_rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows; num_requests needs >= {min_rows}")
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {tensor.stride()}")


def _check_window_and_sinks(window, sinks, query) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window={window!r} must be an int >= 0 (keys a query sees, its own "
                         "included; 0 for all)")
    if sinks is None:
        return
    num_q_heads = query.shape[1]
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != num_q_heads:
        raise ValueError(f"sinks must be a [{num_q_heads}] tensor (one logit per query head), "
                         f"got {_describe(sinks)}")
    if sinks.dtype not in FLOAT_DTYPES:
        raise ValueError(f"sinks must be float32, float16 or bfloat16, got {sinks.dtype}")
    if not same_device(sinks.device, query.device):
        raise ValueError(f"sinks is on {sinks.device}, query on {query.device}")


def _check_inputs(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths, block_table,
                  num_requests, max_seqlen_q, max_seqlen_k, out, window, sinks, key_scale=None,
                  value_scale=None) -> int:
    """Validate the launcher's arguments (shapes, dtypes, devices, limits); return num_requests."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"query must be [n, Hq, D], got {_describe(query)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query must be float32, float16 or bfloat16, got {query.dtype}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, Hkv, D]")
        if cache.dtype != query.dtype and not is_fp8(cache.dtype):
            raise ValueError(f"{name} dtype {cache.dtype} != query dtype {query.dtype} (nor "
                             "float8_e4m3fn/float8_e5m2)")
        if cache.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {cache.dtype} != key_cache dtype {key_cache.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, "
                             f"got strides {cache.stride()}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
                         f"{tuple(key_cache.shape)}")
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if is_fp8(key_cache.dtype):
        if key_scale is None or value_scale is None:
            raise ValueError(f"an {key_cache.dtype} cache needs key_scale and value_scale")
        check_head_scale("key_scale", key_scale, num_kv_heads, query.device)
        check_head_scale("value_scale", value_scale, num_kv_heads, query.device)
    elif key_scale is not None or value_scale is not None:
        raise ValueError(f"key_scale/value_scale are for an FP8 cache, not {key_cache.dtype}")
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache head dim {key_cache.shape[3]} != query head dim {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be in [1, {MAX_HEAD_DIM}]")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}")
    if num_q_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"query heads per KV head {num_q_heads // num_kv_heads} exceeds "
                         f"{MAX_GROUP}")
    if query.stride(-1) != 1:
        raise ValueError(f"query must have a contiguous last dim, got strides {query.stride()}")
    num_requests = kv_seq_lengths.shape[0] if num_requests is None else int(num_requests)
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests} must be >= 0")
    _check_index("cu_query_lengths", cu_query_lengths, 1, num_requests + 1)
    _check_index("kv_seq_lengths", kv_seq_lengths, 1, num_requests)
    _check_index("block_table", block_table, 2, num_requests)
    check_same_device((("key_cache", key_cache), ("value_cache", value_cache),
                       ("cu_query_lengths", cu_query_lengths), ("kv_seq_lengths", kv_seq_lengths),
                       ("block_table", block_table)), "query", query)
    if int(max_seqlen_q) < 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} must be >= 0")
    capacity = block_table.shape[1] * key_cache.shape[1]
    if not 0 <= int(max_seqlen_k) <= capacity:
        raise ValueError(f"max_seqlen_k={max_seqlen_k} must be in [0, {capacity}] (block_table "
                         f"columns {block_table.shape[1]} x block_size {key_cache.shape[1]})")
    if out is not None:
        if tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype:
            raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        if not same_device(out.device, query.device):
            raise ValueError(f"out is on {out.device}, query on {query.device}")
        if out.stride(-1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    _check_window_and_sinks(window, sinks, query)
    return num_requests


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                    block_table: torch.Tensor, *, max_seqlen_q: int, max_seqlen_k: int,
                    softmax_scale: float | None = None, num_requests: int | None = None,
                    num_decode_requests: int = 0, window: int = 0,
                    sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    key_scale: torch.Tensor | None = None,
                    value_scale: torch.Tensor | None = None,
                    config: KernelConfig | None = None, backend: str | None = None
                    ) -> torch.Tensor:
    """Causal GQA attention of packed queries over a paged KV cache, optionally within a
    sliding window and with per-head sinks.

    Args:
        query: ``[n, Hq, D]`` float32/float16/bfloat16, last dim contiguous; request ``i`` owns
            tokens ``[cu_query_lengths[i], cu_query_lengths[i + 1])``.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` in query's dtype (or both
            float8_e4m3fn/float8_e5m2, read as ``q * scale``), last dim contiguous, this step's
            K/V already written. ``Hq`` is a multiple of ``Hkv``
            (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        cu_query_lengths: int32 ``[>= num_requests + 1]``.
        kv_seq_lengths: int32 ``[>= num_requests]``: cached tokens of each request, its own
            queries included (``>= `` its query count; 0 for a padded request).
        block_table: int32 ``[>= num_requests, max_blocks]``; entries past a request's length
            are never read (``-1`` is fine).
        max_seqlen_q, max_seqlen_k: host ints bounding the query and KV lengths (they size the
            grid and pick the kernel: at most one query per request runs the split-KV decode).
        softmax_scale: default ``D ** -0.5``.
        num_requests: requests to attend (default ``kv_seq_lengths.shape[0]``).
        num_decode_requests: the leading requests with at most one query each (the context
            puts decode requests first). In a step with longer queries they still run through
            the split-KV decode kernel, the rest through the varlen one. ``config`` then must be
            None (each kernel resolves its own).
        window: a query at position ``p`` sees the keys at ``p - window < j <= p``; 0 (the
            default) for every key up to ``p``. A host int fixed per layer: no build per value
            and nothing read back, so a CUDA graph captures it.
        sinks: optional ``[Hq]`` float logits, one per query head, that join the softmax
            denominator (scaled scores and sinks share one softmax) and carry no value.
        out: optional ``[n, Hq, D]`` output in query's dtype, written in place for the
            requests' tokens only (padding rows keep their bytes).
        key_scale, value_scale: fp32 ``[Hkv]``, with an FP8 cache only (any stride).

    Returns ``[n, Hq, D]`` in query's dtype; padding rows are zero when the launcher allocates.
    """
    # The key holds the lengths' classes, not the lengths (paged_attention_plan.py).
    plan, plan_key = _PLANS.find(
        (query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths, block_table, sinks, out,
         key_scale, value_scale),
        (*length_classes(max_seqlen_q, max_seqlen_k, num_decode_requests, window),
         softmax_scale, num_requests, num_decode_requests, window, backend), config,
         backend=backend)
    if plan is not None:
        found = plan.launches_for(max_seqlen_q, max_seqlen_k)
        if found is not None:
            return plan.launch(found, (query, key_cache, value_cache,
                                       torch.zeros_like(query) if out is None else out, sinks,
                                       key_scale, value_scale, cu_query_lengths, kv_seq_lengths,
                                       block_table))
    num_requests = _check_inputs(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                                 block_table, num_requests, max_seqlen_q, max_seqlen_k, out,
                                 window, sinks, key_scale, value_scale)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    num_tokens, num_q_heads, head_dim = query.shape
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    num_decode_requests = int(num_decode_requests)
    if not 0 <= num_decode_requests <= num_requests:
        raise ValueError(f"num_decode_requests={num_decode_requests} must be in [0, "
                         f"num_requests={num_requests}]")
    if max_seqlen_q > 1 and 0 < num_decode_requests < num_requests and config is not None:
        raise ValueError(f"config={config} names one kernel's config, but num_decode_requests="
                         f"{num_decode_requests} of num_requests={num_requests} runs both")
    if resolve_backend(backend, query.device) == "torch":
        result = paged_attention_ref(query, key_cache, value_cache, cu_query_lengths,
                                     kv_seq_lengths, block_table, softmax_scale=scale,
                                     num_requests=num_requests, window=window, sinks=sinks,
                                     key_scale=key_scale, value_scale=value_scale)
        if out is None:
            return result
        real = int(cu_query_lengths[num_requests])
        out[:real] = result[:real]
        return out
    if out is None:
        out = torch.zeros_like(query)
    if num_requests == 0 or max_seqlen_q == 0 or max_seqlen_k == 0 or num_tokens == 0:
        return out
    decode = num_requests if max_seqlen_q == 1 else num_decode_requests
    tensors = dict(query=query, key_cache=key_cache, value_cache=value_cache, out=out,
                   sinks=sinks, key_scale=key_scale, value_scale=value_scale,
                   cu_query_lengths=cu_query_lengths, kv_seq_lengths=kv_seq_lengths,
                   block_table=block_table)
    roles = {name: tensor for name, tensor in tensors.items() if tensor is not None}
    launch = dict(tensors, scale=scale, window=window, config=config, roles=roles)
    pair, varlen, workspace = None, None, 0
    if decode:
        *pair, workspace = launch_decode(**launch, num_requests=decode, max_seqlen_k=max_seqlen_k)
    if decode < num_requests:
        # The kernel indexes from the first prefill request (a host count, not a view of the
        # index tensors: their alignment would change with it, and with it the compiled kernel).
        varlen = launch_varlen(**launch, first_request=decode, num_requests=num_requests - decode,
                               max_seqlen_q=max_seqlen_q)
    # A plan names each pointer by the argument it was: only where no two arguments are one
    # tensor (a later call of that key may pass two).
    if len({id(tensor) for tensor in roles.values()}) == len(roles):
        _PLANS.put(plan_key, AttentionPlan(
            pair, varlen, workspace, num_q_heads=num_q_heads, head_dim=head_dim,
            capacity=block_table.shape[1] * key_cache.shape[1], window=window))
    return out


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                        block_table: torch.Tensor, *, softmax_scale: float | None = None,
                        num_requests: int | None = None, window: int = 0,
                        sinks: torch.Tensor | None = None, key_scale: torch.Tensor | None = None,
                        value_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of ``paged_attention``: one request at a time, fp32, GQA by repeating
    K/V per query head (an FP8 cache dequantized first: ``q * scale[head]``), the sinks as one
    more column of the softmax; padding rows are zero."""
    num_q_heads, head_dim = query.shape[1:]
    group = num_q_heads // key_cache.shape[2]
    block_size = key_cache.shape[1]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    num_requests = kv_seq_lengths.shape[0] if num_requests is None else num_requests
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    cu = cu_query_lengths.tolist()
    for request in range(num_requests):
        q_start, q_len = cu[request], cu[request + 1] - cu[request]
        kv_len = int(kv_seq_lengths[request])
        if q_len == 0:
            continue
        positions = torch.arange(kv_len, device=query.device)
        blocks = block_table[request].long()[positions // block_size]
        k = dequantize_ref(key_cache[blocks, positions % block_size],
                           None if key_scale is None else key_scale[:, None])
        v = dequantize_ref(value_cache[blocks, positions % block_size],
                           None if value_scale is None else value_scale[:, None])
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[q_start:q_start + q_len].float()                             # [q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_positions = kv_len - q_len + torch.arange(q_len, device=query.device)
        causal = positions[None, :] <= query_positions[:, None]                 # [q, kv]
        if window:
            causal &= query_positions[:, None] - positions[None, :] < window
        scores = scores.masked_fill(~causal, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            sink = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)            # [Hq, q, 1]
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        out[q_start:q_start + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(query.dtype)


class _AttentionCase(TuneCase):
    """Scratch paged cache for one key: ``decode`` requests of ``max_seqlen_k`` cached tokens
    and one query each, or ``varlen`` prompts of at most 512 tokens filling ``num_tokens``
    (within the key's ``window``).
    Blocks of 256 tokens (Megatron's default), handed out in a shuffled order."""

    BLOCK_SIZE = 256

    def __init__(self, key: dict, device: torch.device, *, decode: bool):
        self.key = key
        dtype = getattr(torch, key["dtype"])
        # Drawn on the device: the largest preset caches hold gigabytes.
        gen = torch.Generator(device=device).manual_seed(0)
        if decode:
            q_lens = [1] * key["num_requests"]
            kv_lens = [key["max_seqlen_k"]] * key["num_requests"]
        else:
            per_request = min(512, key["num_tokens"])
            q_lens = [per_request] * max(1, key["num_tokens"] // per_request)
            kv_lens = list(q_lens)
        bs = self.BLOCK_SIZE
        blocks_per_request = [-(-kv // bs) for kv in kv_lens]
        num_blocks = sum(blocks_per_request) + 1
        heads, kv_heads, dim = key["num_q_heads"], key["num_kv_heads"], key["head_dim"]
        shape = (num_blocks, bs, kv_heads, dim)
        kv_dtype = getattr(torch, key.get("kv_dtype", key["dtype"]))
        self.key_cache = torch.randn(shape, generator=gen, device=device).to(kv_dtype)
        self.value_cache = torch.randn(shape, generator=gen, device=device).to(kv_dtype)
        # An FP8 cache holds N(0, 1) values at scales of 1/4 and 1/2.
        self.scales = {} if not is_fp8(kv_dtype) else dict(
            key_scale=torch.full((kv_heads,), 0.25, device=device),
            value_scale=torch.full((kv_heads,), 0.5, device=device))
        order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0))
        table = torch.full((len(kv_lens), max(blocks_per_request)), -1, dtype=torch.int32)
        used = 0
        for request, count in enumerate(blocks_per_request):
            table[request, :count] = order[used:used + count].to(torch.int32)
            used += count
        self.block_table = table.to(device)
        self.kv_seq_lengths = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        self.cu_query_lengths = torch.tensor(cu, dtype=torch.int32, device=device)
        self.query = torch.randn(cu[-1], heads, dim, generator=gen, device=device, dtype=dtype)
        self.out = torch.empty_like(self.query)
        self._expected = None
        self.max_seqlen_q, self.max_seqlen_k = max(q_lens), max(kv_lens)
        self.bytes_moved = (2 * sum(kv_lens) * kv_heads * dim * self.key_cache.element_size()
                            + 2 * cu[-1] * heads * dim * self.query.element_size())

    def _call(self, config, backend, out=None):
        return paged_attention(self.query, self.key_cache, self.value_cache,
                               self.cu_query_lengths, self.kv_seq_lengths, self.block_table,
                               max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                               window=self.key.get("window", 0), out=out, config=config,
                               backend=backend, **self.scales)

    def run(self, config: KernelConfig) -> None:
        self._call(config, "triton", self.out)

    def run_reference(self) -> None:
        self._call(None, "torch", self.out)

    def check(self, config: KernelConfig) -> None:
        self.out.fill_(float("nan"))
        got = self._call(config, "triton", self.out)
        if self._expected is None:
            # One reference per key, however many configs are checked against it.
            self._expected = self._call(None, "torch").float()
        torch.testing.assert_close(got.float(), self._expected,
                                   **ATTENTION_TOLERANCE[self.query.dtype],
                                   msg=lambda m: f"{config}: {m}")


def _decode_case(key: dict, device: torch.device) -> TuneCase:
    return _AttentionCase(key, device, decode=True)


def _varlen_case(key: dict, device: torch.device) -> TuneCase:
    return _AttentionCase(key, device, decode=False)


autotune.register(KernelTuning(
    name="paged_attention_decode", configs=paged_attention_decode_configs,
    default_config=paged_attention_decode_default_config,
    tune_key=paged_attention_decode_tune_key, token_field="num_requests",
    make_case=_decode_case, presets=paged_attention_decode_presets))
autotune.register(KernelTuning(
    name="paged_attention_varlen", configs=paged_attention_varlen_configs,
    default_config=paged_attention_varlen_default_config,
    tune_key=paged_attention_varlen_tune_key, token_field="num_tokens",
    make_case=_varlen_case, presets=paged_attention_varlen_presets))


@custom_op("dynctx::paged_attention", mutates_args=())
def _paged_attention_op(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                        block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        softmax_scale: float, num_requests: int,
                        num_decode_requests: int = 0, window: int = 0,
                        sinks: torch.Tensor | None = None, key_scale: torch.Tensor | None = None,
                        value_scale: torch.Tensor | None = None) -> torch.Tensor:
    return paged_attention(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths,
                           block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           softmax_scale=softmax_scale, num_requests=num_requests,
                           num_decode_requests=num_decode_requests, window=window, sinks=sinks,
                           key_scale=key_scale, value_scale=value_scale)


@_paged_attention_op.register_fake
def _(query, key_cache, value_cache, cu_query_lengths, kv_seq_lengths, block_table, max_seqlen_q,
      max_seqlen_k, softmax_scale, num_requests, num_decode_requests=0, window=0, sinks=None,
      key_scale=None, value_scale=None):
    return torch.empty_like(query)
