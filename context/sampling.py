"""Megatron-Core 0.19's sampling backends: ``Sampling`` and ``TorchSampling``.

0.19 moves the sampling of its text-generation controller into a backend object that the
context's ``calculate_log_probs(..., sampling=)`` also asks for *processed* log probs
(``InferenceConfig.logprobs_mode == "processed_logprobs"``): the log-softmax of the logits
after the request's own temperature and top-k / top-p filtering, so that a log prob is the
probability the request was really sampled with. ``TorchSampling`` is 0.19's pure-torch
backend, with its names and signatures: rows are grouped by their ``(temperature, top_k,
top_p)`` and each group is filtered and sampled (or log-softmaxed) at once. The per-request
parameters come from the context's ``active_request_metadata`` (host tensors, active rows
first), so grouping reads no device memory.

dynctx's own engine samples through ``dynctx.engine`` (per-request seeds); this class serves
0.19 code that passes a backend to the context (docs/SEMANTICS.md §16 row 55).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Sampling", "TorchSampling"]


class Sampling(ABC):
    """0.19's abstract sampling backend: ``sample_kernel`` and ``log_probs_kernel``."""

    @abstractmethod
    def sample_kernel(self, logits: Tensor, n: int, context, *, no_top_k: bool, no_top_p: bool,
                      gather_indices: Optional[Tensor] = None,
                      token_to_request_index: Optional[Tensor] = None,
                      output: Optional[Tensor] = None, eager: bool = False,
                      cache_key: Any = None) -> Tensor:
        """``[n]`` token ids sampled from ``logits`` (rows ``gather_indices[:n]`` if given)."""

    @abstractmethod
    def log_probs_kernel(self, logits: Tensor, context, *,
                         token_to_request_index: Optional[Tensor] = None) -> Tensor:
        """``[rows, vocab]`` log probs of each row's processed sampling distribution."""


def _groups(context, token_to_request_index: Optional[Tensor]) -> Dict[Tuple, List[int]]:
    """Rows grouped by their request's ``(temperature, top_k, top_p)`` (host metadata): row
    ``i`` is active request ``i``, or ``token_to_request_index[i]`` when given."""
    active = int(context.total_request_count) - int(context.paused_request_count)
    meta = context.active_request_metadata
    columns = [meta[label][:active] for label in ("temperature", "top_k", "top_p")]
    if token_to_request_index is not None:
        owners = token_to_request_index
        if not isinstance(owners, Tensor) or owners.dtype not in _INDEX_DTYPES \
                or owners.dim() != 1:
            raise TypeError(f"token_to_request_index must be a 1-D integer tensor, got "
                            f"{_describe(owners)}")
        if owners.device.type != "cpu":
            raise ValueError("token_to_request_index must be a CPU tensor (it maps rows to "
                             "requests on the host)")
        if owners.numel() and not 0 <= int(owners.min()) <= int(owners.max()) < active:
            raise ValueError(f"token_to_request_index holds requests in [{int(owners.min())}, "
                             f"{int(owners.max())}], outside the active ones [0, {active})")
        columns = [column[owners.long()] for column in columns]
    groups: Dict[Tuple, List[int]] = {}
    for row, key in enumerate(zip(*(column.tolist() for column in columns))):
        groups.setdefault(key, []).append(row)
    return groups


