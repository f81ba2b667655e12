"""Checks of the tensors a caller hands the context, at its edge (once per call).

Each raises ``TypeError``/``ValueError`` naming the argument, the value and the limit, and
returns the tensor in the form the kernels take (a contiguous view or copy, detached), so
that the context can call its launchers without their own checks.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from dynctx.kernels.devices import same_device

from .errors import StepShapeError

TOKEN_DTYPES = (torch.int32, torch.int64)


def check_new_tokens(new_tokens, count: int, device: torch.device, *, validate: bool,
                     vocab_size: Optional[int]) -> torch.Tensor:
    """``new_tokens``: int32/int64 ``[count]`` on ``device``. Narrower integer dtypes (uint8,
    int8, int16) are refused: no vocabulary fits them, so they are a bug (a mask passed as
    tokens, say), not a token list. Returns a contiguous tensor that needs no gradient (a
    strided view is copied)."""
    if not (isinstance(new_tokens, torch.Tensor) and new_tokens.dtype in TOKEN_DTYPES
            and new_tokens.dim() == 1 and new_tokens.shape[0] == count
            and same_device(new_tokens.device, device)):
        _refuse_new_tokens(new_tokens, count, device)
    if validate:
        check_token_ids("new_tokens", new_tokens, vocab_size)
    if new_tokens.requires_grad or not new_tokens.is_contiguous():
        return new_tokens.detach().contiguous()
    return new_tokens


def _refuse_new_tokens(new_tokens, count: int, device: torch.device) -> None:
    """Raise the error that says what is wrong with ``new_tokens`` (``check_new_tokens``)."""
    if not isinstance(new_tokens, torch.Tensor):
        raise TypeError(f"new_tokens must be a torch.Tensor, got {type(new_tokens).__name__}")
    if new_tokens.is_floating_point() or new_tokens.is_complex() or new_tokens.dtype == torch.bool:
        raise TypeError(f"new_tokens must hold integer token ids, got dtype {new_tokens.dtype}")
    if new_tokens.dtype not in TOKEN_DTYPES:
        raise TypeError(f"new_tokens must be int32 or int64 token ids, got dtype "
                        f"{new_tokens.dtype} (no vocabulary fits it)")
    if new_tokens.dim() != 1 or new_tokens.shape[0] != count:
        raise StepShapeError(f"new_tokens must have shape [{count}] (one per active request), got "
                         f"{tuple(new_tokens.shape)}")
    raise ValueError(f"new_tokens is on {new_tokens.device}, the context on {device}")


def read_mask(mask, count: int, device: torch.device) -> Optional[np.ndarray]:
    """``active_requests_mask`` (bool, or integers or floats of exactly 0 and 1, ``[count]``)
    read to the host: the step's one device-to-host read. Returns None when it keeps every
    request (the common step: a bool or one-byte mask of all ones is seen in one memcmp), else
    the host bool mask. A CPU mask is taken for a context on any device: the caller knows
    it on the host, and reading it waits for nothing (async scheduling, engine/overlap.py);
    a device mask waits for the device's queue. A wrong length raises ``StepShapeError`` (a
    ``ValueError`` and an ``AssertionError``, as Megatron-Core asserts)."""
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 1 and mask.shape[0] == count
            and not mask.is_complex() and (mask.is_cpu or same_device(mask.device, device))):
        _refuse_mask(mask, count, device)
    host = (mask if mask.is_cpu else mask.cpu()).numpy()
    if host.itemsize == 1 and host.tobytes() == b"\x01" * count:
        return None
    if host.dtype == np.bool_:
        return None if np.count_nonzero(host) == count else host.copy()
    # Megatron-Core's tests pass float masks (torch.Tensor([0, 1])); only 0 and 1 mean
    # anything, NaN and fractions are refused.
    ones = host == 1
    if np.count_nonzero(ones) == count:
        return None
    bad = ~ones & (host != 0)
    if bad.any():
        raise ValueError(f"active_requests_mask must hold only 0 and 1, got "
                         f"{host[bad][:4].tolist()}")
    return ones


def _refuse_mask(mask, count: int, device: torch.device) -> None:
    """Raise the error that says what is wrong with ``active_requests_mask``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"active_requests_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 1 or mask.shape[0] != count:
        raise StepShapeError(f"active_requests_mask must have shape [{count}] (one per active "
                         f"request), got {tuple(mask.shape)}")
    if mask.is_complex():
        raise TypeError(f"active_requests_mask must be bool, integer or 0/1 floats, got "
                        f"{mask.dtype}")
    raise ValueError(f"active_requests_mask is on {mask.device}, the context on {device}")


