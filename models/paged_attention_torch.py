"""The torch versions of paged attention (``PagedAttention(backend="torch")`` and
``"torch_static"``, models/paged_attention.py), and the row groups DeepSeek's MLA attention
builds on.

Both compute in fp32 from the same inputs as the kernels (the module docstring of
models/paged_attention.py), with a layer's sliding ``window`` and per-head ``sinks``, and an
FP8 cache read with its per-KV-head ``key_scale`` and ``value_scale``:

* ``SdpaStep`` (``"torch"``) computes attention with ``scaled_dot_product_attention`` and no
  copy of K/V per query head: the query heads of a KV head become that head's queries
  (``[rows, Hkv, G * q, D]``). Decode requests (one query) are sorted by key count and batched
  in a few groups, each padded only to its own longest key count; every prefill or chunk runs
  alone over its own keys gathered contiguously from its blocks, with its causal mask (a chunk
  starting mid-sequence sees its whole prefix). It reads the lengths on the host.
* ``TorchRowGroup`` (``"torch_static"``) pads the decode and the prefill requests to the
  step's bounds, so every shape is fixed by them and nothing is read back: the torch version a
  CUDA graph can capture.

Key slots past a request's length gather a key of the request (never stale or NaN bytes) and
are masked out. A block-table entry of -1 before a request's keys end is a released block (a
windowed KV group frees the blocks wholly before the window of every query of the step): its
keys are never read either, so such a table needs a window that hides them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


class TorchRowGroup:
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
        num_blocks = max(1, math.ceil(max_k / block_size))
        blocks = block_table[lo:hi, :num_blocks].long()
        # Unused (-1) entries lie beyond kv_len, released ones before every query's window:
        # read block 0 there, and zero what it gives.
        present = (blocks >= 0)[:, offs_k // block_size]                       # [rows, k]
        self.key_valid = ((offs_k[None, :] < kv_len[:, None])
                          & present)[:, :, None, None]                          # [rows, k, 1, 1]
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
               sinks: Optional[torch.Tensor] = None, key_scale: Optional[torch.Tensor] = None,
               value_scale: Optional[torch.Tensor] = None) -> None:
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
        if key_scale is not None:
            # An FP8 cache, dequantized per KV head (x = q * scale).
            k, v = k * key_scale[:, None], v * value_scale[:, None]
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
    """The step's ``TorchRowGroup``s: the leading decode requests (one query each) apart from
    the prefills, so a long prefill does not pad every decode request."""
    groups = []
    num_requests = kv_seq_lengths.shape[0]
    decode = min(max(int(num_decode_requests), 0), num_requests)
    common = (int(max_seqlen_k), int(num_tokens), cu_query_lengths, kv_seq_lengths,
              block_table, block_size)
    if num_requests and max_seqlen_k > 0:
        if decode:
            groups.append(TorchRowGroup(0, decode, 1, *common))
        if decode < num_requests:
            groups.append(TorchRowGroup(decode, num_requests, max(1, int(max_seqlen_q)),
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


class SdpaStep:
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
            # A released block (-1, before every query's window) gathers the last key.
            slots = torch.where(blocks >= 0, slots, slots[-1])
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
            valid = (positions[None, :] < lengths[:, None]) & (blocks >= 0)
            # Past a request's length, or in a released block (-1, before its window): its last
            # key (cached, finite), masked out below.
            last = slots.gather(1, (lengths - 1)[:, None])
            slots = torch.where(valid, slots, last)
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
               sinks: Optional[torch.Tensor] = None, key_scale: Optional[torch.Tensor] = None,
               value_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, num_q_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        group = num_q_heads // num_kv_heads
        decode_masks, prefill_masks = self.masks(window, explicit=sinks is not None)
        # Per query head sink logits, laid out as the query rows below: [Hkv, G, 1].
        sink = None if sinks is None else sinks.float().view(num_kv_heads, group, 1)
        # fp32 math in every dtype, as the kernels do.
        compute = torch.float32
        # An FP8 cache, as the kernels read it: the K scale of each KV head folds into its
        # queries (the softmax scale), the V scale into its output.
        q_fold = None if key_scale is None else key_scale.view(num_kv_heads, 1, 1)
        o_fold = None if value_scale is None else value_scale.view(num_kv_heads, 1, 1)
        out = query.new_zeros(n, num_q_heads, head_dim)
        for (tokens, slots, _, _), mask in zip(self.decode, decode_masks):
            rows, keys = slots.shape
            q = query.index_select(0, tokens).to(compute).view(rows, num_kv_heads, group, head_dim)
            q = q if q_fold is None else q * q_fold
            k = _gather_rows(key_cache, slots).to(compute).transpose(1, 2)     # [g, Hkv, L, D]
            v = _gather_rows(value_cache, slots).to(compute).transpose(1, 2)
            if sink is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            else:
                o = _attend_with_sinks(q, k, v, mask, scale, sink)
            o = o if o_fold is None else o * o_fold
            out.index_copy_(0, tokens, o.reshape(rows, num_q_heads, head_dim).to(out.dtype))
        for (first, q_len, slots), (mask, causal) in zip(self.prefill, prefill_masks):
            q = query[first:first + q_len].to(compute).reshape(q_len, num_kv_heads, group,
                                                               head_dim)
            q = q.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
            q = q if q_fold is None else q * q_fold
            k = _gather_rows(key_cache, slots).to(compute).transpose(0, 1)[None]  # [1, Hkv, kv, D]
            v = _gather_rows(value_cache, slots).to(compute).transpose(0, 1)[None]
            if sink is None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                   scale=scale)               # [1, Hkv, G*q, D]
            else:
                rows_sink = sink[:, :, None].expand(-1, -1, q_len, -1).reshape(
                    num_kv_heads, group * q_len, 1)
                o = _attend_with_sinks(q, k, v, mask, scale, rows_sink)
            o = o if o_fold is None else o * o_fold
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
