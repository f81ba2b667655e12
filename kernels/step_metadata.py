"""Per-token metadata of a step, built from the per-request rows in one launch.

For request ``i < num_requests`` and ``j < query_lengths[i]``, token ``t = cu_query_lengths[i] +
j`` sits at position ``pos = kv_offsets[i] + j`` and gets:

* ``token_to_input_ids[t]``: ``next_tokens[i]`` for a decode row (``i < num_decode``), else
  ``prompt_tokens[t - num_decode]``;
* ``token_to_pos_ids[t] = token_to_position_in_request[t] = pos``;
* ``token_to_request_idx[t] = row_offset + i`` (the absolute row, paused rows included);
* ``token_to_block_idx[t] = block_table[i, pos // block_size]``;
* ``token_to_local_position_within_kv_block[t] = pos % block_size``.

Padding tokens ``[active_tokens, padded_tokens)`` get input id 0, position 0, request -1,
block ``dummy_block`` and slot 0. ``attn_block_table`` receives the active rows of the block
table and -1 rows up to ``padded_requests``. Tokens from ``padded_tokens`` and rows from
``padded_requests`` on are untouched.

Decode rows hold one token each (``cu_query_lengths[i] = i`` for ``i <= num_decode``), as the
indexing of ``prompt_tokens`` implies. One launch, a 1-D grid of four segments, every program
busy: decode programs take ``BLOCK_T`` decode rows each; prefill programs take ``BLOCK_T``
prefill tokens each and find each token's request by a binary search of
``cu_query_lengths[num_decode:num_requests + 1]`` (``ceil(log2(prefill rows))`` steps, host
counted, so nothing syncs); padding programs take ``BLOCK_T`` padding tokens; table programs
copy (or clear) one row of ``attn_block_table`` in ``BLOCK_C`` column tiles.
"""

from __future__ import annotations

import functools

import torch

from . import autotune
from ._common import custom_op
from ._shapes import BLOCK_SIZE
from .autotune import KernelConfig, KernelTuning, TuneCase, bucket_tokens
from .backend import HAS_TRITON, resolve_backend
from .launch_plan import CountPlan, KernelLaunch, PlanCache
from .step_metadata_counts import (
    TOKEN_OUTPUTS,
    check_step,
    count_classes,
    grid_and_sizes,
    vary_step,
)

if HAS_TRITON:
    import triton
    import triton.language as tl


# The kernel's stride argument of each TOKEN_OUTPUTS entry, in the same order.
_OUTPUT_STRIDES = ("input_ids", "pos_ids", "request_idx", "block_idx", "position", "local_slot")
# The kernel's pointers, in the order step_metadata passes them; its plans (launch_plan.py).
_POINTERS = (*(short + "_ptr" for short in _OUTPUT_STRIDES), "attn_block_table_ptr",
             "next_tokens_ptr", "prompt_tokens_ptr", "block_table_ptr", "kv_offsets_ptr",
             "cu_query_lengths_ptr")
_PLANS = PlanCache("step_metadata")