def check_step_tensor(name: str, tensor, n: int, device: torch.device, dtype: torch.dtype,
                      rest: Optional[tuple] = None, layout: str = "") -> torch.Tensor:
    """A per-token tensor of the step: ``[>= n, *rest]`` or ``[>= n, 1, *rest]`` of ``dtype``
    on ``device``; returns the ``[>= n, *rest]`` view, detached (the cache never keeps an
    autograd graph)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not same_device(tensor.device, device):
        raise ValueError(f"{name} is on {tensor.device}, the context on {device}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}, the cache {dtype}")
    if tensor.dim() == 0 or tensor.shape[0] < n:
        raise ValueError(f"{name} has {tensor.shape[0] if tensor.dim() else 0} tokens, the step "
                         f"has {n} (padded_active_token_count)")
    if rest is not None:
        view = tensor[:, 0] if tensor.dim() == len(rest) + 2 and tensor.shape[1] == 1 else tensor
        if tuple(view.shape[1:]) != tuple(rest):
            raise ValueError(f"{name} must be [n, {layout}] or [n, 1, {layout}] = "
                             f"{list(rest)}, got shape {tuple(tensor.shape)}")
        tensor = view
    return tensor.detach()


def check_logits(logits, device: torch.device, vocab_size: Optional[int],
                 name: str = "logits") -> torch.Tensor:
    """``logits``: floating ``[1, tokens, vocab]`` or ``[tokens, vocab]`` on ``device`` (with
    ``vocab_size``: that many columns); returns the 2-D view."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"{name} must be [1, tokens, vocab], got {tuple(logits.shape)}")
        logits = logits[0]
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating [1, tokens, vocab] or [tokens, vocab] "
                         f"tensor, got {tuple(logits.shape)} {logits.dtype}")
    if not same_device(logits.device, device):
        raise ValueError(f"{name} is on {logits.device}, the context on {device}")
    if logits.shape[1] == 0:
        raise ValueError(f"{name} has no vocabulary columns (shape {tuple(logits.shape)}): a "
                         "token needs at least one logit")
    if vocab_size is not None and logits.shape[1] != vocab_size:
        raise ValueError(f"{name} has {logits.shape[1]} vocabulary columns, vocab_size is "
                         f"{vocab_size}")
    return logits


def check_finite(name: str, rows: torch.Tensor) -> None:
    """No NaN or +inf in ``rows`` (one read-back; -inf stays legal: it masks tokens); the
    context calls it with ``validate`` on, over the real (not padding) rows used."""
    if rows.numel() and bool((rows.isnan() | rows.isposinf()).any()):
        raise ValueError(f"{name} holds NaN or +inf values in the rows of real tokens "
                         "(validate=True)")


def check_rope_call(name: str, tensor, n: int, device: torch.device,
                    table_name: str = "", table=None, max_position: int = 0) -> None:
    """A rope call's tensor (``[>= n, ...]``) and angle or cos/sin table (more than
    ``max_position`` rows), both on ``device``."""
    for arg, value in ((name, tensor), (table_name, table)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(value).__name__}")
        if not same_device(value.device, device):
            raise ValueError(f"{arg} is on {value.device}, the context on {device}")
    if tensor.shape[0] < n:
        raise ValueError(f"{name} has {tensor.shape[0]} tokens, the step has {n}")
    if table is not None and table.shape[0] <= max_position:
        raise ValueError(f"{table_name} has {table.shape[0]} positions, the step reaches "
                         f"position {max_position}")