class TorchSampling(Sampling):
    """0.19's ``TorchSampling(rng, vocab_size)``: temperature, then top-k or top-p filtering,
    then ``torch.multinomial`` with ``rng``; one launch set per distinct parameter triple.

    Args:
        rng: the ``torch.Generator`` every draw uses.
        vocab_size: the real vocabulary (sampled ids are clamped below it; top-k must stay
            under it), or None/0 for the logits' width.
    """

    def __init__(self, rng: torch.Generator, vocab_size: int) -> None:
        if not isinstance(rng, torch.Generator):
            raise TypeError(f"rng must be a torch.Generator, got {type(rng).__name__}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(
                vocab_size, int) or vocab_size < 0):
            raise ValueError(f"vocab_size={vocab_size!r} must be None or an int >= 0")
        self._rng = rng
        self._vocab_size = vocab_size

    @staticmethod
    def _modify_logits_for_top_k_filtering(logits: Tensor, top_k: int) -> None:
        """In place: every logit below the row's ``top_k``-th largest becomes -inf."""
        kth = torch.topk(logits, top_k)[0][..., -1, None]
        logits.masked_fill_(logits < kth, float("-inf"))

    @staticmethod
    def _modify_logits_for_top_p_filtering(logits: Tensor, top_p: float) -> None:
        """In place: keep the smallest set of largest logits whose probability reaches
        ``top_p`` (the first one always kept); the rest become -inf."""
        ordered, order = torch.sort(logits, descending=True)
        beyond = ordered.softmax(dim=-1).cumsum(dim=-1) > top_p
        # A token is dropped when the mass before it already exceeds top_p.
        drop = torch.zeros_like(beyond)
        drop[:, 1:] = beyond[:, :-1]
        logits.masked_fill_(drop.scatter(1, order, drop), float("-inf"))

    @staticmethod
    def filter_logits(last_token_logits: Tensor, temperature: float, top_k: int, top_p: float,
                      *, vocab_size: Optional[int] = None) -> Tensor:
        """A filtered copy of ``last_token_logits`` ``[rows, vocab]``: divided by
        ``temperature`` (unless 1), then top-k (``top_k >= 1``) or top-p (``top_p > 0``)
        filtering, filtered entries -inf. Both filters at once raise ``AssertionError`` (0.19's
        asserts, as are ``top_p > 1`` and a ``top_k`` beyond the logits or the vocabulary)."""
        assert not (top_k > 0 and top_p > 0.0), "Cannot have top-p and top-k both greater than zero"
        assert top_p <= 1.0, "top-p should be in (0,1]"
        _check_filter(last_token_logits, temperature, top_k, top_p)
        logits = last_token_logits.clone()
        if temperature != 1.0:
            logits.div_(temperature)
        if top_k >= 1:
            assert top_k <= logits.size(1), "top-k is larger than logit size."
            if vocab_size:
                assert top_k < vocab_size, "top-k is larger than vocab size."
            TorchSampling._modify_logits_for_top_k_filtering(logits, top_k)
        elif top_p > 0.0:
            TorchSampling._modify_logits_for_top_p_filtering(logits, top_p)
        return logits

    @staticmethod
    def sample_from_logits(last_token_logits: Tensor, temperature: float, top_k: int,
                           top_p: float, *, generator: torch.Generator,
                           vocab_size: Optional[int] = None) -> Tensor:
        """``[rows]`` ids drawn from the filtered distribution of each row (``top_k == 1``:
        the argmax, no draw); clamped to ``[0, vocab_size)`` when ``vocab_size`` is given."""
        assert isinstance(top_p, float)
        assert isinstance(top_k, int)
        assert not (top_k > 0 and top_p > 0.0), "Cannot have top-p and top-k both greater than zero"
        assert top_p <= 1.0, "top-p should be in (0,1]"
        if top_k == 1:
            return torch.argmax(last_token_logits, dim=-1)
        filtered = TorchSampling.filter_logits(last_token_logits, temperature, top_k, top_p,
                                               vocab_size=vocab_size)
        sampled = torch.multinomial(filtered.softmax(dim=-1), num_samples=1,
                                    generator=generator).view(-1)
        return sampled.clamp(0, vocab_size - 1) if vocab_size else sampled

    def log_probs_kernel(self, logits: Tensor, context, *,
                         token_to_request_index: Optional[Tensor] = None) -> Tensor:
        """``[rows, vocab]``: the log-softmax of each row of ``logits`` after its request's
        filtering (``filter_logits``); row ``i`` belongs to active request ``i`` or to
        ``token_to_request_index[i]`` (a CPU tensor)."""
        groups = _groups(context, token_to_request_index)
        _check_rows("logits", logits.shape[0], context, token_to_request_index)
        out = torch.empty_like(logits)
        for (temperature, top_k, top_p), rows in groups.items():
            index = torch.tensor(rows, device=logits.device, dtype=torch.long)
            filtered = TorchSampling.filter_logits(logits[index], float(temperature), int(top_k),
                                                   float(top_p), vocab_size=self._vocab_size)
            out[index] = torch.log_softmax(filtered, dim=-1)
        return out

    def sample_kernel(self, logits: Tensor, n: int, context, *, no_top_k: bool, no_top_p: bool,
                      gather_indices: Optional[Tensor] = None,
                      token_to_request_index: Optional[Tensor] = None,
                      output: Optional[Tensor] = None, eager: bool = False,
                      cache_key: Any = None) -> Tensor:
        """``[n]`` ids, one per row (``output`` if given, else new): each active request's
        parameter group sampled at once (``token_to_request_index``: per token, for
        speculative verification). ``no_top_k``, ``no_top_p``, ``eager`` and ``cache_key``
        are accepted as 0.19's contract has them and change nothing here."""
        del no_top_k, no_top_p, eager, cache_key
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n={n!r} must be an int")
        _check_rows("n", n, context, token_to_request_index)
        if output is not None and (not isinstance(output, Tensor) or output.dim() != 1
                                   or output.shape[0] < n or output.dtype not in _INDEX_DTYPES):
            raise ValueError(f"output must be an integer tensor [>= n={n}], got "
                             f"{_describe(output)}")
        if gather_indices is not None:
            logits = logits[gather_indices[:n]]
        if output is None:
            output = torch.empty(n, device=logits.device, dtype=torch.int64)
        for (temperature, top_k, top_p), rows in _groups(context, None).items():
            requests = torch.tensor(rows, dtype=torch.long)
            if token_to_request_index is None:
                index = requests.to(logits.device)
            else:
                index = torch.nonzero(torch.isin(token_to_request_index.cpu(), requests))[:, 0]
                index = index.to(logits.device)
            output[index] = TorchSampling.sample_from_logits(
                logits[index], float(temperature), int(top_k), float(top_p),
                generator=self._rng, vocab_size=self._vocab_size)
        return output


_INDEX_DTYPES = (torch.int32, torch.int64)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def _check_rows(name: str, rows: int, context, token_to_request_index: Optional[Tensor]) -> None:
    """A row per active request, or per entry of ``token_to_request_index``: a row beyond them
    would be handed back unwritten (``ValueError`` naming ``name``)."""
    active = int(context.total_request_count) - int(context.paused_request_count)
    want = active if token_to_request_index is None else token_to_request_index.numel()
    if rows != want:
        what = "active requests" if token_to_request_index is None else \
            "entries of token_to_request_index"
        raise ValueError(f"{name} gives {rows} rows, the {what} {want} (each row is written "
                         "once)")


def _check_filter(logits: Tensor, temperature: float, top_k: int, top_p: float) -> None:
    """``filter_logits``' arguments beyond 0.19's asserts, before anything is computed."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"last_token_logits must be a floating [rows, vocab] tensor, got "
                         f"{_describe(logits)}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0: no top-k)")
    if not isinstance(top_p, (int, float)) or not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must lie in [0, 1] (0: no top-p)")
