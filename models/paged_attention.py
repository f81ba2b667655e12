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
of the per-layer call. The torch versions compute both; the other backends refuse them with
``NotImplementedError`` (they never drop one silently). Padding tokens get zeros from the torch
version and our kernels, unspecified values from FlashInfer and flash-attn; callers ignore them.

Backends (``PagedAttention(backend=...)``): ``"auto"`` runs our Triton kernels
(``dynctx.kernels.paged_attention``) on CUDA and the torch version elsewhere; ``"triton"``
asks for the kernels (on a CPU only under ``TRITON_INTERPRET=1``); ``"torch"``; FlashInfer's
(``"flashinfer"``) and flash-attn's (``"flash_attn"``) paged kernels run only when asked for by
name.

The torch version computes attention with ``scaled_dot_product_attention`` and no copy of K/V
per query head: the query heads of a KV head become that head's queries (``[rows, Hkv, G *
q, D]``). Decode requests (one query) are sorted by key count and batched in a few groups, each
padded only to its own longest key count; every prefill or chunk runs alone over its own keys
gathered contiguously from its blocks, with its causal mask (a chunk starting mid-sequence
sees its whole prefix). Key slots past a request's length gather the request's first key (never
stale or NaN bytes) and are masked out.

Use ``PagedAttention``: ``plan(...)`` once per step (the index work is shared by all layers),
then call it per layer. ``paged_attention_torch`` is the one-shot torch form.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels.backend import HAS_TRITON, triton_interpreting
from ..kernels.devices import indexed_device

BACKENDS = ("auto", "torch", "torch_static", "triton", "flashinfer", "flash_attn")
_FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


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


