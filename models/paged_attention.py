"""Paged attention over the context's KV cache: our Triton kernels on CUDA, a torch version that
runs anywhere, and FlashInfer's or flash-attn's paged kernels when asked for by name.

Inputs, as the context publishes them for one step (docs/SEMANTICS.md §5, §13), with ``n`` the
padded token count and ``R`` the padded request count:

* ``query`` ``[n, Hq, D]``: the step's packed queries, already rotated; request ``i`` owns
  tokens ``[cu_query_lengths[i], cu_query_lengths[i + 1])``; tokens from
  ``cu_query_lengths[R]`` on are padding and belong to no request;
* ``key_cache``, ``value_cache`` ``[num_blocks, block_size, Hkv, D]``: one layer of the paged
  cache, this step's K/V already appended;
* ``cu_query_lengths`` ``[R + 1]`` int32, ``kv_seq_lengths`` ``[R]`` int32 (tokens in the
  cache after this step, the step's own included), ``block_table`` ``[R, max_blocks]`` int32
  (-1 unused); padded requests have query and kv length 0;
* ``max_seqlen_q``, ``max_seqlen_k``: host ints bounding the query and kv lengths.

Causality: the ``j``-th query token of request ``i`` sits at position
``kv_seq_lengths[i] - q_len[i] + j`` and sees the cached tokens at positions up to its own. GQA:
query head ``h`` reads KV head ``h // (Hq // Hkv)``. A layer may add a sliding ``window`` ``W``
(a query at position ``p`` sees only the keys at ``p - W < j <= p``, its own included, as
transformers' ``sliding_window``) and per-head ``sinks`` (gpt-oss: one more logit per query head
in the softmax denominator, with no value), and its own ``softmax_scale``: each is an argument
of the per-layer call. The torch versions and our Triton kernels compute both; FlashInfer and
flash-attn refuse them with ``NotImplementedError`` (they never drop one silently). Padding
tokens get zeros from the torch version and our kernels, unspecified values from FlashInfer and
flash-attn; callers ignore them.

Backends (``PagedAttention(backend=...)``): ``"auto"`` runs our Triton kernels
(``dynctx.kernels.paged_attention``) on CUDA and the torch version elsewhere; ``"triton"``
asks for the kernels (on a CPU only under ``TRITON_INTERPRET=1``); ``"torch"``; FlashInfer's
(``"flashinfer"``) and flash-attn's (``"flash_attn"``) paged kernels run only when asked for by
name.

The torch versions live in ``paged_attention_torch.py``: ``"torch"`` with SDPA over requests
grouped by their lengths on the host, ``"torch_static"`` padded to the step's bounds (what a
CUDA graph captures).

Use ``PagedAttention``: ``plan(...)`` once per step (the index work is shared by all layers),
then call it per layer. ``paged_attention_torch`` is the one-shot torch form.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.backend import HAS_TRITON, triton_interpreting
from ..kernels.devices import indexed_device
from .paged_attention_torch import SdpaStep, torch_row_groups

BACKENDS = ("auto", "torch", "torch_static", "triton", "flashinfer", "flash_attn")
_FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def flashinfer_available(device: torch.device) -> bool:
    """True when FlashInfer imports and ``device`` is a CUDA device."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a wheel built for another torch/CUDA
        return False
    return True