if HAS_TRITON:

    @triton.jit
    def _store_token_outputs(
        input_ids_ptr, pos_ids_ptr, request_idx_ptr, block_idx_ptr, position_ptr, local_slot_ptr,
        stride_input_ids, stride_pos_ids, stride_request_idx, stride_block_idx, stride_position,
        stride_local_slot,
        tokens, input_ids, positions, request_idx, blocks, local_slots, mask,
    ):
        """Store one tile of the six per-token arrays, each through its own stride."""
        tl.store(input_ids_ptr + tokens * stride_input_ids, input_ids, mask=mask)
        tl.store(pos_ids_ptr + tokens * stride_pos_ids, positions, mask=mask)
        tl.store(request_idx_ptr + tokens * stride_request_idx, request_idx, mask=mask)
        tl.store(block_idx_ptr + tokens * stride_block_idx, blocks, mask=mask)
        tl.store(position_ptr + tokens * stride_position, positions, mask=mask)
        tl.store(local_slot_ptr + tokens * stride_local_slot, local_slots, mask=mask)

    @triton.jit
    def _store_token_metadata(
        input_ids_ptr, pos_ids_ptr, request_idx_ptr, block_idx_ptr, position_ptr, local_slot_ptr,
        stride_input_ids, stride_pos_ids, stride_request_idx, stride_block_idx, stride_position,
        stride_local_slot,
        block_table_ptr, tokens, requests, positions, input_ids, mask,
        row_offset, block_size, max_blocks, stride_table_row, stride_table_col,
    ):
        """Write the six per-token arrays for a tile of real tokens."""
        block_cols = positions // block_size
        # A position past the table reads nothing (the reference raises instead).
        blocks = tl.load(block_table_ptr + requests * stride_table_row
                         + block_cols * stride_table_col,
                         mask=mask & (block_cols < max_blocks), other=-1).to(tl.int64)
        _store_token_outputs(input_ids_ptr, pos_ids_ptr, request_idx_ptr, block_idx_ptr,
                             position_ptr, local_slot_ptr, stride_input_ids, stride_pos_ids,
                             stride_request_idx, stride_block_idx, stride_position,
                             stride_local_slot, tokens, input_ids, positions,
                             requests + row_offset, blocks, positions % block_size, mask)

    # Counts change every step; the context passes views from the first active row, whose
    # alignment changes with the paused count: specialising on either would recompile mid-run.
    @triton.jit(do_not_specialize=["num_requests", "num_decode", "active_tokens", "padded_tokens",
                                   "padded_requests", "num_decode_programs",
                                   "num_prefill_programs", "num_pad_programs", "num_search_steps",
                                   "row_offset"],
                do_not_specialize_on_alignment=["block_table_ptr", "kv_offsets_ptr",
                                                "next_tokens_ptr"])
    def _step_metadata_kernel(
        input_ids_ptr, pos_ids_ptr, request_idx_ptr, block_idx_ptr, position_ptr, local_slot_ptr,
        attn_block_table_ptr,
        next_tokens_ptr, prompt_tokens_ptr,
        block_table_ptr, kv_offsets_ptr, cu_query_lengths_ptr,
        num_requests, num_decode, active_tokens, padded_tokens, padded_requests,
        num_decode_programs, num_prefill_programs, num_pad_programs, num_search_steps,
        row_offset, block_size, dummy_block, max_blocks,
        stride_attn_row, stride_attn_col, stride_table_row, stride_table_col,
        stride_input_ids, stride_pos_ids, stride_request_idx, stride_block_idx, stride_position,
        stride_local_slot,
        stride_next_tokens, stride_prompt_tokens, stride_kv_offsets, stride_cu,
        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """Segments of the 1-D grid: decode rows, prefill tokens, padding tokens, table rows."""
        pid = tl.program_id(0)
        prefill_start = num_decode_programs
        pad_start = prefill_start + num_prefill_programs
        table_start = pad_start + num_pad_programs
        offs_t = tl.arange(0, BLOCK_T)
        if pid < prefill_start:
            # [BLOCK_T] decode rows, one token each.
            requests = pid.to(tl.int64) * BLOCK_T + offs_t
            mask = requests < num_decode
            tokens = tl.load(cu_query_lengths_ptr + requests * stride_cu, mask=mask,
                             other=0).to(tl.int64)
            positions = tl.load(kv_offsets_ptr + requests * stride_kv_offsets, mask=mask,
                                other=0).to(tl.int64)
            input_ids = tl.load(next_tokens_ptr + requests * stride_next_tokens, mask=mask,
                                other=0).to(tl.int64)
            _store_token_metadata(input_ids_ptr, pos_ids_ptr, request_idx_ptr, block_idx_ptr,
                                  position_ptr, local_slot_ptr, stride_input_ids, stride_pos_ids,
                                  stride_request_idx, stride_block_idx, stride_position,
                                  stride_local_slot, block_table_ptr, tokens, requests,
                                  positions, input_ids, mask, row_offset, block_size, max_blocks,
                                  stride_table_row, stride_table_col)
        elif pid < pad_start:
            # [BLOCK_T] prefill tokens; each token's request i has cu[i] <= token < cu[i + 1].
            tokens = num_decode + (pid - prefill_start).to(tl.int64) * BLOCK_T + offs_t
            mask = tokens < active_tokens
            low = tl.zeros([BLOCK_T], dtype=tl.int64) + num_decode
            high = tl.zeros([BLOCK_T], dtype=tl.int64) + num_requests
            first_token = (tl.zeros([BLOCK_T], dtype=tl.int64)
                           + tl.load(cu_query_lengths_ptr + num_decode * stride_cu))
            # While loops, not range(): Triton 3.6's interpreter cannot take runtime bounds there.
            step = 0
            while step < num_search_steps:
                middle = (low + high) // 2
                middle_first = tl.load(cu_query_lengths_ptr + middle * stride_cu, mask=mask,
                                       other=0).to(tl.int64)
                right = middle_first <= tokens
                low = tl.where(right, middle, low)
                first_token = tl.where(right, middle_first, first_token)
                high = tl.where(right, high, middle)
                step += 1
            kv_offset = tl.load(kv_offsets_ptr + low * stride_kv_offsets, mask=mask,
                                other=0).to(tl.int64)
            positions = kv_offset + tokens - first_token
            input_ids = tl.load(prompt_tokens_ptr + (tokens - num_decode) * stride_prompt_tokens,
                                mask=mask, other=0).to(tl.int64)
            _store_token_metadata(input_ids_ptr, pos_ids_ptr, request_idx_ptr, block_idx_ptr,
                                  position_ptr, local_slot_ptr, stride_input_ids, stride_pos_ids,
                                  stride_request_idx, stride_block_idx, stride_position,
                                  stride_local_slot, block_table_ptr, tokens, low,
                                  positions, input_ids, mask, row_offset, block_size, max_blocks,
                                  stride_table_row, stride_table_col)
        elif pid < table_start:
            # [BLOCK_T] padding tokens.
            tokens = active_tokens + (pid - pad_start).to(tl.int64) * BLOCK_T + offs_t
            mask = tokens < padded_tokens
            zeros = tl.zeros([BLOCK_T], dtype=tl.int64)
            _store_token_outputs(input_ids_ptr, pos_ids_ptr, request_idx_ptr, block_idx_ptr,
                                 position_ptr, local_slot_ptr, stride_input_ids, stride_pos_ids,
                                 stride_request_idx, stride_block_idx, stride_position,
                                 stride_local_slot, tokens, zeros, zeros, zeros - 1,
                                 zeros + dummy_block, zeros, mask)
        else:
            # One attention block-table row: a copy of an active row, or -1 past them.
            row = (pid - table_start).to(tl.int64)
            is_active = row < num_requests
            offs_c = tl.arange(0, BLOCK_C)
            start = 0
            while start < max_blocks:
                cols = start + offs_c
                mask_c = cols < max_blocks
                # tl.where, not `&`: a scalar & vector mask loses its bool dtype under the
                # interpreter.
                blocks = tl.load(block_table_ptr + row * stride_table_row + cols * stride_table_col,
                                 mask=tl.where(is_active, mask_c, False), other=-1)
                tl.store(attn_block_table_ptr + row * stride_attn_row + cols * stride_attn_col,
                         blocks, mask=mask_c)
                start += BLOCK_C


def step_metadata(token_to_input_ids: torch.Tensor, token_to_pos_ids: torch.Tensor,
                  token_to_request_idx: torch.Tensor, token_to_block_idx: torch.Tensor,
                  token_to_position_in_request: torch.Tensor,
                  token_to_local_position_within_kv_block: torch.Tensor,
                  attn_block_table: torch.Tensor, block_table: torch.Tensor,
                  query_lengths: torch.Tensor, kv_offsets: torch.Tensor,
                  cu_query_lengths: torch.Tensor, next_tokens: torch.Tensor,
                  prompt_tokens: torch.Tensor, *, num_requests: int, num_decode: int,
                  active_tokens: int, padded_tokens: int, padded_requests: int, row_offset: int,
                  block_size: int, dummy_block: int, config: KernelConfig | None = None,
                  backend: str | None = None, check: bool = True) -> None:
    """Write the step's per-token metadata and attention block table (module docstring), in place.

    ``check=False`` skips the argument checks: for a caller (the context) that allocated every
    buffer itself and checks its host counts once, where it computes them.

    Args:
        token_to_*: six int64 ``[>= padded_tokens]`` outputs, any stride, distinct memory.
        attn_block_table: int32 ``[>= padded_requests, max_blocks]`` output, any strides.
        block_table: int32 ``[>= num_requests, max_blocks]``, the active rows (any strides).
        query_lengths, kv_offsets: int32 ``[>= num_requests]``, any stride (the kernel needs
            only ``cu_query_lengths``; decode rows have one token each).
        cu_query_lengths: int32 ``[>= num_requests + 1]``, ``cu[0] = 0`` and
            ``cu[num_requests] == active_tokens`` (the caller guarantees it; not checked).
        next_tokens: int64 (or int32) ``[>= num_requests]``, the input token of each decode row.
        prompt_tokens: int64 (or int32) ``[>= active_tokens - num_decode]``, the tokens of rows
            ``[num_decode, num_requests)`` in order.
        num_requests, num_decode, active_tokens, padded_tokens, padded_requests, row_offset,
        block_size, dummy_block: host ints.

    Every tensor is read or written through its own strides and storage offset (nothing is
    copied at the edge); every argument is checked before anything is written.
    """
    tensors = (token_to_input_ids, token_to_pos_ids, token_to_request_idx, token_to_block_idx,
               token_to_position_in_request, token_to_local_position_within_kv_block,
               attn_block_table, next_tokens, prompt_tokens, block_table, kv_offsets,
               cu_query_lengths, query_lengths)
    counts = (num_requests, num_decode, active_tokens, padded_tokens, padded_requests, row_offset)
    # The counts by class (step_metadata_counts.py), their launches per value in the plan.
    plan, plan_key = _PLANS.find(tensors, (*count_classes(*counts), block_size, dummy_block,
                                           check, backend), config, backend=backend)
    if plan is not None:
        launch = plan.launch_for(counts, tensors)
        if launch is not None:
            return launch.launch(tensors[:-1])
    device = block_table.device if isinstance(block_table, torch.Tensor) else None
    num_requests, num_decode, active_tokens, padded_tokens, padded_requests, block_size = map(
        int, (num_requests, num_decode, active_tokens, padded_tokens, padded_requests, block_size))
    if check:
        check_step(tensors, num_requests, num_decode, active_tokens, padded_tokens,
                   padded_requests, block_size)
    if resolve_backend(backend, device) == "torch":
        step_metadata_ref(**dict(zip(TOKEN_OUTPUTS, tensors[:6])),
                          attn_block_table=attn_block_table, block_table=block_table,
                          query_lengths=query_lengths, kv_offsets=kv_offsets,
                          cu_query_lengths=cu_query_lengths, next_tokens=next_tokens,
                          prompt_tokens=prompt_tokens, num_requests=num_requests,
                          num_decode=num_decode, active_tokens=active_tokens,
                          padded_tokens=padded_tokens, padded_requests=padded_requests,
                          row_offset=row_offset, block_size=block_size, dummy_block=dummy_block)
        return
    max_blocks = block_table.shape[1]
    if padded_tokens == 0 and padded_requests == 0:
        return
    if config is None:
        key = step_metadata_tune_key(max_blocks=max_blocks, block_size=block_size,
                                     num_tokens=padded_tokens, num_requests=num_requests,
                                     prefill=num_requests > num_decode)
        config, _ = autotune.resolve_config("step_metadata", key, device)
    grid, sizes = grid_and_sizes(num_requests, num_decode, active_tokens, padded_tokens,
                                 padded_requests, row_offset, config.kwargs["BLOCK_T"])
    pointers = dict(zip(_POINTERS, tensors))
    launch = KernelLaunch(_step_metadata_kernel, grid, dict(
        **pointers, **sizes, block_size=block_size, dummy_block=int(dummy_block),
        max_blocks=max_blocks,
        stride_attn_row=attn_block_table.stride(0), stride_attn_col=attn_block_table.stride(1),
        stride_table_row=block_table.stride(0), stride_table_col=block_table.stride(1),
        **{"stride_" + short: out.stride(0) for short, out in zip(_OUTPUT_STRIDES, tensors[:6])},
        stride_next_tokens=next_tokens.stride(0), stride_prompt_tokens=prompt_tokens.stride(0),
        stride_kv_offsets=kv_offsets.stride(0), stride_cu=cu_query_lengths.stride(0),
        **config.launch_kwargs()), pointers)
    _PLANS.put(plan_key, CountPlan(counts, launch, functools.partial(
        vary_step, launch, check, block_size)))


def step_metadata_ref(token_to_input_ids: torch.Tensor, token_to_pos_ids: torch.Tensor,
                      token_to_request_idx: torch.Tensor, token_to_block_idx: torch.Tensor,
                      token_to_position_in_request: torch.Tensor,
                      token_to_local_position_within_kv_block: torch.Tensor,
                      attn_block_table: torch.Tensor, block_table: torch.Tensor,
                      query_lengths: torch.Tensor, kv_offsets: torch.Tensor,
                      cu_query_lengths: torch.Tensor, next_tokens: torch.Tensor,
                      prompt_tokens: torch.Tensor, *, num_requests: int, num_decode: int,
                      active_tokens: int, padded_tokens: int, padded_requests: int,
                      row_offset: int, block_size: int, dummy_block: int) -> None:
    """Torch reference of ``step_metadata`` (same outputs, written in place)."""
    device = block_table.device
    n = active_tokens
    if num_decode == num_requests == n:
        # A decode step: token i is request i's one token, at position kv_offsets[i]; a few
        # whole-tensor ops, and no repeat_interleave (it enters an OpenMP region on a
        # multi-threaded CPU torch).
        position = kv_offsets[:n]
        token_to_input_ids[:n] = next_tokens[:n]
        torch.arange(row_offset, row_offset + n, out=token_to_request_idx[:n])
        columns = torch.div(position, block_size, rounding_mode="floor").long()
        token_to_block_idx[:n] = block_table[:n].gather(1, columns[:, None])[:, 0]
    else:
        token = torch.arange(n, device=device)
        # Each token's request; output_size keeps repeat_interleave from syncing.
        request = torch.repeat_interleave(torch.arange(num_requests, device=device),
                                          query_lengths[:num_requests].long(), output_size=n)
        position = kv_offsets.long()[request] + token - cu_query_lengths.long()[request]
        # Decode rows feed their pending token; prefill rows their prompt, in order after the
        # decode tokens (index -1 picks the trailing 0 for decode tokens).
        is_decode = request < num_decode
        prompt = torch.cat([prompt_tokens[:max(n - num_decode, 0)].long(),
                            prompt_tokens.new_zeros(1).long()])
        token_to_input_ids[:n] = torch.where(is_decode, next_tokens.long()[request],
                                             prompt[torch.where(is_decode, -1, token - num_decode)])
        token_to_request_idx[:n] = row_offset + request
        token_to_block_idx[:n] = block_table[request, position // block_size].long()
    token_to_pos_ids[:n] = position
    token_to_position_in_request[:n] = position
    torch.remainder(position, block_size, out=token_to_local_position_within_kv_block[:n])
    # Padding tokens, then the attention block table (no op for an empty range: each is a launch).
    if padded_tokens > n:
        for out, value in ((token_to_input_ids, 0), (token_to_pos_ids, 0),
                           (token_to_request_idx, -1), (token_to_block_idx, dummy_block),
                           (token_to_position_in_request, 0),
                           (token_to_local_position_within_kv_block, 0)):
            out[n:padded_tokens] = value
    attn_block_table[:num_requests] = block_table[:num_requests]
    if padded_requests > num_requests:
        attn_block_table[num_requests:padded_requests] = -1


# Search space: tokens (and rows) per program, block-table columns per tile, warps.
_BLOCK_TOKENS = (16, 64, 256)
_BLOCK_COLS = (64, 256)
_WARPS = (1, 4)


def step_metadata_configs(key: dict) -> list[KernelConfig]:
    return [KernelConfig.make(BLOCK_T=t, BLOCK_C=c, num_warps=w)
            for t in _BLOCK_TOKENS for c in _BLOCK_COLS for w in _WARPS]


def step_metadata_default_config(key: dict) -> KernelConfig:
    block_cols = 64 if key["max_blocks"] <= 64 else 256
    if key["prefill"]:
        return KernelConfig.make(BLOCK_T=64, BLOCK_C=block_cols, num_warps=4)
    return KernelConfig.make(BLOCK_T=16, BLOCK_C=block_cols, num_warps=1)


def step_metadata_tune_key(*, max_blocks: int, block_size: int, num_tokens: int, num_requests: int,
                           prefill: bool) -> dict:
    return {"max_blocks": int(max_blocks), "block_size": int(block_size),
            "num_tokens": bucket_tokens(num_tokens), "num_requests": bucket_tokens(num_requests),
            "prefill": bool(prefill)}


def scaled_down_key(key: dict) -> dict:
    """A committed key made small enough for the interpreter: at most 4 requests and 8 tokens,
    the table shape and the decode/prefill mix kept (the search space depends on none)."""
    return {**key, "num_requests": min(key["num_requests"], 4),
            "num_tokens": min(key["num_tokens"], 8)}


class _StepMetadataCase(TuneCase):
    """A step of ``num_requests`` rows: all decode, or half decode and the rest prefill chunks
    sharing the remaining tokens; no padding (the key's counts are powers of two)."""

    def __init__(self, key: dict, device: torch.device):
        requests, max_blocks, block_size = key["num_requests"], key["max_blocks"], key["block_size"]
        # Decode: one token per request; prefill: at least one each.
        tokens = max(key["num_tokens"], requests) if key["prefill"] else requests
        gen = torch.Generator(device="cpu").manual_seed(0)
        num_decode = requests // 2 if key["prefill"] else requests
        num_prefill = requests - num_decode
        query_lengths = torch.ones(requests, dtype=torch.int64)
        if num_prefill:
            share = (tokens - num_decode) // num_prefill
            query_lengths[num_decode:] = share
            query_lengths[-1] += tokens - num_decode - share * num_prefill
        capacity = max_blocks * block_size
        kv_offsets = (torch.rand(requests, generator=gen)
                      * (capacity - query_lengths).clamp(min=0)).long()
        self.args = dict(
            block_table=torch.randint(0, 1 << 20, (requests, max_blocks), generator=gen,
                                      dtype=torch.int32).to(device),
            query_lengths=query_lengths.to(torch.int32).to(device),
            kv_offsets=kv_offsets.to(torch.int32).to(device),
            cu_query_lengths=torch.cat([torch.zeros(1, dtype=torch.int64), query_lengths.cumsum(0)]
                                       ).to(torch.int32).to(device),
            next_tokens=torch.randint(0, 1 << 16, (requests,), generator=gen).to(device),
            prompt_tokens=torch.randint(0, 1 << 16, (tokens - num_decode,),
                                        generator=gen).to(device),
        )
        self.sizes = dict(num_requests=requests, num_decode=num_decode, active_tokens=tokens,
                          padded_tokens=tokens, padded_requests=requests, row_offset=0,
                          block_size=block_size, dummy_block=(1 << 20))
        self.outputs = self._new_outputs(requests, tokens, max_blocks, device)
        self.bytes_moved = (6 * 8 * tokens + 2 * 4 * requests * max_blocks
                            + (4 + 4 + 4 + 8) * requests)

    @staticmethod
    def _new_outputs(requests, tokens, max_blocks, device):
        outputs = {name: torch.full((tokens,), -7, dtype=torch.int64, device=device)
                   for name in TOKEN_OUTPUTS}
        outputs["attn_block_table"] = torch.full((requests, max_blocks), -7, dtype=torch.int32,
                                                 device=device)
        return outputs

    def _call(self, outputs, config, backend):
        step_metadata(**outputs, **self.args, **self.sizes, config=config, backend=backend)

    def run(self, config: KernelConfig) -> None:
        self._call(self.outputs, config, "triton")

    def run_reference(self) -> None:
        self._call(self.outputs, None, "torch")

    def check(self, config: KernelConfig) -> None:
        table = self.args["block_table"]
        expected = self._new_outputs(table.shape[0], self.sizes["active_tokens"], table.shape[1],
                                     table.device)
        self._call(expected, None, "torch")
        for out in self.outputs.values():
            out.fill_(-7)
        self.run(config)
        for name, out in self.outputs.items():
            assert torch.equal(out, expected[name]), f"{config}: {name} differs from the reference"


def _step_metadata_presets() -> list[dict]:
    keys = [step_metadata_tune_key(max_blocks=b, block_size=BLOCK_SIZE, num_tokens=r,
                                   num_requests=r, prefill=False)
            for b in (128, 256) for r in (64, 256, 1024)]
    keys += [step_metadata_tune_key(max_blocks=256, block_size=BLOCK_SIZE, num_tokens=n,
                                    num_requests=r, prefill=True)
             for r, n in ((64, 2048), (256, 4096), (1024, 8192))]
    return keys


autotune.register(KernelTuning(
    name="step_metadata", configs=step_metadata_configs,
    default_config=step_metadata_default_config, tune_key=step_metadata_tune_key,
    token_field="num_tokens", make_case=_StepMetadataCase, presets=_step_metadata_presets))


@custom_op("dynctx::step_metadata", mutates_args=(*TOKEN_OUTPUTS, "attn_block_table"))
def _step_metadata_op(token_to_input_ids: torch.Tensor, token_to_pos_ids: torch.Tensor,
                      token_to_request_idx: torch.Tensor, token_to_block_idx: torch.Tensor,
                      token_to_position_in_request: torch.Tensor,
                      token_to_local_position_within_kv_block: torch.Tensor,
                      attn_block_table: torch.Tensor, block_table: torch.Tensor,
                      query_lengths: torch.Tensor, kv_offsets: torch.Tensor,
                      cu_query_lengths: torch.Tensor, next_tokens: torch.Tensor,
                      prompt_tokens: torch.Tensor, num_requests: int, num_decode: int,
                      active_tokens: int, padded_tokens: int, padded_requests: int,
                      row_offset: int, block_size: int, dummy_block: int) -> None:
    # The op's parameters are the launcher's, by name (and nothing else is local yet).
    step_metadata(**locals())


@_step_metadata_op.register_fake
def _(*args):
    return None
