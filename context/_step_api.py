"""The step side of ``DynamicInferenceContext``: ``initialize_attention_state`` (the step's
token arrays and attention metadata), ``update_requests`` (the step-end state machine, with the
steady decode update's shortcut and the next step prepared on the host) and their helpers.
The facade (``dynamic_context.py``) holds construction and admission."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from ._fields import FIELD_BLOCKS, FIELD_QUERY
from .batch_dimensions import InferenceBatchDimensions
from .inputs import check_new_tokens, read_mask

_EMPTY_IDS = torch.empty(0, dtype=torch.int64)


class StepMixin:
    """``initialize_attention_state``, ``update_requests``, ``reset_attention_state`` and
    ``current_input_and_position_ids`` of ``DynamicInferenceContext``."""

    def reset_attention_state(self) -> None:
        """Forget this step's attention (and Mamba) metadata: ``cu_query_lengths`` and the
        step fields of ``mamba_metadata`` become invalid until the next
        ``initialize_attention_state`` (``mamba_metadata`` itself stays, as in Megatron-Core)."""
        self.active_attn_metadata = None
        if self.mamba_metadata is not None:
            self.mamba_metadata.reset_varlen_metadata()

    def _set_step_counts(self, step) -> None:
        real = step.batch_dimensions if step else InferenceBatchDimensions()
        padded = step.padded if step else InferenceBatchDimensions()
        self.batch_dimensions, self.padded_batch_dimensions = real, padded
        self.padded_active_token_count = padded.token_count
        self.padded_active_request_count = padded.req_count
        self._using_cuda_graph_this_step = step.using_cuda_graph if step else False
        self.padding_slice = slice(step.active_tokens if step else 0, padded.token_count)

    def initialize_attention_state(self, *, construct_graph_dimensions: Optional[
            InferenceBatchDimensions] = None) -> None:
        """Prepare the step's token arrays and attention metadata, padded to the CUDA graph
        that fits the step, else eagerly (``step.build_step``; the forward itself runs eager).
        With ``construct_graph_dimensions`` (an empty context), first add that graph's capture
        dummies (``add_dummy_requests_for_cudagraph_capture``), as Megatron-Core does before a
        capture."""
        self._check_allocated()
        if construct_graph_dimensions is not None:
            self.add_dummy_requests_for_cudagraph_capture(construct_graph_dimensions)
        table = self._table
        if self.chunked_prefill_request_id != -1 and table.num_prefill == 0 and table.active:
            # The chunked request's row holds a placeholder token, not a real one: forwarding it
            # would write K/V at a position whose block may not exist (docs/SEMANTICS.md §10).
            raise RuntimeError(
                f"the chunked prefill request {self.chunked_prefill_request_id} needs its next "
                "chunk (add_request) before this step; a step without it would forward its "
                "placeholder token")
        device = self._device
        zero_count, device_prompts = table.take_staged()
        prepared, self._next_step = self._next_step, None
        if prepared is not None and not zero_count and not device_prompts and \
                prepared[0] == self._step_signature():
            # update_requests built this step already, and nothing it reads changed since.
            self._step_sig, step, self._step_blocks = prepared
        else:
            self._step_sig, step, self._step_blocks = None, self._build_step(zero_count), None
        device.begin_step(step, table, device_prompts)
        if step.mamba:
            self.mamba_metadata.update_step(device.mamba_step_fields(step))
            self._restore_mamba_snapshots()
        device.end_step()
        self._step = step
        self._set_step_counts(step)
        self.active_attn_metadata = device.attention_metadata(step)

    def _build_step(self, zero_count: int, max_kv_offset: Optional[int] = None):
        """``StepBuilder.build`` of the table as it is: the step's ``Step``, its host
        attention (and Mamba) metadata written into the arena."""
        device = self._device
        return self._steps.build(self._table, device.arena.host, max_tokens=self.max_tokens,
                                 max_requests=self.max_requests,
                                 tp=self.tensor_model_parallel_size, seq_idx=device.host_seq_idx,
                                 zero_count=zero_count, token_rounder=self.TOKEN_ROUNDER,
                                 request_rounder=self.REQUEST_ROUNDER,
                                 max_kv_offset=max_kv_offset)

    def _step_signature(self) -> tuple:
        """Everything ``StepBuilder.build`` reads on a model without Mamba layers: the counts,
        the limits, and the active rows' fields ``FIELD_QUERY`` to ``FIELD_BLOCKS`` (query
        lengths, output lengths, KV offsets, block counts) as one bytes object; the block
        counts are there for the decode update, which takes their sum from the update that
        prepared the step (``_prepare_next_step``)."""
        table = self._table
        P, T = table.paused, table.total
        return (P, T, table.active_tokens, table.num_prefill, table.fed_decode,
                table.continuation_added, self.max_requests, self.max_tokens,
                self.tensor_model_parallel_size, self.TOKEN_ROUNDER, self.REQUEST_ROUNDER,
                table.rows[FIELD_QUERY:FIELD_BLOCKS + 1, P:T].tobytes())

    def _rows_unchanged(self, signature: tuple) -> bool:
        """Whether the active rows and their fields ``FIELD_QUERY`` to ``FIELD_BLOCKS`` are
        those of ``signature`` (``_step_signature``'s first two and last entries)."""
        table = self._table
        P, T = table.paused, table.total
        return (signature[0] == P and signature[1] == T
                and signature[-1] == table.rows[FIELD_QUERY:FIELD_BLOCKS + 1, P:T].tobytes())

    def _prepare_next_step(self, max_kv_offset: Optional[int] = None,
                           active_blocks: Optional[int] = None) -> None:
        """Build the next step at the end of ``update_requests``, while the host's bookkeeping
        is at hand, with the signature of what it read; ``initialize_attention_state`` takes it
        when the signature still holds (an ``add_request`` in between changes the counts, a
        write by hand the rows), else builds anew. Models with Mamba layers build at the step
        (their step also reads the slots and consumes the staged zeroing).
        ``max_kv_offset``, ``active_blocks``: the active rows' largest KV offset and the sum
        of their block counts, when the update knows them."""
        table = self._table
        if self.is_hybrid_model or not table.active:
            self._next_step = None
            return
        self._next_step = (self._step_signature(), self._build_step(0, max_kv_offset),
                           active_blocks)

    def current_input_and_position_ids(self, *, num_warmup_tokens: Optional[int] = None
                                       ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [1, n], position_ids [1, n])`` views, n = padded tokens of the step."""
        self._check_allocated()
        if num_warmup_tokens is None and self._step is None:
            raise RuntimeError("current_input_and_position_ids() is valid only after "
                               "initialize_attention_state() of this step")
        n = num_warmup_tokens or self.padded_active_token_count
        if not 0 <= n <= self.max_tokens:
            raise ValueError(f"num_warmup_tokens={num_warmup_tokens} must lie in [0, max_tokens="
                             f"{self.max_tokens}]")
        return self.token_to_input_ids[:n].unsqueeze(0), self.token_to_pos_ids[:n].unsqueeze(0)

    def update_requests(self, active_requests_mask: torch.Tensor,
                        new_tokens: torch.Tensor) -> torch.Tensor:
        """Advance the state after a forward pass (docs/SEMANTICS.md §9, the fixed version).

        ``active_requests_mask[i]`` (bool/0-1, one per active request) keeps request i; 0
        finishes it. ``new_tokens`` (int32/int64, one per active request) is not modified.
        Finished requests release their blocks; requests whose last block is full pause, and
        paused requests resume (LIFO) or are evicted beyond the paused budget. Returns the ids
        (1-D int64 CPU tensor) of the requests this call paused that are still paused; the ids
        this call evicted are in ``self.evicted_request_ids`` (re-queue them for recompute).
        A request the mask keeps whose next token would lie beyond ``max_sequence_length`` is
        finished like a masked one (its blocks released) and its id listed in
        ``self.max_length_finished_request_ids``: the context never writes past a request's
        block-table row (Megatron-Core's engine, and ours, refuse such requests at admission).
        It needs ``initialize_attention_state`` of this step first, unless the counts were
        written by hand (``total_request_count = ...``, as Megatron-Core's tests build states).
        Every check runs before anything changes (an error leaves the context as it was); the
        one device-to-host read is the mask. ``metrics_writer.log`` runs last, on the updated
        context: if it raises, the update is complete and the error propagates.
        """
        self._check_allocated()
        table = self._table
        A = table.active
        if A and self._step is None and not self._hand_written:
            raise RuntimeError("update_requests() needs initialize_attention_state() first: the "
                               "requests added since the last step (or this step's tokens) "
                               "were never forwarded")
        new_tokens = check_new_tokens(new_tokens, A, self.device, validate=self.validate,
                                      vocab_size=self.vocab_size)
        mask = read_mask(active_requests_mask, A, self.device)  # None: every request kept
        chunked_id, max_length = self.chunked_prefill_request_id, self.max_sequence_length
        decode = None
        if mask is None and self._decode_shortcut and self.prefix_cache is None:
            # A step built from rows that are still as they were says what a decode update
            # would otherwise compute: every row one token, the largest KV offset, and (when
            # the update that prepared it knew it) the sum of the block counts.
            step, sig, known, blocks = self._step, self._step_sig, None, None
            if step is not None and step.one_token_rows and sig is not None and \
                    self._rows_unchanged(sig):
                known, blocks = step.max_seqlen_k, self._step_blocks
            decode = table.plan_decode(chunked_id=chunked_id, max_sequence_length=max_length,
                                       max_kv_offset=known, active_blocks=blocks)
        # The host commits, the next step is prepared on the host, then the device applies
        # the plan (one launch): the host's work runs back to back.
        if decode is not None:
            # The steady decode step: nothing finishes, stays paused or is evicted.
            appended = table.commit_decode(decode)
            self._prepare_next_step(decode.max_kv_offset, decode.active_blocks)
            self._device.apply_decode(decode, appended, table, new_tokens)
            self.newly_paused_request_ids = self.evicted_request_ids = _EMPTY_IDS
            self.max_length_finished_request_ids = _EMPTY_IDS
        else:
            if mask is None:
                mask = np.ones(A, dtype=np.bool_)
            plan = self._plan_update_publishing(mask)
            table.commit_update(plan)
            self._after_update_publishing()
            self._prepare_next_step()
            self._device.apply_update(plan, table, new_tokens)
            self.newly_paused_request_ids = torch.from_numpy(plan.newly_paused_ids)
            self.evicted_request_ids = torch.from_numpy(plan.evicted_ids)
            self.max_length_finished_request_ids = torch.from_numpy(plan.max_length_ids)
        self.has_explicit_chunked_prefill_req = False
        self.reset_attention_state()
        self._step = None
        self._hand_written = False
        if self.metrics_writer is not None:
            # The prefix cache's counters too, when caching is on (empty otherwise).
            stats = self.get_kvcache_utilization_stats()
            stats.update(self.get_prefix_cache_stats())
            self.metrics_writer.log({f"inference/{k}": v for k, v in stats.items()})
        return self.newly_paused_request_ids
