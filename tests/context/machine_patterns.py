"""Exact fp32 value patterns the driver writes into the caches and reads back.

A K/V value encodes (incarnation, position, attention layer, element) and a Mamba state value
(incarnation, write count, Mamba layer, conv | ssm, element), all below 2**24 so that fp32
holds them exactly; ``_decode``/``_decode_mamba`` turn a wrong value back into words for the
failure message.
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np
from machine_model import _EXACT


class Patterns:
    """Pattern values of a driver's ``cfg`` (a ``MachineConfig``); mixed into the driver."""

    def kv_uids(self, t, positions: np.ndarray) -> np.ndarray:
        """The pattern's first key for request ``t``'s tokens at ``positions``: its incarnation
        (a recompute writes new values); with prefix caching, the content of the sequence up
        to and including the position, so that requests of equal prefixes write equal values
        and a block shared from the cache must hold exactly what the request would write."""
        if self.cfg.prefix_caching is None:
            return np.full(len(positions), t.uid)
        sequence = tuple(t.prompt + t.generated + t.drafts)
        ids = self.__dict__.setdefault("_content_ids", {})
        return np.array([ids.setdefault(sequence[:p + 1], len(ids)) for p in positions.tolist()],
                        dtype=np.int64)

    def mamba_keys(self, requests) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(uids, writes, fresh)`` of the Mamba pattern each request's state holds: its
        incarnation and write count, zero while fresh; with prefix caching the content of the
        tokens its state has absorbed (``mamba_len``), so that a state restored from another
        request's snapshot must equal what this request would have computed."""
        if self.cfg.prefix_caching is None:
            writes = np.array([t.mamba_writes for t in requests])
            return np.array([t.uid for t in requests]), writes, writes == 0
        lengths = np.array([t.mamba_len for t in requests])
        uids = np.array([self.kv_uids(t, np.array([n - 1]))[0] if n else 0
                         for t, n in zip(requests, lengths.tolist())], dtype=np.int64)
        return uids, np.ones(len(requests), dtype=np.int64), lengths == 0

    def _inner(self) -> int:
        cfg = self.cfg
        return cfg.latent_dim if cfg.mla else 2 * cfg.num_heads * cfg.head_dim

    def pattern(self, uids: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
        """Exact fp32 values of (incarnation, position, attention layer (0-based index among the
        ``*`` layers), [K/V, head, dim] | latent dim): MHA ``[n, 2, H, D]``, MLA ``[n, latent]``."""
        cfg = self.cfg
        inner = self._inner()
        layers = len(cfg.attention_layers)
        per_uid = cfg.max_sequence_length * layers * inner
        base = ((uids % (_EXACT // per_uid)) * cfg.max_sequence_length + positions) \
            * layers + layer
        values = base[:, None] * inner + np.arange(inner)[None, :]
        values = values.astype(np.float32)
        if cfg.mla:
            return values
        return values.reshape(-1, 2, cfg.num_heads, cfg.head_dim)

    def _decode(self, value: float) -> str:
        cfg = self.cfg
        v = int(value)
        if value != v or v < 0:
            return f"{value} (not written by the pattern)"
        v //= self._inner()
        layers = len(cfg.attention_layers)
        layer, v = v % layers, v // layers
        pos, uid = v % cfg.max_sequence_length, v // cfg.max_sequence_length
        return f"{value} (uid {uid}, position {pos}, layer {cfg.attention_layers[layer]})"


    def mamba_pattern(self, uids: np.ndarray, writes: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Exact fp32 values of (incarnation, write count, Mamba layer (0-based index among the
        ``M`` layers), conv | ssm, element): conv ``[n, layers, *conv_shape]`` and ssm
        ``[n, layers, *ssm_shape]``."""
        cfg = self.cfg
        inner = max(math.prod(cfg.conv_shape), math.prod(cfg.ssm_shape))
        layers, span = len(cfg.mamba_layers), cfg.max_sequence_length + 1
        per_uid = span * layers * 2 * inner
        base = ((uids % (_EXACT // per_uid - 1)) * span + writes % span)[:, None] * layers \
            + np.arange(layers)[None, :]                                     # [n, layers]
        out = []
        for ssm, shape in enumerate((cfg.conv_shape, cfg.ssm_shape)):
            values = (base * 2 + ssm)[..., None] * inner + np.arange(math.prod(shape)) + 1
            out.append(values.astype(np.float32).reshape(len(uids), layers, *shape))
        return out[0], out[1]

    def _decode_mamba(self, value: float) -> str:
        cfg = self.cfg
        v = int(value)
        if value != v or v <= 0:
            return f"{value} (not written by the pattern)"
        v -= 1
        inner = max(math.prod(cfg.conv_shape), math.prod(cfg.ssm_shape))
        layers, span = len(cfg.mamba_layers), cfg.max_sequence_length + 1
        v //= inner
        kind, v = ("ssm", "conv")[v % 2 == 0], v // 2
        layer, v = v % layers, v // layers
        writes, uid = v % span, v // span
        return (f"{value} (uid {uid}, write {writes}, {kind} of layer "
                f"{cfg.mamba_layers[layer]})")