def row_indices(name: str, idxs, rows: int) -> np.ndarray:
    """``idxs`` (tensor on any device, array or sequence of ints) as int64 row numbers in
    ``[0, rows)``."""
    if isinstance(idxs, torch.Tensor):
        if idxs.is_floating_point() or idxs.is_complex() or idxs.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer row indices, got {idxs.dtype}")
        idxs = idxs.detach().cpu().numpy()
    array = np.asarray(idxs)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer row indices, got {array.dtype}")
    array = array.astype(np.int64).reshape(-1)
    if array.size and (array.min() < 0 or array.max() >= rows):
        raise ValueError(f"{name} holds rows {array[(array < 0) | (array >= rows)].tolist()}"
                         f" outside [0, {rows})")
    return array


def check_row_moves(src_idxs, dst_idxs, next_tokens, swap: bool, rows: int,
                    new_speculative_tokens=None) -> tuple:
    """``(dst, src)``: the rows that take and the rows they take from, of Megatron-Core's
    ``_move_book_keeping_tensors`` (``swap=False``) or ``_swap_book_keeping_tensors`` (both
    ways); ``next_tokens`` None or a 1-D tensor that holds every row moved, and
    ``new_speculative_tokens`` None or a 2-D ``[k, rows]`` tensor that does (0.19)."""
    src = row_indices("src_idxs", src_idxs, rows)
    dst = row_indices("dst_idxs", dst_idxs, rows)
    if src.size != dst.size:
        raise ValueError(f"src_idxs has {src.size} rows, dst_idxs {dst.size}")
    touched = np.concatenate([src, dst]) if swap else dst
    if np.unique(touched).size != touched.size:
        raise ValueError(f"{'src_idxs and dst_idxs' if swap else 'dst_idxs'} must be "
                         f"distinct rows, got src {src.tolist()}, dst {dst.tolist()}")
    if next_tokens is not None:
        if not isinstance(next_tokens, torch.Tensor) or next_tokens.dim() != 1:
            raise TypeError(f"next_tokens must be a 1-D tensor or None, got "
                            f"{type(next_tokens).__name__}")
        if touched.size and next_tokens.shape[0] <= touched.max():
            raise ValueError(f"next_tokens has {next_tokens.shape[0]} rows; the rows moved "
                             f"reach {int(touched.max())}")
    drafts = new_speculative_tokens
    if drafts is not None:
        if not isinstance(drafts, torch.Tensor) or drafts.dim() != 2:
            raise TypeError(f"new_speculative_tokens must be a 2-D tensor [k, rows] or None, got "
                            f"{type(drafts).__name__}" + (f" of shape {tuple(drafts.shape)}"
                                                          if isinstance(drafts, torch.Tensor)
                                                          else ""))
        if touched.size and drafts.shape[1] <= touched.max():
            raise ValueError(f"new_speculative_tokens has {drafts.shape[1]} rows; the rows "
                             f"moved reach {int(touched.max())}")
    if swap:
        return np.concatenate([dst, src]), np.concatenate([src, dst])
    return dst, src


def check_chunked_id(value, last: Optional[int], active: int) -> int:
    """A value written to ``chunked_prefill_request_id``: -1, or ``last``, the id in the last
    active row (where a chunked prefill always is once its chunk is added); anything else is
    refused before it is kept (``update_requests`` would raise on it every step)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"chunked_prefill_request_id={value!r} must be an int")
    if value != -1 and value != last:
        held = ("no active request" if last is None else
                f"{active} active requests, the last active row holding request {last}")
        raise ValueError(
            f"chunked_prefill_request_id={value} is not a request the context can be chunking: "
            f"it holds {held} (a chunked prefill is always the last active row once its chunk "
            "is added); set it to -1" + ("" if last is None else f" or {last}"))
    return int(value)


def check_paused_tokens(tokens, paused: int) -> None:
    """Tokens written to ``paused_tokens``: a 1-D integer tensor of at most ``paused`` ids."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or \
            tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"paused_tokens must be a 1-D integer tensor of token ids, got "
                        f"{tokens!r}")
    if tokens.numel() > paused:
        raise ValueError(f"paused_tokens has {tokens.numel()} tokens, more than "
                         f"paused_request_count={paused}")