class _TorchRowGroup:
    """Index tensors for requests ``[lo, hi)`` padded to ``max_q`` queries and ``max_k`` keys
    (the einsum form that DeepSeek's MLA attention builds on)."""

    def __init__(self, lo: int, hi: int, max_q: int, max_k: int, num_tokens: int,
                 cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                 block_table: torch.Tensor, block_size: int):
        device = cu_query_lengths.device
        cu = cu_query_lengths[lo:hi + 1].long()
        q_start, q_len = cu[:-1], cu[1:] - cu[:-1]                              # [rows]
        kv_len = kv_seq_lengths[lo:hi].long()                                   # [rows]
        offs_q = torch.arange(max_q, device=device)
        offs_k = torch.arange(max_k, device=device)
        q_valid = offs_q[None, :] < q_len[:, None]                              # [rows, max_q]
        token = q_start[:, None] + offs_q[None, :]
        # Gather from token 0 where a slot is empty; scatter those slots to a spare row.
        self.gather_tokens = torch.where(q_valid, token, torch.zeros_like(token))
        self.scatter_tokens = torch.where(q_valid, token, torch.full_like(token, num_tokens))
        query_pos = (kv_len - q_len)[:, None] + offs_q[None, :]                 # [rows, max_q]
        allowed = (offs_k[None, None, :] <= query_pos[:, :, None]) \
            & (offs_k[None, None, :] < kv_len[:, None, None]) & q_valid[:, :, None]
        self.allowed = allowed[:, None]                                         # [rows, 1, q, k]
        # A window ``W`` also hides the keys at ``<= position - W``: its mask is built once per
        # step and window, by the first layer that asks (``allowed_for``).
        self._key_back = (query_pos[:, :, None] - offs_k[None, None, :])[:, None]  # [r, 1, q, k]
        self._windowed = {}
        self.key_valid = (offs_k[None, :] < kv_len[:, None])[:, :, None, None]  # [rows, k, 1, 1]
        num_blocks = max(1, math.ceil(max_k / block_size))
        blocks = block_table[lo:hi, :num_blocks].long()
        # Unused (-1) entries lie beyond kv_len and are masked; read block 0 there.
        self.blocks = torch.where(blocks >= 0, blocks, torch.zeros_like(blocks))
        self.max_k = max_k

    def allowed_for(self, window: Optional[int]) -> torch.Tensor:
        """``allowed`` narrowed to a sliding window of ``window`` keys (``None``: unchanged)."""
        if window is None or window >= self.max_k:
            return self.allowed
        if window not in self._windowed:
            self._windowed[window] = self.allowed & (self._key_back < window)
        return self._windowed[window]

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               out: torch.Tensor, scale: float, window: Optional[int] = None,
               sinks: Optional[torch.Tensor] = None) -> None:
        rows = self.blocks.shape[0]
        num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        q = query[self.gather_tokens].float()                                  # [rows, q, Hq, D]
        k = key_cache[self.blocks].reshape(rows, -1, num_kv_heads, key_cache.shape[-1])
        v = value_cache[self.blocks].reshape(rows, -1, num_kv_heads, value_cache.shape[-1])
        # Slots past a request's length hold stale bytes (possibly NaN): zero them, because a
        # zero attention weight times NaN is still NaN.
        zero = torch.zeros((), dtype=torch.float32, device=query.device)
        k = torch.where(self.key_valid, k[:, :self.max_k].float(), zero)       # [rows, k, Hkv, D]
        v = torch.where(self.key_valid, v[:, :self.max_k].float(), zero)
        group = num_q_heads // num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=2)                              # [rows, k, Hq, D]
            v = v.repeat_interleave(group, dim=2)
        allowed = self.allowed_for(window)
        scores = torch.einsum("rqhd,rkhd->rhqk", q, k) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().view(1, num_q_heads, 1, 1).expand(rows, -1, scores.shape[2], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        # Rows with nothing to see (empty query slots) are all -inf: NaN after softmax.
        probs = probs.masked_fill(~allowed, 0.0)
        result = torch.einsum("rhqk,rkhd->rqhd", probs, v)                      # [rows, q, Hq, D]
        out[self.scatter_tokens.reshape(-1)] = result.reshape(-1, num_q_heads, result.shape[-1]
                                                              ).to(out.dtype)


def torch_row_groups(*, cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                     block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     num_tokens: int, num_decode_requests: int, block_size: int) -> list:
    """The step's ``_TorchRowGroup``s: the leading decode requests (one query each) apart from
    the prefills, so a long prefill does not pad every decode request."""
    groups = []
    num_requests = kv_seq_lengths.shape[0]
    decode = min(max(int(num_decode_requests), 0), num_requests)
    common = (int(max_seqlen_k), int(num_tokens), cu_query_lengths, kv_seq_lengths,
              block_table, block_size)
    if num_requests and max_seqlen_k > 0:
        if decode:
            groups.append(_TorchRowGroup(0, decode, 1, *common))
        if decode < num_requests:
            groups.append(_TorchRowGroup(decode, num_requests, max(1, int(max_seqlen_q)),
                                         *common))
    return groups


# A decode group holds rows whose key counts are at least this fraction of its longest one, so
# padding wastes at most a quarter of its work; a step has at most this many decode groups.
_DECODE_GROUP_FILL = 0.75
_MAX_DECODE_GROUPS = 4


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots // bs, slots % bs]`` for flat slot ids ``slots``: ``[*slots.shape, H, D]``.

    One ``index_select`` of ``[slots, H * D]`` rows when each block's slots are contiguous rows
    (a 2-D ``index_select`` is several times faster on a CPU than a 3-D one or indexing)."""
    num_blocks, block_size, heads, dim = cache.shape
    row = heads * dim
    if cache.stride(3) == 1 and cache.stride(2) == dim and cache.stride(1) == row \
            and cache.stride(0) == block_size * row:
        flat = cache.view(num_blocks * block_size, row)
        return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, heads, dim)
    return cache[slots // block_size, slots % block_size]


class _SdpaStep:
    """One step's index tensors for the torch version (built by ``plan``, used by every layer).

    ``decode``: groups of one-query requests, each ``(tokens [g], slots [g, L], lengths [g],
    whether every length is L)``;
    ``prefill``: one entry per request with several queries, ``(first token, q_len, slots [kv])``.
    The masks of a layer (``masks(window, explicit)``) are built once per step and window. The
    grouping reads the lengths on the host (``tolist``: free on a CPU, one sync per step on
    CUDA, where the Triton kernels are the default).
    """

    def __init__(self, *, cu_query_lengths: torch.Tensor, kv_seq_lengths: torch.Tensor,
                 block_table: torch.Tensor, block_size: int, group_size: int):
        device = block_table.device
        cu = cu_query_lengths.tolist()
        kv = kv_seq_lengths.tolist()
        if len(cu) < len(kv) + 1:
            raise ValueError(f"cu_query_lengths has {len(cu)} entries for {len(kv)} requests; "
                             f"needs {len(kv) + 1}")
        self.device, self.group_size = device, group_size
        decode_rows, self.prefill = [], []
        for request, kv_len in enumerate(kv):
            q_len = cu[request + 1] - cu[request]
            if q_len <= 0:
                continue
            if q_len > kv_len:
                raise ValueError(f"request {request}: {q_len} query tokens but kv_seq_lengths="
                                 f"{kv_len} (the step's own tokens are cached, so kv >= q)")
            if q_len == 1:
                decode_rows.append((kv_len, request))
                continue
            positions = torch.arange(kv_len, device=device)
            blocks = block_table[request].long()[positions // block_size]
            slots = blocks * block_size + positions % block_size
            self.prefill.append((cu[request], q_len, slots))
        self.decode = []
        decode_rows.sort(reverse=True)
        while decode_rows:
            longest = decode_rows[0][0]
            take = len(decode_rows)
            if len(self.decode) < _MAX_DECODE_GROUPS - 1:
                take = sum(1 for kv_len, _ in decode_rows if kv_len >= _DECODE_GROUP_FILL * longest)
            group, decode_rows = decode_rows[:take], decode_rows[take:]
            lengths = torch.tensor([kv_len for kv_len, _ in group], device=device)
            rows = torch.tensor([request for _, request in group], device=device)
            tokens = torch.tensor([cu[request] for _, request in group], device=device)
            positions = torch.arange(longest, device=device)
            blocks = block_table[rows].long()[:, positions // block_size]          # [g, L]
            slots = blocks * block_size + positions % block_size
            valid = positions[None, :] < lengths[:, None]
            # Past a request's length: its first key (cached, finite), masked out below.
            slots = torch.where(valid, slots, slots[:, :1])
            self.decode.append((tokens, slots, lengths, group[-1][0] == longest))
        self.longest = max(kv, default=0)
        self._masks = {}

    def masks(self, window: Optional[int], explicit: bool) -> tuple:
        """``(decode masks, prefill masks)`` of a layer with sliding ``window`` (None: none).

        A decode mask is ``[g, 1, 1, L]`` or None (every slot visible); a prefill mask is
        ``(mask [G * q_len, kv] or None, is_causal)``, None with ``is_causal`` where SDPA's own
        causal mask serves (a whole prompt, no query heads folded into its rows). ``explicit``:
        never None (for the explicit softmax of a layer with sinks)."""
        if window is not None and window >= self.longest:
            window = None                        # wider than every request: the full mask
        key = (window, explicit)
        if key in self._masks:
            return self._masks[key]
        decode = []
        for _, slots, lengths, uniform in self.decode:
            if uniform and window is None and not explicit:
                decode.append(None)
                continue
            positions = torch.arange(slots.shape[1], device=self.device)
            visible = positions[None, :] < lengths[:, None]                       # [g, L]
            if window is not None:
                visible &= positions[None, :] > lengths[:, None] - 1 - window
            decode.append(visible[:, None, None, :])
        prefill = []
        for _, q_len, slots in self.prefill:
            kv_len = slots.shape[0]
            first = kv_len - q_len
            if window is None and first == 0 and self.group_size == 1 and not explicit:
                prefill.append((None, True))
                continue
            positions = torch.arange(kv_len, device=self.device)
            query_pos = first + torch.arange(q_len, device=self.device)
            visible = positions[None, :] <= query_pos[:, None]                    # [q, kv]
            if window is not None:
                visible &= positions[None, :] > query_pos[:, None] - window
            prefill.append((visible.repeat(self.group_size, 1), False))
        self._masks[key] = (decode, prefill)
        return self._masks[key]

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               scale: float, window: Optional[int] = None,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, num_q_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        group = num_q_heads // num_kv_heads
        decode_masks, prefill_masks = self.masks(window, explicit=sinks is not None)
        # Per query head sink logits, laid out as the query rows below: [Hkv, G, 1].
        sink = None if sinks is None else sinks.float().view(num_kv_heads, group, 1)
        # fp32 math in every dtype, as the kernels do.
        compute = torch.float32
        out = query.new_zeros(n, num_q_heads, head_dim)
        for (tokens, slots, _, _), mask in zip(self.decode, decode_masks):
            rows, keys = slots.shape
            q = query.index_select(0, tokens).to(compute).view(rows, num_kv_heads, group, head_dim)
            k = _gather_rows(key_cache, slots).to(compute).transpose(1, 2)     # [g, Hkv, L, D]
            v = _gather_rows(value_cache, slots).to(compute).transpose(1, 2)
            if sink is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            else:
                o = _attend_with_sinks(q, k, v, mask, scale, sink)
            out.index_copy_(0, tokens, o.reshape(rows, num_q_heads, head_dim).to(out.dtype))
        for (first, q_len, slots), (mask, causal) in zip(self.prefill, prefill_masks):
            q = query[first:first + q_len].to(compute).reshape(q_len, num_kv_heads, group,
                                                               head_dim)
            q = q.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
            k = _gather_rows(key_cache, slots).to(compute).transpose(0, 1)[None]  # [1, Hkv, kv, D]
            v = _gather_rows(value_cache, slots).to(compute).transpose(0, 1)[None]
            if sink is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                   scale=scale)               # [1, Hkv, G*q, D]
            else:
                rows_sink = sink[:, :, None].expand(-1, -1, q_len, -1).reshape(
                    num_kv_heads, group * q_len, 1)
                o = _attend_with_sinks(q, k, v, mask, scale, rows_sink)
            o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
            out[first:first + q_len] = o.reshape(q_len, num_q_heads, head_dim).to(out.dtype)
        return out


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: Optional[torch.Tensor], scale: float,
                       sink: torch.Tensor) -> torch.Tensor:
    """Softmax attention whose denominator also holds ``exp(sink)`` per query row (``sink``
    broadcasts against the scores ``[..., rows, keys]`` as ``[..., rows, 1]``), fp32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(scores - top)
    denominator = weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top)
    return torch.matmul(weights / denominator, v)


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
            args["sdpa"] = _SdpaStep(cu_query_lengths=cu_query_lengths,
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
        self._flashinfer_wrapper.plan(
            cu_q, indptr, indices, last_page_len, self.num_q_heads, self.num_kv_heads,
            self.head_dim, self.block_size, causal=True, sm_scale=self.scale,
            q_data_type=dtype, kv_data_type=dtype)
        args["flashinfer_tokens"] = int(cu_q[-1]) if num_real else 0

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 *, softmax_scale: Optional[float] = None, window: Optional[int] = None,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``query`` ``[n, Hq, D]`` -> attention output ``[n, Hq, D]`` in ``query``'s dtype.

        Per layer: ``softmax_scale`` (default: the one given at construction), a sliding
        ``window`` of keys (an int >= 1, or None) and ``sinks`` (``[Hq]`` logits, or None); the
        backends other than the torch ones raise ``NotImplementedError`` for a window or
        sinks."""
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
        if self.backend == "torch":
            return plan["sdpa"].attend(query, key_cache, value_cache, scale, window, sinks)
        if self.backend == "torch_static":
            # One spare row takes the writes of empty query slots.
            out = query.new_zeros(query.shape[0] + 1, self.num_q_heads, self.head_dim)
            for group in plan["groups"]:
                group.attend(query, key_cache, value_cache, out, scale, window, sinks)
            return out[:-1]
        missing = [name for name, given in (("sliding windows", window is not None),
                                            ("attention sinks", sinks is not None)) if given]
        if missing:
            raise NotImplementedError(
                f"attention backend {self.backend!r} has no {' or '.join(missing)} yet: use "
                "attention_backend='torch' (or 'torch_static' under CUDA graphs)")
        if self.backend == "flashinfer" and scale != self.scale:
            raise NotImplementedError(
                f"attention backend 'flashinfer' plans one softmax scale per step ({self.scale}); "
                f"this layer asks for {scale}")
        if self.backend == "triton":
            from ..kernels.paged_attention import paged_attention

            return paged_attention(
                query, key_cache, value_cache, plan["cu_query_lengths"], plan["kv_seq_lengths"],
                plan["block_table"], max_seqlen_q=plan["max_seqlen_q"],
                max_seqlen_k=plan["max_seqlen_k"], softmax_scale=scale,
                num_requests=plan["num_requests"],
                num_decode_requests=plan["num_decode_requests"], backend="triton")
        if self.backend == "flashinfer":
            out = query.new_zeros(query.shape)
            tokens = plan["flashinfer_tokens"]
            if tokens:
                out[:tokens] = self._flashinfer_wrapper.run(query[:tokens].contiguous(),
                                                            (key_cache, value_cache))
            return out
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
                          sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One-shot torch paged attention (see the module docstring), with an optional sliding
    ``window`` and per-head ``sinks``; returns ``[n, Hq, D]``."""
    attention = PagedAttention(num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2],
                               head_dim=query.shape[2], block_size=key_cache.shape[1],
                               device=query.device, softmax_scale=softmax_scale, backend="torch",
                               dtype=query.dtype)
    attention.plan(cu_query_lengths=cu_query_lengths, kv_seq_lengths=kv_seq_lengths,
                   block_table=block_table, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   num_tokens=query.shape[0], num_decode_requests=num_decode_requests)
    return attention(query, key_cache, value_cache, window=window, sinks=sinks)
