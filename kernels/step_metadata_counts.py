"""Step metadata's host counts: the checks of them, a launch's grid and count arguments, and
the classes its launch plans are keyed on.

``step_metadata``'s counts change from step to step (a mixed step's tokens, the paused rows'
offset), and its kernel takes them all as ``do_not_specialize`` arguments: they pick its
config only through ``bucket_tokens`` of the padded tokens and of the requests and whether a
prefill row is there, and otherwise only its grid and its count arguments. So its plan key
(``launch_plan.py``) holds ``count_classes(...)``, and a plan (``launch_plan.CountPlan``)
keeps a launch per tuple of counts: the first from the full path, the others from
``vary_step``, which checks the counts as the full path does (``check_step``, where the
caller asked for checks) and varies the first launch to their grid and arguments
(``grid_and_sizes``, which the full path uses too).
"""

from __future__ import annotations

import torch

from ._common import check_tensor, check_writable
from .launch_plan import count_class

TOKEN_OUTPUTS = ("token_to_input_ids", "token_to_pos_ids", "token_to_request_idx",
                 "token_to_block_idx", "token_to_position_in_request",
                 "token_to_local_position_within_kv_block")


def count_classes(num_requests, num_decode, active_tokens, padded_tokens, padded_requests,
                  row_offset) -> tuple:
    """The plan key's stand-ins for the counts: the buckets of the padded tokens and of the
    requests, whether a prefill row is there, whether any padded request is (an empty step
    launches nothing); the counts themselves where one is not a plain int. Every call asks,
    mostly with the last call's count objects: the last answer is kept for them."""
    global _LAST_CLASSES
    last = _LAST_CLASSES
    if (padded_tokens is last[0] and num_requests is last[1] and num_decode is last[2]
            and padded_requests is last[3] and active_tokens is last[4]
            and row_offset is last[5]):
        return last[6]
    if (type(num_requests) is type(num_decode) is type(active_tokens) is type(padded_tokens)
            is type(padded_requests) is type(row_offset) is int):
        classes = (count_class(padded_tokens), count_class(num_requests),
                   num_requests > num_decode, count_class(padded_requests))
        # (One tuple, read and written whole: another thread sees this answer or the last.)
        _LAST_CLASSES = (padded_tokens, num_requests, num_decode, padded_requests,
                         active_tokens, row_offset, classes)
        return classes
    return num_requests, num_decode, active_tokens, padded_tokens, padded_requests, row_offset


_LAST_CLASSES = (None,) * 7


def grid_and_sizes(num_requests, num_decode, active_tokens, padded_tokens, padded_requests,
                    row_offset, block_t) -> tuple[tuple, dict]:
    """The grid and the count arguments of a launch: the four segments' programs."""
    num_prefill = num_requests - num_decode
    num_decode_programs = -(-num_decode // block_t)
    num_prefill_programs = -(-(active_tokens - num_decode) // block_t) if num_prefill else 0
    num_pad_programs = -(-(padded_tokens - active_tokens) // block_t)
    grid = (num_decode_programs + num_prefill_programs + num_pad_programs + padded_requests,)
    return grid, dict(
        num_requests=num_requests, num_decode=num_decode, active_tokens=active_tokens,
        padded_tokens=padded_tokens, padded_requests=padded_requests,
        num_decode_programs=num_decode_programs, num_prefill_programs=num_prefill_programs,
        num_pad_programs=num_pad_programs,
        num_search_steps=(num_prefill - 1).bit_length() if num_prefill else 0,
        row_offset=int(row_offset))


def vary_step(launch, check: bool, block_size: int, counts: tuple, tensors: tuple):
    """A plan's launch for other counts (``CountPlan``): checked as the full path checks them,
    or None (the full path: a count of another type)."""
    if not all(type(count) is int for count in counts):
        return None
    if check:
        check_step(tensors, *counts[:5], block_size)
    grid, sizes = grid_and_sizes(*counts, launch.kwargs["BLOCK_T"])
    return launch.varied(grid, **sizes)


def check_step(tensors, num_requests, num_decode, active_tokens, padded_tokens,
               padded_requests, block_size) -> None:
    """step_metadata's checks (``tensors`` as it lays them out), raising ValueError."""
    (*token_outputs, attn_block_table, next_tokens, prompt_tokens, block_table, kv_offsets,
     cu_query_lengths, query_lengths) = tensors
    device = block_table.device if isinstance(block_table, torch.Tensor) else None
    if not 0 <= num_decode <= num_requests:
        raise ValueError(f"num_decode={num_decode} must be in [0, num_requests={num_requests}]")
    if not 0 <= active_tokens <= padded_tokens:
        raise ValueError(f"active_tokens={active_tokens} and padded_tokens={padded_tokens} "
                         "must satisfy 0 <= active_tokens <= padded_tokens")
    if padded_requests < num_requests:
        raise ValueError(f"padded_requests={padded_requests} < num_requests={num_requests}")
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    check_tensor("block_table", block_table, dims=2, dtypes=(torch.int32,), device=device,
                 min_rows=num_requests, device_of="block_table")
    for name, out in zip(TOKEN_OUTPUTS, token_outputs):
        check_tensor(name, out, dims=1, dtypes=(torch.int64,), device=device,
                     min_rows=padded_tokens, device_of="block_table")
    check_tensor("attn_block_table", attn_block_table, dims=2, dtypes=(torch.int32,),
                 device=device, min_rows=padded_requests, device_of="block_table")
    if attn_block_table.shape[1] != block_table.shape[1]:
        raise ValueError(f"attn_block_table has {attn_block_table.shape[1]} columns, "
                         f"block_table {block_table.shape[1]}")
    for name, tensor, dtypes, rows in (
            ("query_lengths", query_lengths, (torch.int32,), num_requests),
            ("kv_offsets", kv_offsets, (torch.int32,), num_requests),
            ("cu_query_lengths", cu_query_lengths, (torch.int32,), num_requests + 1),
            ("next_tokens", next_tokens, (torch.int64, torch.int32), num_requests),
            ("prompt_tokens", prompt_tokens, (torch.int64, torch.int32),
             max(active_tokens - num_decode, 0))):
        check_tensor(name, tensor, dims=1, dtypes=dtypes, device=device, min_rows=rows,
                     device_of="block_table")
    check_writable(*((name, out[:padded_tokens])
                     for name, out in zip(TOKEN_OUTPUTS, token_outputs)),
                   ("attn_block_table", attn_block_table[:padded_requests]))