def flash_attn_available(device: torch.device, block_size: int) -> bool:
    """True when flash-attn (2.x) imports, ``device`` is CUDA and its paged-KV path accepts
    ``block_size`` (FA2 needs a multiple of 256)."""
    if torch.device(device).type != "cuda" or block_size % 256:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def triton_attention_available(device: torch.device) -> bool:
    """True when our Triton kernels can run on ``device``: CUDA with Triton installed, or any
    device under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return HAS_TRITON and (torch.device(device).type == "cuda" or triton_interpreting())


def resolve_attention_backend(backend: str, device: torch.device, block_size: int,
                              dtype: Optional[torch.dtype] = None) -> str:
    """Pick the backend: ``"auto"`` takes our Triton kernels on CUDA (when Triton is
    installed), else the torch version; FlashInfer and flash-attn run only when named (fp16/bf16
    only: their kernels have no fp32 path). An explicit choice that cannot run raises
    ``RuntimeError``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    device = torch.device(device)
    if backend == "auto":
        return "triton" if HAS_TRITON and device.type == "cuda" else "torch"
    if backend == "triton" and not triton_attention_available(device):
        reason = ("triton is not installed" if not HAS_TRITON else
                  f"device is {device}; a CPU needs TRITON_INTERPRET=1 set before dynctx is "
                  "imported")
        raise RuntimeError(f"attention backend 'triton' cannot run: {reason}")
    half = dtype is None or dtype in _KERNEL_DTYPES
    if backend in ("flashinfer", "flash_attn") and not half:
        raise RuntimeError(f"attention backend {backend!r} runs fp16/bf16, not {dtype}")
    if backend == "flashinfer" and not flashinfer_available(device):
        raise RuntimeError("attention backend 'flashinfer' needs the flashinfer package and a "
                           f"CUDA device (device is {device})")
    if backend == "flash_attn" and not flash_attn_available(device, block_size):
        raise RuntimeError("attention backend 'flash_attn' needs flash-attn 2, a CUDA device and "
                           f"a block size that is a multiple of 256 (device {device}, block size "
                           f"{block_size})")
    return backend

