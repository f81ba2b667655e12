"""The forward pass in flight: one step from ``initialize_attention_state`` to ``update_requests``.

``ForwardPass`` says in which order the parts act (docs/DESIGN.md §2, §3) and serves what the
model's forward calls in between:

* ``begin`` (``initialize_attention_state``): the request table hands over what ``add_request``
  staged; the step builder gives the step (the one the last update prepared while nothing it
  read has changed, else a new build); the device state uploads and builds the step's
  per-token arrays (one launch); on a hybrid the Mamba states zero the new slots, give the
  step's Mamba fields and restore prefix snapshots.
* the model's calls, Megatron-Core's: the step's lengths, the KV cache's appends and views,
  rope, the last-token logits and log probs, the Mamba layers' states, each checking the
  caller's tensors against the step first.
* ``update`` (``update_requests``, its arguments checked): the plan (the steady decode
  update's shortcut, ``update_plan.plan_decode``, when the mask keeps every request; else
  ``plan_update``, with the prefix cache publishing the step's blocks around it), the commit on
  the host, the next step prepared on the host, then the device applies the plan (one
  launch): the host's work runs back to back.

``step`` and ``attention`` are the step begun last and its attention metadata (None after an
update, and the metadata after ``reset_attention_state`` too).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from . import deferred_rewind, rotary, token_rewind
from . import logits as step_logits
from . import speculative as spec
from ._fields import FIELD_MAMBA_SLOT, FIELD_QUERY
from .errors import NotHybridError
from .inputs import check_logits, check_new_tokens, check_rope_call

EMPTY_IDS = torch.empty(0, dtype=torch.int64)


class ForwardPass:
    """The step in flight.

    Args:
        table, device, steps, kv: the ``RequestTable``, ``DeviceState``, ``StepBuilder`` and
            ``KVCache``; mamba, mamba_metadata: a hybrid's ``MambaStates`` and
            ``MambaMetadata`` (else None); layers: the ``sizing.LayerLayout``; kv_groups: with
            KV groups the ``kv_groups.GroupedKV`` (which ``kv`` is too), else None.
        settings: the context's attributes the calls read (``device``, ``kernel_backend``,
            ``validate``, ``vocab_size``, ``use_flashinfer_fused_rope``, ``cache_mla_latent``).
    """

    def __init__(self, *, table, device, steps, kv, layers, settings: dict, mamba=None,
                 mamba_metadata=None, kv_groups=None):
        self.table, self.device, self.steps, self.kv = table, device, steps, kv
        self.kv_groups = kv_groups   # a GroupedKV (context/kv_groups.py), or None
        self.layers, self.mamba, self.mamba_metadata = layers, mamba, mamba_metadata
        self.where = settings["device"]
        self.kernel_backend = settings["kernel_backend"]
        self.validate, self.vocab_size = settings["validate"], settings["vocab_size"]
        self.use_flashinfer = settings["use_flashinfer_fused_rope"]
        self.mla = settings["cache_mla_latent"]
        self.max_sequence_length = settings["max_sequence_length"]
        # The steady decode update's shortcut (update_plan.plan_decode); False makes every
        # update take plan_update (tests compare the two).
        self.decode_shortcut = True
        self.step = self.attention = None
        # Speculative steps: the step's logit rows (``speculative.num_logit_rows``), and
        # whether its rejected drafts were rewound already (once a step).
        self.speculative = table.speculative
        self.logit_count, self.rewound = 0, False
        self.settled: set = set()   # deferred rewinds: the requests settled in this step
        # Megatron-Core 0.19's Mamba extraction plan (``mamba_slot_allocator``), or None.
        self.intermediates = None

    # ------------------------------------------------------------------ the step
    def begin(self, limits: tuple, capture: bool = False):
        """Build the step about to run, on the device; returns its ``Step`` (``capture``: a CUDA
        graph capture step of dummies). A step that calibrates dynamic FP8 scales
        (``KVCache.begin_step``) runs eagerly, not as a CUDA graph replay."""
        table, device, mamba = self.table, self.device, self.mamba
        if table.chunked_id != -1:
            table.check_step_ready()
        zero_count, device_prompts = table.take_staged()
        step = self.steps.take(table, device.arena.host, limits,
                               seq_idx=None if mamba is None else mamba.host_seq_idx,
                               zero_count=zero_count, device_prompts=device_prompts)
        if self.kv.begin_step(step.active_tokens, capture) and step.using_cuda_graph:
            step = step._replace(using_cuda_graph=False)
        device.begin_step(step, table, device_prompts, mamba=self.mamba.rewind_tensors()
                          if mamba is not None and device.deferred_rewind else ())
        if step.mamba:
            self.mamba_metadata.update_step(mamba.step_fields(step, device.arena.device,
                                                              device.h2d))
            # Hybrid prefix cache hits: their slots take their snapshots (at every build).
            mamba.restore_snapshots(table.mamba_restores)
            if self.intermediates is not None:
                self.intermediates.begin_step(self.mamba_metadata)
        if self.speculative:
            self.logit_count = spec.num_logit_rows(step, self.speculative)
            device.spec.upload_logit_rows(step, device.arena.host["attn_cu_query"],
                                          self.logit_count, device.h2d)
            self.rewound, self.settled = False, set()
        device.end_step()
        self.step, self.attention = step, device.attention_metadata(step)
        if self.kv_groups is not None:
            self.kv_groups.begin(step, table, device, self.attention)
        return step

    def reset_attention_state(self) -> None:
        """Forget this step's attention (and Mamba) metadata until the next
        ``initialize_attention_state`` (``mamba_metadata`` itself stays, as in Megatron-Core)."""
        self.attention = None
        if self.mamba_metadata is not None:
            self.mamba_metadata.reset_varlen_metadata()
        if self.intermediates is not None:
            self.intermediates.end_step()

    def update(self, mask: Optional[np.ndarray], new_tokens: torch.Tensor, step, limits: tuple,
               new_drafts: Optional[torch.Tensor] = None, draft_counts=None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Apply one update: ``mask`` (host bool ``[active]``, None: every request kept) and the
        checked ``new_tokens`` (and ``new_drafts [k, active]`` with speculative steps, of which
        each row forwards its ``draft_counts``, host ints ``[active]``, or all ``k``), after
        ``step`` (the context's current step: None once anything changed since it was built).
        Returns the ids ``(newly paused, evicted, finished at max_sequence_length)``; the step
        ends."""
        table, device, steps = self.table, self.device, self.steps
        new_drafts = spec.check_draft_tokens(new_drafts, self.speculative, table.active,
                                             self.where)
        draft_counts = spec.check_draft_counts(draft_counts, self.speculative, table.active)
        if self.validate and new_drafts is not None:
            spec.check_forwarded_drafts(new_drafts, draft_counts, self.vocab_size)
        max_sequence_length = self.max_sequence_length
        chunked_id = table.chunked_id
        decode = None
        # Speculative: a plain step followed by another (no drafts given) updates as without
        # speculation (the drafts then move with no row: none is forwarded, none stays paused).
        plain = bool(self.speculative and draft_counts is not None and not draft_counts.any()
                     and not device.deferred_rewind and step is not None
                     and step.one_token_rows)
        # Speculative: every row forwards k drafts next (none deferred) takes the speculative
        # shortcut of plan_decode; ragged draft counts take the general plan.
        every = draft_counts is None and not device.deferred_rewind
        # With prefix caching, once every prompt block is published (no chain pending) a
        # decode update publishes nothing: its blocks come from the allocator as in the plan
        # (not yet for speculative steps or hybrids, whose updates the soak finds differ).
        if mask is None and self.decode_shortcut and (
                table.prefix_cache is None or not (table.prefix_cache.pending
                                                   or self.speculative or table.hybrid)) and (
                plain or every or not self.speculative):
            # What the step knows of a decode update spares the plan recomputing it.
            max_kv_offset, blocks = steps.decode_facts(step, table)
            decode = table.plan_decode(chunked_id=chunked_id,
                                       max_sequence_length=max_sequence_length,
                                       max_kv_offset=max_kv_offset, active_blocks=blocks,
                                       plain=plain)
        if decode is not None:
            # The steady decode step: nothing finishes, stays paused or is evicted.
            appended = table.commit_decode(decode)
            # (A speculative step's rows hold 1 + k tokens: the build computes its lengths.)
            steps.prepare(table, device.arena.host, limits,
                          None if self.speculative and not plain else decode.max_kv_offset,
                          decode.active_blocks)
            device.apply_decode(decode, appended, table, new_tokens, new_drafts)
            ids = EMPTY_IDS, EMPTY_IDS, EMPTY_IDS
        else:
            if mask is None:
                mask = np.ones(table.active, dtype=np.bool_)
            plan = self._plan(mask, chunked_id, max_sequence_length, draft_counts)
            if table.offload is not None:  # evicted rows' blocks to the host, before release
                table.offload.save_evicted(table, plan)
            table.commit_update(plan)
            if table.prefix_cache is not None:
                table.prefix_cache.drop_done(table.live_ids)
            steps.prepare(table, device.arena.host, limits)
            device.apply_update(plan, table, new_tokens, new_drafts)
            ids = (torch.from_numpy(plan.newly_paused_ids), torch.from_numpy(plan.evicted_ids),
                   torch.from_numpy(plan.max_length_ids))
        if self.kv_groups is not None:
            self.kv_groups.settle(table)   # the windows' blocks no longer read go back now
        self.reset_attention_state()
        self.step = None
        return ids

    def _plan(self, mask: np.ndarray, chunked_id: int, max_sequence_length: int,
              draft_counts: Optional[np.ndarray] = None):
        """The general update's plan; with prefix caching the step's computed blocks are
        published first (taken back if the plan raises) and a hybrid's snapshots saved once
        the plan stands (the slots still hold the states the forward left)."""
        table = self.table
        limits = dict(chunked_id=chunked_id, max_sequence_length=max_sequence_length,
                      draft_counts=draft_counts)
        if table.prefix_cache is None:
            return table.plan_update(mask, **limits)
        plan, snapshots = table.prefix_cache.plan_update(table, mask, **limits)
        if snapshots:
            self.mamba.save_snapshots(snapshots)
        return plan

    def rewind_kv_cache(self, accepted_counts) -> torch.Tensor:
        """Rewind the rejected drafts of this step's decode requests: ``accepted_counts``
        (``[active]`` integers; decode rows: drafts accepted, in ``[0, k]``; prefill rows:
        ignored) lowers each decode row's KV offset and last-block offset by ``k - accepted``,
        and a last block that then holds nothing goes back to the allocator (0.19's
        ``rewind_kv_cache``, on the host rows: docs/SEMANTICS.md §19); on a hybrid each decode
        row's Mamba state becomes its intermediate state after the accepted tokens. Once per
        step, between the forward pass and ``update_requests``; every check runs first. Returns
        the blocks released (int64 CPU)."""
        self.require("rewind_kv_cache")
        k, table = self.speculative, self.table
        if not k:
            raise RuntimeError("rewind_kv_cache() needs num_speculative_tokens > 0")
        if self.rewound:
            raise RuntimeError("rewind_kv_cache() was called already in this step")
        rows = table.paused + np.arange(self.step.drafted)
        drafts = table.rows[FIELD_QUERY, rows].astype(np.int64) - 1
        accepted = spec.check_accepted_counts(accepted_counts, drafts, table.active, k)
        plan = spec.plan_rewind(table, rows, drafts - accepted)
        table.commit_rewind(plan)
        if self.mamba is not None and plan.rows.size:
            # The state after the accepted tokens, from the intermediate states: one launch
            # (a row's state index is counted from the end: k - rejected).
            counts = self.device.spec.rewind_counts[:plan.rows.size]
            self.device.h2d.copy(counts, (k - accepted).astype(np.int32))
            slots = self.device.arena.device["req"][FIELD_MAMBA_SLOT,
                                                    plan.rows[0]:plan.rows[-1] + 1]
            self.mamba.rewind(counts, slots)
        if plan.dropped.size:
            self.device.host_table_written = True
        self.device.arena.dirty = True
        self.steps.prepared = None
        self.rewound = True
        return torch.from_numpy(plan.released)

    def rewind_tokens(self, rewind_counts) -> torch.Tensor:
        """Each active row's last ``rewind_counts[i]`` tokens dropped, across earlier steps
        (``token_rewind.rewind_tokens``)."""
        return token_rewind.rewind_tokens(self, rewind_counts)

    def defer_kv_rewind(self, accepted_counts: torch.Tensor) -> None:
        """The rejected drafts of this step's decode rows rewound on the device when their
        next step begins, on the host by ``settle_kv_rewind`` (``deferred_rewind.defer``)."""
        deferred_rewind.defer(self, accepted_counts)

    def enable_deferred_rewind(self) -> None:
        """This context's rewinds will be deferred (``defer_kv_rewind``): its device rows may
        then differ from the host's, so a CPU context's arena stops sharing the host buffer
        now (call it before capturing CUDA graphs: the arena's views move)."""
        if not self.speculative:
            raise RuntimeError("enable_deferred_rewind() needs num_speculative_tokens > 0")
        deferred_rewind.check_supported(self, "enable_deferred_rewind()")
        self.device.defer_rewinds()

    def settle_kv_rewind(self, request_ids, rejected_counts) -> torch.Tensor:
        """The host's side of deferred rewinds (``deferred_rewind.settle``)."""
        return deferred_rewind.settle(self, request_ids, rejected_counts)

    def logit_indices(self) -> torch.Tensor:
        """int64 ``[num_last_token_logits]``: the token rows verification needs, every decode
        token (``1 + k`` a decode request) then each prefill's last token (0.19's; under a
        CUDA graph, padded to its dimensions with padding token rows)."""
        self.require("speculative_required_logit_indices")
        if not self.speculative:
            return self.attention.cu_query_seq_lengths[1:self.table.active + 1].long() - 1
        return self.device.spec.logit_rows[:self.logit_count]

    def num_last_token_logits(self) -> int:
        """Rows ``last_token_logits`` gives: one per request, ``1 + k`` per decode request with
        speculative steps (0.19; a CUDA graph step counts its padded dimensions)."""
        self.require("num_last_token_logits")
        return spec.num_logit_rows(self.step, self.speculative)

    def paused_drafts(self) -> Optional[torch.Tensor]:
        """``paused_speculative_tokens``: int64 ``[k, paused]`` view of the drafts each paused
        request resumes with, or None (none paused, or k = 0)."""
        self.device.check_allocated()
        return self.device.paused_drafts(self.table.paused)

    def require(self, method: str):
        """The step's attention metadata; ``RuntimeError`` outside a step."""
        self.device.check_allocated()
        if self.attention is None:
            raise RuntimeError(f"{method}() is valid only between initialize_attention_state() "
                               "and the next update_requests()/reset_attention_state()")
        return self.attention

    def cu_query_lengths(self) -> Tuple[torch.Tensor, int]:
        """``(cu_query_lengths [padded_requests + 1] int32, max_seqlen_q)``."""
        meta = self.require("cu_query_lengths")
        return meta.cu_query_seq_lengths, meta.max_seqlen_q

    def cu_kv_lengths(self) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """``(cu_kv_lengths [padded_requests + 1], kv_seq_lengths [padded_requests],
        max_seqlen_k)``."""
        meta = self.require("cu_kv_lengths")
        return meta.cu_kv_seq_lengths, meta.kv_seq_lengths, meta.max_seqlen_k

    # ------------------------------------------------------------------ the KV cache
    def append_key_value_cache(self, layer_number: int, key: torch.Tensor,
                               value: Optional[torch.Tensor]) -> None:
        """Write the step's K and V (``[>= n, 1, H, D]`` or ``[>= n, H, D]``) into the cache;
        with ``cache_mla_latent``, ``key`` is the concatenated latent ``[>= n, 1, rank + rope]``
        and ``value`` is ignored. Tensors that require grad are written detached."""
        self.require("append_key_value_cache")
        layer = self.layers.index(layer_number)
        n, device = self.step.padded_tokens, self.device
        self.kv.append(layer, key, value, device.token_to_block_idx[:n],
                       device.token_to_local_position_within_kv_block[:n])

    def key_value_cache(self, layer_number: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(K, V)`` views ``[num_blocks, block_size, H, D]`` of one layer; with MLA
        ``(latent [num_blocks, block_size, rank + rope], None)``. The block table of the step
        is ``active_attn_metadata.block_table``."""
        self.device.check_allocated()
        return self.kv.views(self.layers.index(layer_number))

    def key_value_cache_scales(self, layer_number: int
                               ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Extension: an FP8 cache's ``(K scales, V scales)`` of one layer, fp32 ``[H]`` device
        views (MLA: the latent and rope scales ``[1]``); a stored value reads back as ``q *
        scale``. ``(None, None)`` when the cache is in ``params_dtype``."""
        self.device.check_allocated()
        return self.kv.layer_scales(self.layers.index(layer_number))

    # ------------------------------------------------------------------ rotary embeddings
    def _rope(self, name: str, tensor: torch.Tensor, table_name: str = "",
              table: Optional[torch.Tensor] = None) -> int:
        """Check a rope call against the step; returns the step's padded token count."""
        meta = self.require(f"rotary embedding of {name}")
        n = self.step.padded_tokens
        check_rope_call(name, tensor, n, self.where, table_name, table, meta.max_seqlen_k - 1)
        return n

    def apply_rotary_emb_query(self, query: torch.Tensor, query_emb: torch.Tensor, config: Any,
                               cu_seqlens_q: Any = None, cp_group: Any = None,
                               mscale: float = 1.0) -> torch.Tensor:
        """Rotate ``query[:n]`` in place with Megatron's angle table ``query_emb``
        ``[max_seq, 1, 1, rot]`` at the step's positions; returns ``query``."""
        rotary.check_cp_group(cp_group)
        n = self._rope("query", query, "query_emb", query_emb)
        rotary.rotate(query, None, self.device.token_to_pos_ids[:n], query_emb, config, mscale,
                      self.kernel_backend)
        return query

    def apply_rotary_emb_key(self, key: torch.Tensor, key_emb: torch.Tensor, config: Any,
                             cp_group: Any = None, mscale: float = 1.0) -> torch.Tensor:
        """Rotate ``key[:n]`` in place (decode steps included); returns ``key``."""
        rotary.check_cp_group(cp_group)
        n = self._rope("key", key, "key_emb", key_emb)
        rotary.rotate(None, key, self.device.token_to_position_in_request[:n], key_emb, config,
                      mscale, self.kernel_backend)
        return key

    def apply_fused_qk_rotary_emb(self, query: torch.Tensor, key: torch.Tensor,
                                  cos_sin_emb: torch.Tensor, config: Any
                                  ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate query and key in place, in one launch, from a ``cos_sin_emb``
        ``[max_seq, rot]`` cache (cos half, then sin half); FlashInfer when
        ``use_flashinfer_fused_rope`` asks for it. Returns ``[n, 1, H, D]`` views of the
        step's ``n`` tokens, as Megatron-Core does."""
        n = self._rope("query", query, "cos_sin_emb", cos_sin_emb)
        self._rope("key", key)
        return rotary.rotate_qk(query, key, self.device.token_to_pos_ids[:n], cos_sin_emb,
                                config, use_flashinfer=self.use_flashinfer, device=self.where,
                                backend=self.kernel_backend)

    def apply_rotary_emb_and_append_key_value_cache(
            self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            *, rotary_pos_emb: Optional[torch.Tensor] = None,
            cos_sin_emb: Optional[torch.Tensor] = None, config: Any = None,
            mscale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Extension: rotate query and key in place and append K/V, in one launch.

        Give either Megatron's angle table ``rotary_pos_emb`` or a ``cos_sin_emb`` cache.
        Returns ``(query, key)``.
        """
        self.device.check_allocated()
        if self.mla:
            raise NotImplementedError("fused rope + KV append is for the MHA cache, not MLA")
        layer = self.layers.index(layer_number)
        table, name = ((rotary_pos_emb, "rotary_pos_emb") if rotary_pos_emb is not None
                       else (cos_sin_emb, "cos_sin_emb"))
        n, device = self._rope("query", query, name, table), self.device
        self.kv.rope_append(layer, query, key, value, device.token_to_pos_ids[:n],
                            device.token_to_block_idx[:n],
                            device.token_to_local_position_within_kv_block[:n],
                            cos_sin_cache=cos_sin_emb, freqs=rotary_pos_emb, mscale=mscale,
                            **rotary.layout(config))
        return query, key

    # ------------------------------------------------------------------ logits
    def last_token_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[active, vocab]``: each active request's last-token row of ``logits``
        (``[1, padded_tokens, vocab]``)."""
        meta = self.require("last_token_logits")
        logits = check_logits(logits, self.where, self.vocab_size)
        padded = self.step.padded_tokens
        if logits.shape[0] != padded:
            raise ValueError(f"logits has {logits.shape[0]} token rows, the step has "
                             f"{padded} (padded_active_token_count)")
        if self.speculative:
            # Every decode token's row and each prefill's last (0.19's speculative gather).
            return logits.index_select(0, self.device.spec.logit_rows[:self.logit_count])
        return step_logits.last_rows(logits, meta.cu_query_seq_lengths, self.table.active,
                                     validate=self.validate, backend=self.kernel_backend)

    def calculate_log_probs(self, logits: torch.Tensor, new_tokens: torch.Tensor,
                            only_last_token_logits: Optional[bool] = False,
                            processed: Optional[Callable] = None
                            ) -> Tuple[List[List[float]], torch.Tensor]:
        """Log probs of the sampled tokens (decode) and of the prompt tokens (prefill), one list
        per active request; also returns the fp32 log-softmax of the rows used (``processed``:
        0.19's processed log probs, ``logits.log_probs``)."""
        meta = self.require("calculate_log_probs")
        if not isinstance(only_last_token_logits, (bool, np.bool_, type(None))):
            raise TypeError(f"only_last_token_logits={only_last_token_logits!r} must be a bool "
                            "or None")
        if self.speculative:
            raise NotImplementedError(
                "calculate_log_probs() with num_speculative_tokens > 0: the log probs of "
                "verified drafts are the engine's (Megatron-Core 0.19's controller computes them)")
        logits, table = check_logits(logits, self.where, self.vocab_size), self.table
        new_tokens = check_new_tokens(new_tokens, table.active, self.where,
                                      validate=self.validate, vocab_size=self.vocab_size)
        return step_logits.log_probs(
            logits, new_tokens, requests=table.active, tokens=table.active_tokens,
            last_only=bool(table.num_prefill == 0 or only_last_token_logits),
            input_ids=self.device.token_to_input_ids, cu_query_lengths=meta.cu_query_seq_lengths,
            query_lengths=table.rows[FIELD_QUERY, table.paused:table.total],
            validate=self.validate, backend=self.kernel_backend, processed=processed)

    # ------------------------------------------------------------------ Mamba layers
    def _mamba_layer(self, layer_number: int) -> int:
        self.device.check_allocated()
        if self.mamba is None:
            raise NotHybridError("mamba_states_cache() needs a hybrid model "
                                 "(mamba_inference_state_config)")
        return self.layers.index(layer_number, "M")

    def mamba_states_cache(self, layer_number: int, intermediate: bool = False
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(conv [max_requests, *conv_shape], ssm [max_requests, *ssm_shape])`` views of one
        Mamba layer; a request reaches its state through its slot
        (``mamba_metadata.request_to_mamba_state_idx`` and the batch indices). With
        ``intermediate`` (``num_speculative_tokens = k > 0``), the ``[max_requests, k + 1,
        ...]`` states after each token of a decode step, which ``rewind_kv_cache`` restores
        from (docs/SEMANTICS.md §19)."""
        layer = self._mamba_layer(layer_number)
        if intermediate:
            if not self.speculative:
                raise ValueError("mamba_states_cache(intermediate=True) needs "
                                 "num_speculative_tokens > 0")
            return self.mamba.intermediate(layer)
        return self.mamba.layer(layer)

    def gather_mamba_states(self, layer_number: int, slots: torch.Tensor
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Conv and SSM states ``[len(slots), ...]`` of one Mamba layer at ``slots`` (e.g.
        ``mamba_metadata.batch_indices_decode``); rows of slot -1 are zero. One launch each."""
        layer = self._mamba_layer(layer_number)
        return self.mamba.gather(layer, slots)

    def scatter_mamba_states(self, layer_number: int, slots: torch.Tensor, conv: torch.Tensor,
                             ssm: torch.Tensor) -> None:
        """Write conv and SSM states back to ``slots`` of one Mamba layer (slot -1 skipped)."""
        layer = self._mamba_layer(layer_number)
        self.mamba.scatter(layer, slots, conv, ssm)

    def reset_mamba_state(self) -> None:
        """Every Mamba slot free again (part of ``reset``; the state bytes are kept); refused
        with live requests, whose slots it would orphan."""
        if self.mamba is None:
            return
        self.device.check_allocated()
        if self.table.total:
            raise RuntimeError(f"reset_mamba_state() with {self.table.total} live requests "
                               "would orphan their Mamba slots; use reset()")
        self.table.reset_slots()
        self.device.arena.dirty = True