def check_request_limit(value, total: int, rows: int) -> int:
    """A value written to ``max_requests``: an int in ``[max(1, total), rows]`` (the requests
    in the context, the rows allocated)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"max_requests={value!r} must be an int")
    if not max(1, total) <= value <= rows:
        raise ValueError(f"max_requests={value} must lie in [max(1, total_request_count="
                         f"{total}), {rows}] (the rows allocated)")
    return int(value)


def host_integers(values, name: str) -> np.ndarray:
    """``values`` as a host integer array: a tensor on any device (read once), a numpy array
    or a list. ``TypeError`` naming ``name`` for anything but integers (floats, bools,
    complex, ragged lists), ``ValueError`` for a tensor without data (``meta``)."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {values.dtype}")
        if values.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (a tensor without data)")
        return values.detach().cpu().numpy()
    try:
        array = np.asarray(values)
    except ValueError as error:   # a ragged list
        raise TypeError(f"{name} must be integers of one shape ({error})") from None
    if array.dtype.kind not in "iu" and array.size:
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def check_token_ids(name: str, tokens: torch.Tensor, vocab_size: Optional[int]) -> None:
    """``validate``: every id of ``tokens`` (the ids a step will forward) in ``[0,
    vocab_size)`` (``[0, inf)`` without a vocabulary); one read of the tensor."""
    if tokens.numel():
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            raise ValueError(f"{name} holds ids in [{low}, {high}], outside [0, "
                             f"{'inf' if vocab_size is None else vocab_size}) (vocab_size)")


def reset_flags(preserve_prefix_cache, preserve_counters) -> bool:
    """``reset``'s flags are bools (``TypeError`` naming the flag: ``"no"`` would keep the
    cache); returns ``preserve_prefix_cache``."""
    for name, value in (("preserve_prefix_cache", preserve_prefix_cache),
                        ("preserve_counters", preserve_counters)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"reset({name}={value!r}): {name} must be a bool")
    return bool(preserve_prefix_cache)


def check_block_routing(block_id, positions, routing, *, block_size: int, blocks: int,
                        existing: Optional[np.ndarray]) -> np.ndarray:
    """``store_block_routing``'s arguments, before its block's entry is made: ``block_id`` an
    int in ``[0, blocks)`` (the dummy block has none), ``positions`` integers in
    ``[0, block_size)``, ``routing`` a numpy ``[len(positions), layers, topk]`` whose
    ``[layers, topk]`` is the block's entry's; returns ``positions`` as an int64 array."""
    if isinstance(block_id, (bool, np.bool_)) or not isinstance(block_id, (int, np.integer)):
        raise TypeError(f"block_id={block_id!r} must be an int")
    if not 0 <= block_id < blocks:
        raise ValueError(f"block_id={block_id} must lie in [0, {blocks}) (the dummy block has "
                         "no routing)")
    where = np.asarray(positions)
    if where.dtype.kind not in "iu" and where.size:
        raise TypeError(f"positions must hold integers, got dtype {where.dtype}")
    where = where.astype(np.int64, copy=False).reshape(-1)
    if np.any((where < 0) | (where >= block_size)):
        raise ValueError(f"positions={where.tolist()}: each must lie in [0, block_size_tokens="
                         f"{block_size})")
    if not isinstance(routing, np.ndarray) or routing.ndim != 3 or routing.shape[0] != where.size:
        got = routing.shape if isinstance(routing, np.ndarray) else type(routing).__name__
        raise ValueError(f"routing must be a numpy array [len(positions)={where.size}, layers, "
                         f"topk], got {got}")
    if existing is not None and existing.shape[1:] != routing.shape[1:]:
        raise ValueError(f"routing has [layers, topk]={list(routing.shape[1:])}, block "
                         f"{block_id}'s routing {list(existing.shape[1:])}")
    return where