class PagedAttention:
    """Causal GQA attention of the step's packed queries over the paged KV cache.

    ``backend``: ``"auto"`` (our Triton kernels on CUDA, else torch), ``"torch"``,
    ``"torch_static"``, ``"triton"``, ``"flashinfer"`` or ``"flash_attn"``. ``self.backend``
    names the one that runs. ``"torch"`` groups requests by their lengths on the host (fast on a
    CPU); ``"torch_static"`` pads the decode and the prefill requests to the step's bounds
    ``max_seqlen_q``/``max_seqlen_k``, so every shape is fixed by them and nothing is read back:
    the torch version a CUDA graph can capture. Call ``plan`` once per step, then the object once
    per layer.
    """

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device, softmax_scale: Optional[float] = None,
                 backend: str = "auto", dtype: Optional[torch.dtype] = None):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.device = indexed_device(device)
        self.scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        self.dtype = dtype
        self.backend = resolve_attention_backend(backend, self.device, block_size, dtype)
        self._plan = None
        self._flashinfer_wrapper = None

    def plan(self, *, cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
             block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, num_tokens: int,
             num_decode_requests: int = 0, dtype: Optional[torch.dtype] = None) -> None:
        """Prepare one step. ``num_decode_requests``: the leading requests that have exactly one
        query token (the context orders decode requests first); the torch version pads them
        apart from the prefills so a long prefill does not pad every decode request."""
        num_requests = kv_seq_lengths.shape[0]
        args = dict(cu_query_lengths=cu_query_lengths, kv_seq_lengths=kv_seq_lengths,
                    block_table=block_table, max_seqlen_q=int(max_seqlen_q),
                    max_seqlen_k=int(max_seqlen_k), num_tokens=int(num_tokens),
                    num_requests=num_requests)
        if self.backend == "torch":
            args["sdpa"] = SdpaStep(cu_query_lengths=cu_query_lengths,
                                     kv_seq_lengths=kv_seq_lengths, block_table=block_table,
                                     block_size=self.block_size,
                                     group_size=self.num_q_heads // self.num_kv_heads)
        elif self.backend == "torch_static":
            args["groups"] = torch_row_groups(
                cu_query_lengths=cu_query_lengths, kv_seq_lengths=kv_seq_lengths,
                block_table=block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                num_tokens=num_tokens, num_decode_requests=num_decode_requests,
                block_size=self.block_size)
        elif self.backend == "triton":
            # The leading decode requests go through the split-KV kernel in mixed steps too.
            args["num_decode_requests"] = min(max(int(num_decode_requests), 0), num_requests)
        elif self.backend == "flashinfer":
            self._plan_flashinfer(args, dtype or self.dtype or torch.float16)
        self._plan = args

    def _plan_flashinfer(self, args: dict, dtype: torch.dtype) -> None:
        import flashinfer

        # FlashInfer wants 1 <= last_page_len: keep only requests with cached tokens, which the
        # context puts first (padded requests have kv length 0 and come last).
        kv_len = args["kv_seq_lengths"].long()
        num_real = int((kv_len > 0).sum())
        kv_len = kv_len[:num_real]
        cu_q = args["cu_query_lengths"][:num_real + 1].int()
        pages = (kv_len + self.block_size - 1) // self.block_size
        table = args["block_table"][:num_real].long()
        used = torch.arange(table.shape[1], device=table.device)[None, :] < pages[:, None]
        indices = table[used].int()
        indptr = torch.zeros(num_real + 1, dtype=torch.int32, device=table.device)
        indptr[1:] = torch.cumsum(pages, 0)
        last_page_len = (kv_len - (pages - 1) * self.block_size).int()
        if self._flashinfer_wrapper is None:
            workspace = torch.empty(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8,
                                    device=self.device)
            self._flashinfer_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, kv_layout="NHD")
        # The wrapper's plan is made at the step's first layer call, which knows the cache's
        # dtype (an FP8 cache takes FlashInfer's FP8 path).
        args["flashinfer_plan"] = (cu_q, indptr, indices, last_page_len, dtype)
        args["flashinfer_kv_dtype"] = None
        args["flashinfer_tokens"] = int(cu_q[-1]) if num_real else 0

    def _flashinfer(self, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, key_scale: Optional[torch.Tensor],
                    value_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """FlashInfer's paged prefill over the step's planned requests. An FP8 cache is read by
        FlashInfer's FP8 path (``kv_data_type`` e4m3/e5m2, upcast in its kernel); the per KV
        head scales are applied around it, on the device: ``q . (s_k k) = (s_k q) . k`` folds
        the K scale into the query of each head's group and the V scale multiplies the output
        (no host read of a scale, per-head scales kept)."""
        plan = self._plan
        if plan["flashinfer_kv_dtype"] != key_cache.dtype:
            cu_q, indptr, indices, last_page_len, dtype = plan["flashinfer_plan"]
            self._flashinfer_wrapper.plan(
                cu_q, indptr, indices, last_page_len, self.num_q_heads, self.num_kv_heads,
                self.head_dim, self.block_size, causal=True, sm_scale=self.scale,
                q_data_type=dtype, kv_data_type=key_cache.dtype)
            plan["flashinfer_kv_dtype"] = key_cache.dtype
        out = query.new_zeros(query.shape)
        tokens = plan["flashinfer_tokens"]
        if not tokens:
            return out
        query, group = query[:tokens], self.num_q_heads // self.num_kv_heads
        if key_scale is not None:
            query = query * key_scale.repeat_interleave(group)[:, None].to(query.dtype)
        attended = self._flashinfer_wrapper.run(query.contiguous(), (key_cache, value_cache))
        if value_scale is not None:
            attended = attended * value_scale.repeat_interleave(group)[:, None].to(attended.dtype)
        out[:tokens] = attended
        return out

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 *, softmax_scale: Optional[float] = None, window: Optional[int] = None,
                 sinks: Optional[torch.Tensor] = None, key_scale: Optional[torch.Tensor] = None,
                 value_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``query`` ``[n, Hq, D]`` -> attention output ``[n, Hq, D]`` in ``query``'s dtype.
        An FP8 cache comes with its fp32 ``[Hkv]`` ``key_scale`` and ``value_scale``
        (``ctx.key_value_cache_scales``); the torch versions, our kernels and FlashInfer read it
        (flash-attn refuses it).

        Per layer: ``softmax_scale`` (default: the one given at construction), a sliding
        ``window`` of keys (an int >= 1, or None) and ``sinks`` (``[Hq]`` logits, or None);
        FlashInfer and flash-attn raise ``NotImplementedError`` for a window or sinks."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("PagedAttention: call plan() for the step first")
        if query.dim() != 3 or query.shape[1:] != (self.num_q_heads, self.head_dim):
            raise ValueError(f"query must be [n, {self.num_q_heads}, {self.head_dim}], got "
                             f"{tuple(query.shape)}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"window={window!r} must be an int >= 1 (keys a query sees, its "
                             "own included) or None")
        if sinks is not None and (not isinstance(sinks, torch.Tensor)
                                  or tuple(sinks.shape) != (self.num_q_heads,)):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks)
            raise ValueError(f"sinks must be a [{self.num_q_heads}] tensor (one logit per "
                             f"query head), got {shape}")
        scale = self.scale if softmax_scale is None else float(softmax_scale)
        if (key_scale is None) != (value_scale is None) \
                or (key_scale is None) == (key_cache.dtype in _FP8_DTYPES):
            raise ValueError(f"key_scale and value_scale come with an FP8 cache, and only with "
                             f"one: cache {key_cache.dtype}, key_scale "
                             f"{'given' if key_scale is not None else None}, value_scale "
                             f"{'given' if value_scale is not None else None}")
        fp8 = dict(key_scale=key_scale, value_scale=value_scale)
        if self.backend == "torch":
            return plan["sdpa"].attend(query, key_cache, value_cache, scale, window, sinks, **fp8)
        if self.backend == "torch_static":
            # One spare row takes the writes of empty query slots.
            out = query.new_zeros(query.shape[0] + 1, self.num_q_heads, self.head_dim)
            for group in plan["groups"]:
                group.attend(query, key_cache, value_cache, out, scale, window, sinks, **fp8)
            return out[:-1]
        if self.backend == "triton":
            from ..kernels.paged_attention import paged_attention

            return paged_attention(
                query, key_cache, value_cache, plan["cu_query_lengths"], plan["kv_seq_lengths"],
                plan["block_table"], max_seqlen_q=plan["max_seqlen_q"],
                max_seqlen_k=plan["max_seqlen_k"], softmax_scale=scale,
                num_requests=plan["num_requests"],
                num_decode_requests=plan["num_decode_requests"], window=window or 0,
                sinks=sinks, backend="triton", **fp8)
        missing = [name for name, given in (("sliding windows", window is not None),
                                            ("attention sinks", sinks is not None)) if given]
        if missing:
            raise NotImplementedError(
                f"attention backend {self.backend!r} has no {' or '.join(missing)}: use "
                "attention_backend='triton' or 'torch' (or 'torch_static' under CUDA graphs)")
        if self.backend == "flashinfer" and scale != self.scale:
            raise NotImplementedError(
                f"attention backend 'flashinfer' plans one softmax scale per step ({self.scale}); "
                f"this layer asks for {scale}")
        if self.backend == "flashinfer":
            return self._flashinfer(query, key_cache, value_cache, key_scale, value_scale)
        if key_scale is not None:
            raise NotImplementedError(
                "attention backend 'flash_attn' does not read dynctx's FP8 cache (per KV head "
                "scales): use 'auto', 'triton', 'flashinfer', 'torch' or 'torch_static'")
        return self._flash_attn(query, key_cache, value_cache, plan, scale)

    def _flash_attn(self, query, key_cache, value_cache, plan, scale) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        block_table = plan["block_table"]
        if plan["max_seqlen_q"] == 1 and query.shape[0] == plan["num_requests"]:
            # Decode-only step: one query per (padded) request; padded rows have length 0.
            out = flash_attn_with_kvcache(
                query.unsqueeze(1), key_cache, value_cache,
                cache_seqlens=plan["kv_seq_lengths"], block_table=block_table,
                softmax_scale=scale, causal=True)
            return out.squeeze(1)
        cu_kv = torch.zeros(plan["num_requests"] + 1, dtype=torch.int32, device=query.device)
        cu_kv[1:] = torch.cumsum(plan["kv_seq_lengths"], 0)
        return flash_attn_varlen_func(
            query, key_cache, value_cache, plan["cu_query_lengths"], cu_kv,
            max(1, plan["max_seqlen_q"]), max(1, plan["max_seqlen_k"]),
            softmax_scale=scale, causal=True, block_table=block_table)


def paged_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                          block_table: torch.Tensor, *, max_seqlen_q: int, max_seqlen_k: int,
                          softmax_scale: Optional[float] = None,
                          num_decode_requests: int = 0, window: Optional[int] = None,
                          sinks: Optional[torch.Tensor] = None,
                          key_scale: Optional[torch.Tensor] = None,
                          value_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One-shot torch paged attention (see the module docstring), with an optional sliding
    ``window`` and per-head ``sinks``; returns ``[n, Hq, D]``."""
    attention = PagedAttention(num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2],
                               head_dim=query.shape[2], block_size=key_cache.shape[1],
                               device=query.device, softmax_scale=softmax_scale, backend="torch",
                               dtype=query.dtype)
    attention.plan(cu_query_lengths=cu_query_lengths, kv_seq_lengths=kv_seq_lengths,
                   block_table=block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   num_tokens=query.shape[0], num_decode_requests=num_decode_requests)
    return attention(query, key_cache, value_cache, window=window, sinks=sinks,
                     key_scale=key_scale, value_scale=value_scale)
