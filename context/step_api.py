"""Megatron-Core 0.19's step API on the facade (``DynamicInferenceContext`` derives from
``StepAPI``): ``initialize_attention_state``'s 0.19 keywords and the bookkeeping transfer, the
per-request prefill flags, the logit rows at a fixed address, the async-scheduling trio, and
the row helpers with the drafts. Each is a few lines over the parts (``_table``, ``_device``,
``_forward``); the host work of the trio is ``async_steps``'. docs/SEMANTICS.md §16 (rows
49-54) says where dynctx differs from 0.19 and why.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from dynctx.kernels.devices import same_device

from . import async_steps
from .batch_dimensions import InferenceBatchDimensions
from .errors import StepShapeError
from .gpu_view import ContextStepView
from .inputs import TOKEN_DTYPES, check_token_ids
from .speculative import logit_rows


class BookkeepingDone:
    """What ``transfer_bookkeeping_to_gpu(record_done_event=True)`` returns off CUDA: the
    transfer is complete when it returns (``synchronize``, ``query`` and ``wait`` as a CUDA
    event's, doing nothing)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        return None


def _check_flag(name: str, value: Any) -> bool:
    if value is True or value is False:   # (every step: the common case first)
        return value
    if not isinstance(value, np.bool_):
        raise TypeError(f"{name}={value!r} must be a bool")
    return bool(value)


class StepAPI:
    """Megatron-Core 0.19's step methods of ``DynamicInferenceContext``."""

    # ------------------------------------------------------------------ the step
    def initialize_attention_state(
            self, *, construct_graph_dimensions: Optional[InferenceBatchDimensions] = None,
            is_expert_parallel_dummy_cuda_graph_step: bool = False,
            transfer_bookkeeping_to_gpu: bool = True,
            record_bookkeeping_done_event: bool = False) -> Any:
        """Prepare the step's token arrays and attention metadata, padded to the CUDA graph
        that fits the step, else eagerly (``ForwardPass.begin``, which uploads the bookkeeping
        in its one arena copy). With ``construct_graph_dimensions`` (an empty context), first
        add that graph's capture dummies; with ``is_expert_parallel_dummy_cuda_graph_step``,
        one decode dummy of ``1 + k`` tokens (Megatron-Core 0.19). Returns
        ``transfer_bookkeeping_to_gpu(record_done_event=record_bookkeeping_done_event)`` when
        ``transfer_bookkeeping_to_gpu``, else None (0.19's event protocol)."""
        self._check_allocated()
        dummy = _check_flag("is_expert_parallel_dummy_cuda_graph_step",
                            is_expert_parallel_dummy_cuda_graph_step)
        transfer = _check_flag("transfer_bookkeeping_to_gpu", transfer_bookkeeping_to_gpu)
        record = _check_flag("record_bookkeeping_done_event", record_bookkeeping_done_event)
        if dummy and construct_graph_dimensions is not None:
            raise ValueError("is_expert_parallel_dummy_cuda_graph_step=True with "
                             f"construct_graph_dimensions={construct_graph_dimensions}: a dummy "
                             "expert-parallel step does not capture CUDA graphs")
        if construct_graph_dimensions is not None:
            self.add_dummy_requests_for_cudagraph_capture(construct_graph_dimensions)
        elif dummy:
            self.add_dummy_requests_for_expert_parallel_step(InferenceBatchDimensions(
                token_count=self._table.speculative + 1, prefill_req_count=0,
                decode_req_count=1))
        self._step = self._forward.begin(self._limits(),
                                         capture=construct_graph_dimensions is not None)
        self._set_step_counts(self._step)
        if transfer:
            return self.transfer_bookkeeping_to_gpu(record_done_event=record)
        return None

    def transfer_bookkeeping_to_gpu(self, skip_token_input_ids: bool = False,
                                    record_done_event: bool = False) -> Any:
        """Megatron-Core 0.19's publication of the step's bookkeeping. dynctx uploads it in
        ``initialize_attention_state`` (one arena copy) and builds the token arrays on the
        device, so nothing is left to copy and ``skip_token_input_ids`` has nothing to skip;
        with ``record_done_event`` it returns an event recorded on the current stream (CUDA),
        else a completed ``BookkeepingDone``; otherwise None."""
        self._check_allocated()
        _check_flag("skip_token_input_ids", skip_token_input_ids)
        if not _check_flag("record_done_event", record_done_event):
            return None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return event
        return BookkeepingDone()

    def current_input_and_position_ids(self, *, num_warmup_tokens: Optional[int] = None
                                       ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [1, n], position_ids [1, n])`` views, n = padded tokens of the step,
        cut once per ``n`` (``_input_position_views``, Megatron-Core 0.19's cache)."""
        self._check_allocated()
        if num_warmup_tokens is None and self._step is None:
            raise RuntimeError("current_input_and_position_ids() is valid only after "
                               "initialize_attention_state() of this step")
        warmup = num_warmup_tokens
        if warmup is not None and (isinstance(warmup, (bool, np.bool_))
                                   or not isinstance(warmup, (int, np.integer))):
            raise TypeError(f"num_warmup_tokens={num_warmup_tokens!r} must be an int or None")
        n = num_warmup_tokens or self.padded_active_token_count
        if not 0 <= n <= self.max_tokens:
            raise ValueError(f"num_warmup_tokens={num_warmup_tokens} must lie in [0, max_tokens="
                             f"{self.max_tokens}]")
        device, views = self._device, self._input_position_views
        cached = views.get(n)
        if cached is None or cached[0]._base is not device.token_to_input_ids:
            if cached is not None or len(views) >= 64:
                views.clear()  # the arrays were allocated again (a resume), or too many sizes
            cached = views[n] = (device.token_to_input_ids[:n].unsqueeze(0),
                                 device.token_to_pos_ids[:n].unsqueeze(0))
        return cached

    _input_position_views = property(
        lambda self: self.__dict__.setdefault("_input_position_cache", {}),
        doc="padded token count -> the views current_input_and_position_ids hands out")
    gpu_view = property(
        lambda self: self.__dict__.setdefault("_gpu_view", ContextStepView(self._device)),
        doc="Megatron-Core 0.19's names for the step's device tensors (gpu_view.py)")

    @property
    def request_in_prefill_status_tensor(self) -> torch.Tensor:
        """int32 ``[max_requests]``: 1 for a prefill row of the step, 0 for a decode or paused
        row, -1 for a free row (Megatron-Core 0.19's flags). dynctx keeps a row's kind in its
        place (the last ``num_prefill_requests`` active rows are the prefills), so this is a
        new tensor built from those counts at each read: a write into it is not kept
        (``num_prefill_requests`` is what to set)."""
        self._check_allocated()
        table = self._table
        flags = torch.full((self._request_rows,), -1, dtype=torch.int32)
        flags[:table.total] = 0
        flags[table.total - table.num_prefill:table.total] = 1
        return flags.to(self.device)

    # ------------------------------------------------------------------ logit rows
    @property
    def active_logit_idxs(self) -> torch.Tensor:
        """int64 ``[max_tokens]`` at a fixed address: the step's logit rows (every decode token,
        ``1 + k`` a decode request, then each prefill's last token; zero beyond
        ``num_last_token_logits``). With ``k > 0`` the step uploads them (the tensor
        ``speculative_required_logit_indices`` slices); with ``k = 0`` they are written at the
        first read of each step (``pad_active_slices``), the step itself does not spend a copy
        on them."""
        self._check_allocated()
        if self._step is not None and self.__dict__.get("_logit_rows_of") is not self._step:
            self.pad_active_slices()
        return self._logit_rows_buffer()

    def _logit_rows_buffer(self) -> torch.Tensor:
        if self._table.speculative:
            return self._device.spec.logit_rows
        buffer = self.__dict__.get("_logit_rows")
        if buffer is None or buffer.device != self._device.token_to_input_ids.device:
            buffer = self.__dict__["_logit_rows"] = torch.zeros(
                self.max_tokens, dtype=torch.int64, device=self.device)
            self.__dict__["_logit_rows_host"] = np.zeros(self.max_tokens, dtype=np.int64)
        return buffer

    def pad_active_slices(self) -> None:
        """Write this step's logit rows into ``active_logit_idxs`` (Megatron-Core 0.19's; its
        sampling metadata padding has no counterpart here: the engine samples)."""
        self._check_allocated()
        step = self._step
        if step is None:
            raise RuntimeError("pad_active_slices() is valid only after "
                               "initialize_attention_state() of this step")
        buffer = self._logit_rows_buffer()
        if self._table.speculative == 0:
            host = self.__dict__["_logit_rows_host"]
            count = self.num_last_token_logits
            host[:] = 0
            logit_rows(step.decode, step.prefill, 0, self._device.arena.host["attn_cu_query"],
                       host, step.active_tokens, step.padded_tokens, count)
            buffer.copy_(torch.from_numpy(host))
        self.__dict__["_logit_rows_of"] = step

    # ------------------------------------------------------------------ async scheduling
    def can_prepare_requests(self) -> bool:
        """Whether ``prepare_requests`` can run: decode rows only, none paused, and the active
        budget holds a block for each row whose next ``1 + k`` tokens start one."""
        self._check_allocated()
        table = self._table
        if table.num_prefill != 0 or table.paused != 0:
            return False
        need = int(async_steps.rows_requiring_new_block(table).sum())
        return need <= self.kv_block_allocator.get_active_avail()

    def prepare_requests(self) -> None:
        """Advance every active decode row past the step it forwarded, for the next one
        (Megatron-Core 0.19's async scheduling): KV offsets by the query lengths, query
        lengths ``1 + k``, a new block for each row whose next tokens start one, and the
        step's token arrays but the input ids (``commit_sampled_tokens`` writes those). Raises
        ``RuntimeError`` where a pause or an eviction would be needed; nothing changes then."""
        self._check_allocated()
        table = self._table
        plan = async_steps.plan_prepare(table)
        active = table.active
        if active == 0:
            self.active_token_count = 0
            return
        need = plan.rows.size
        blocks = np.empty(0, dtype=np.int32)
        if need:
            allocator = self.kv_block_allocator
            if need > allocator.get_active_avail():
                raise RuntimeError("Async scheduling cannot pause requests to allocate new "
                                   f"blocks ({need} needed).")
            taken = allocator.allocate_memory_blocks(need)
            if taken is None:
                raise RuntimeError("Async scheduling cannot evict requests to allocate new "
                                   f"blocks ({need} needed).")
            blocks = np.asarray(taken.cpu() if isinstance(taken, torch.Tensor) else taken,
                                dtype=np.int32)
        rows = table.rows
        old_last = rows[async_steps.FIELD_LAST_OFFSET, :active].copy()
        old_blocks = rows[async_steps.FIELD_LAST_BLOCK, :active].copy()
        async_steps.commit_prepare(table, plan, blocks)
        arrays = async_steps.prepared_token_arrays(table, old_last, old_blocks, plan, blocks)
        device, count = self._device, table.active_tokens
        for name, values in arrays.items():
            target = getattr(device, name)
            target[:count].copy_(torch.from_numpy(values).to(target.dtype))
        self._after_async_change()

    def commit_sampled_tokens(self, sampled_tokens_cpu: torch.Tensor,
                              sampled_mtp_tokens_cpu: Optional[torch.Tensor] = None) -> None:
        """Write the sampled tokens (CPU, one per active request; with ``k > 0`` the drafts
        ``[k, active]``) as the prepared step's inputs, and as the rows' pending tokens (a step
        built again reads the same). Every check first."""
        self._check_allocated()
        self._check_sampled(sampled_tokens_cpu, sampled_mtp_tokens_cpu, cpu=True)
        active, per_row = self._table.active, 1 + self._table.speculative
        self._table.active_tokens = active * per_row
        self._write_sampled(sampled_tokens_cpu, sampled_mtp_tokens_cpu, None)

    def copy_async_sched_sample_to_forward(self, sampled_tokens_cuda: torch.Tensor,
                                           sampled_mtp_tokens_cuda: Optional[torch.Tensor] = None
                                           ) -> None:
        """Write the sampled tokens (on the context's device) into the step's input ids and
        pending tokens, and zero the input ids of the padding tokens (Megatron-Core 0.19)."""
        self._check_allocated()
        self._check_sampled(sampled_tokens_cuda, sampled_mtp_tokens_cuda, cpu=False)
        self._write_sampled(sampled_tokens_cuda, sampled_mtp_tokens_cuda,
                            self.padded_active_token_count)

    def _check_sampled(self, tokens: Any, drafts: Any, *, cpu: bool) -> None:
        active, k = self._table.active, self._table.speculative
        for name, value in (("sampled tokens", tokens), ("MTP draft tokens", drafts)):
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dtype not in TOKEN_DTYPES:
                raise TypeError(f"{name} must be an integer (int32 or int64) torch.Tensor, got "
                                f"{value.dtype if isinstance(value, torch.Tensor) else value!r}")
            if cpu and value.device.type != "cpu":
                raise StepShapeError(f"{name} must be on the CPU before they are committed "
                                     f"(got {value.device})")
            if not (value.is_cpu or same_device(value.device, self.device)):
                raise ValueError(f"{name} are on {value.device}, the context on {self.device}")
        if tokens.numel() != active:
            raise RuntimeError(f"Expected {active} new tokens, got {tokens.numel()}.")
        if k == 0:
            if drafts is not None and drafts.numel() != 0:
                raise RuntimeError("Received MTP draft tokens when speculative decoding is "
                                   "disabled.")
        elif drafts is None or tuple(drafts.shape) != (k, active):
            shape = None if drafts is None else tuple(drafts.shape)
            raise RuntimeError(f"Expected MTP draft token shape {(k, active)}, got {shape}.")
        if self.validate:   # the ids the next step forwards (a read of each tensor)
            check_token_ids("sampled tokens", tokens, self.vocab_size)
            if k and drafts is not None:
                check_token_ids("MTP draft tokens", drafts, self.vocab_size)

    def _write_sampled(self, tokens: torch.Tensor, drafts: Optional[torch.Tensor],
                       padded: Optional[int]) -> None:
        device, table = self._device, self._table
        active, k = table.active, self._table.speculative
        paused, count = table.paused, table.active * (1 + k)
        inputs = device.token_to_input_ids
        grouped = inputs[:count].view(active, 1 + k)
        grouped[:, 0].copy_(tokens.reshape(-1))
        pending = device.next_tokens[device.current]
        pending[paused:paused + active].copy_(tokens.reshape(-1))
        if k and active:
            grouped[:, 1:].copy_(drafts.t())
            device.spec.drafts[paused:paused + active].copy_(drafts.t())
        if padded is not None and count < padded:
            inputs[count:padded].zero_()

    def resolve_requests(self, active_requests_mask: torch.Tensor
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Finish the rows ``active_requests_mask`` drops (their blocks and slots released)
        and compact the survivors as ``update_requests`` does, without advancing them; the
        prefills become decode rows; the token arrays are left as they are (Megatron-Core
        0.19). Returns ``(finished request ids int32, survivor_idxs int64)``, where
        ``survivor_idxs[r]`` is the old row that row ``r`` now holds. Every check first."""
        self._check_allocated()
        table, device = self._table, self._device
        keep = async_steps.read_resolve_mask(active_requests_mask, table.total)
        plan, survivors = async_steps.plan_resolve(table, keep)
        if table.prefix_cache is not None and self._mamba is not None:
            # The prompt blocks were published at their add; a hybrid's boundary states are
            # snapshotted here, as update_requests does (the slots hold the forward's states).
            snapshots = table.prefix_cache.plan_publish(table).snapshots
            if snapshots:
                self._mamba.save_snapshots(snapshots)
        finished = torch.from_numpy(plan.finished_ids.astype(np.int32))
        old_total = plan.old_total
        table.commit_update(plan)
        if table.prefix_cache is not None:
            table.prefix_cache.drop_done(table.live_ids)
        pending = device.next_tokens[device.current][:old_total]
        drafts = device.spec.drafts[:old_total].t() if device.spec is not None else None
        device.apply_update(plan, table, pending, drafts)
        self._forward.reset_attention_state()
        self._forward.step = None
        self._after_async_change()
        return finished, torch.from_numpy(survivors.astype(np.int64))

    def _after_async_change(self) -> None:
        """The rows changed outside a step: the step is gone, and the token arrays written
        (or kept) are the caller's until the next ``initialize_attention_state``."""
        self._steps.prepared = None
        self._step = None
        self._hand_written = True
        self._device.arena.dirty = True  # the host rows changed after the last handout

    # ------------------------------------------------------------------ resets
    def reset_tensors(self) -> None:
        """Megatron-Core 0.19's sentinel fill of the bookkeeping: with no request in the
        context, the free rows and the token arrays take their reset values (the rows already
        hold them: dynctx's rows and counts change together). With requests in it,
        ``RuntimeError`` and nothing changes: use ``reset()``, which frees their blocks too."""
        self._check_allocated()
        table = self._table
        if table.total:
            raise RuntimeError(f"reset_tensors() with {table.total} requests in the context would "
                               "orphan their blocks; reset() empties the context")
        table.reset(keep_cache=True)
        device = self._device
        for name, value in (("token_to_input_ids", 0), ("token_to_pos_ids", 0),
                            ("token_to_request_idx", -1), ("token_to_position_in_request", 0),
                            ("token_to_block_idx", -1),
                            ("token_to_local_position_within_kv_block", 0)):
            getattr(device, name).fill_(value)
        self._step = None

    def reset_metadata(self, preserve_prefix_cache: bool = False, *,
                       preserve_counters: bool = False) -> None:
        """Megatron-Core 0.19's reset of the counts, the allocator and the attention state:
        ``reset`` here (dynctx's counts and rows are one state)."""
        self.reset(preserve_prefix_cache, preserve_counters=preserve_counters)

    # ------------------------------------------------------------------ row helpers
    def _move_book_keeping_tensors(self, src_idxs: Any, dst_idxs: Any,
                                   next_tokens: Optional[torch.Tensor], swap: bool = False,
                                   new_speculative_tokens: Optional[torch.Tensor] = None
                                   ) -> None:
        """Rows ``dst_idxs`` take rows ``src_idxs``' bookkeeping (``ContextParts.move_rows``),
        and ``new_speculative_tokens[:, dst] = new_speculative_tokens[:, src]`` on the tensor
        given (Megatron-Core 0.19's keyword; the rows' own drafts move with them anyway)."""
        if not isinstance(swap, (bool, np.bool_)):
            raise TypeError(f"swap must be a bool, got {type(swap).__name__} (the drafts go by "
                            "keyword: new_speculative_tokens=)")
        self._parts.move_rows(src_idxs, dst_idxs, next_tokens, swap,
                              new_speculative_tokens)
        self._step = None

    def _swap_book_keeping_tensors(self, src_idxs: Any, dst_idxs: Any,
                                   next_tokens: Optional[torch.Tensor],
                                   new_speculative_tokens: Optional[torch.Tensor] = None
                                   ) -> None:
        """Exchange the bookkeeping of rows ``src_idxs`` and ``dst_idxs`` (distinct rows)."""
        self._move_book_keeping_tensors(src_idxs, dst_idxs, next_tokens, swap=True,
                                        new_speculative_tokens=new_speculative_tokens)
