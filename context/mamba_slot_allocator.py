"""Megatron-Core 0.19's ``MambaSlotAllocator``: a view of a hybrid's Mamba state snapshots.

0.19 keeps a hybrid's prefix-cache Mamba states in "slots" tied to KV block ids
(``block_to_slot``), registered under the block's hash, and extracts them inside the prefill's
SSM scan: at ``add_request`` it plans, per request, up to three offsets where the state is
wanted (``compute_and_store_offsets``: the KV divergence point, the last full block of the
prompt and the penultimate block, each kept only on a multiple of the Mamba chunk size), the
step's ``MambaMetadata`` carries them (``intermediate_count``), the model writes the states there
into scratch buffers (``intermediate_ssm_out`` / ``intermediate_conv_out``) and
``commit_intermediate_states`` copies them into slots after the forward.

dynctx keeps one store, ``MambaSnapshots`` (``mamba_states.py``): snapshots keyed by the block's
digest, taken at ``update_requests`` where a request's computed tokens end on a block boundary
(docs/SEMANTICS.md §17.5). This class gives 0.19's names over it, no second copy: a slot is a
snapshot index, ``conv_states`` / ``ssm_states`` are the snapshot tensors, ``block_to_slot``,
``slot_to_block`` and ``hash_to_block_id`` are computed from the snapshot index and the digest
table at each read, and a block's slot follows its digest (a block without a digest, one not
cached, has no slot). The extraction plan is 0.19's, per step (cleared at each update), for
0.19 model code that fills the scratch and commits; dynctx's own models keep the snapshots of
§17.5. docs/SEMANTICS.md §16 row 57 lists the differences.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from ._fields import FIELD_MAMBA_SLOT, FIELD_QUERY
from .block_allocator import _block_ids
from .megatron019 import MAX_INTERMEDIATE_OFFSETS_PER_REQUEST

__all__ = ["MAX_INTERMEDIATE_OFFSETS_PER_REQUEST", "MambaSlotAllocator"]


class MambaSlotAllocator:
    """0.19's Mamba prefix-cache slots as a view of ``snapshots`` (module docstring).

    Args:
        snapshots: the hybrid's ``MambaSnapshots``; states: its ``MambaStates``; table: the
            ``RequestTable`` (rows, block table, allocator, prefix cache).
        block_size, mamba_chunk_size, max_intermediate_count: the context's.
    """

    def __init__(self, snapshots, states, table, *, block_size: int, mamba_chunk_size: int,
                 max_intermediate_count: int):
        self._snap, self._states, self._table = snapshots, states, table
        self.block_size, self.mamba_chunk_size = int(block_size), int(mamba_chunk_size)
        self.num_mamba_layers = states.conv_shape[0]
        self.max_intermediate_count = int(max_intermediate_count)
        rows, k = table.max_requests, MAX_INTERMEDIATE_OFFSETS_PER_REQUEST
        # 0.19's per-request extraction plan (CPU), valid from add_request to the update.
        self._intermediate_offsets_cpu = torch.zeros((rows, k), dtype=torch.int32)
        self._intermediate_counts_cpu = torch.zeros(rows, dtype=torch.int32)
        self._intermediate_block_ids_cpu = torch.full((rows, k), -1, dtype=torch.int32)
        self._eos_cache_block_id_cpu = torch.full((rows,), -1, dtype=torch.int32)
        self._has_intermediates = False

    # ------------------------------------------------------------------ 0.19's state names
    max_slots = property(lambda self: self._snap.count, doc="Snapshots (0.19's durable slots)")
    free_count = property(lambda self: self._snap.slots.free_count)
    free_slots = property(lambda self: torch.from_numpy(self._snap.slots.free_slots))
    conv_states = property(lambda self: self._snap.conv,
                           doc="[mamba layers, max_slots, *conv shape]: the snapshots")
    ssm_states = property(lambda self: self._snap.ssm,
                          doc="[mamba layers, max_slots, *ssm shape]: the snapshots")
    intermediate_conv_out = property(
        lambda self: self._snap.scratch(self.max_intermediate_count)[0],
        doc="0.19's extraction scratch [layers, max_intermediate_count, ...] (at first use)")
    intermediate_ssm_out = property(
        lambda self: self._snap.scratch(self.max_intermediate_count)[1])

    def _held(self) -> List[tuple]:
        """``(block, slot)`` of every snapshot whose digest names a cached block."""
        entries = self._table.prefix_cache.entries
        return [(entries[d][0], slot) for d, slot in self._snap.index.items() if d in entries]

    @property
    def block_to_slot(self) -> torch.Tensor:
        """int32 ``[blocks]``: each cached block's snapshot index, -1 none (built per read)."""
        out = torch.full((self._table.allocator.total_count,), -1, dtype=torch.int32)
        for block, slot in self._held():
            out[block] = slot
        return out

    @property
    def slot_to_block(self) -> torch.Tensor:
        """int32 ``[max_slots]``: each snapshot's block, -1 none (built per read)."""
        out = torch.full((self.max_slots,), -1, dtype=torch.int32)
        for block, slot in self._held():
            out[slot] = block
        return out

    @property
    def hash_to_block_id(self) -> dict:
        """0.19's hash -> block id of the cached blocks with a snapshot (built per read)."""
        hashes = self._table.allocator.hash_ids
        return {int(hashes[block]): block for block, _ in self._held() if hashes[block] > 0}

    def _digest(self, block_id: Any) -> bytes:
        digest = self._table.prefix_cache.block_digest.get(int(block_id))
        if digest is None:
            raise ValueError(f"block {int(block_id)} is not a cached prompt block: a Mamba "
                             "state is kept for a cached block, under its digest")
        return digest

    # ------------------------------------------------------------------ slots
    def allocate_slots_batch(self, block_ids: Sequence[int]) -> List[int]:
        """A slot for each of ``block_ids`` (cached blocks): its own, else a free one, else
        the least recently used snapshot's; a block listed twice gets one slot. Its state is
        the caller's to write (``store_*``, ``commit_intermediate_states``)."""
        self._table.check_bound()   # a deallocated context: TensorStateDeallocatedError
        digests = [self._digest(b) for b in _block_ids(block_ids, "block_ids").tolist()]
        return [self._snap.take(d) for d in digests]

    def get_slot(self, block_id: int) -> int:
        digest = self._table.prefix_cache.block_digest.get(_block_id(block_id))
        return self._snap.index.get(digest, -1) if digest is not None else -1

    def has_state(self, block_id: int) -> bool:
        return self.get_slot(block_id) >= 0

    def invalidate_block(self, block_id: int) -> None:
        """Forget the block's snapshot (its slot free again)."""
        self._invalidate_blocks_batch([_block_id(block_id)])

    def _invalidate_blocks_batch(self, block_ids_list: Sequence[int]) -> None:
        digests = self._table.prefix_cache.block_digest
        blocks = _block_ids(block_ids_list, "block_ids_list").tolist()
        self._snap.drop([digests[b] for b in blocks if b in digests])

    def on_kv_blocks_deregistered(self, block_ids_list: list, hashes_to_delete: set) -> None:
        """0.19's callback; here the digest table drops a block's snapshot as it forgets the
        block (``DigestTable.on_forget``), so nothing is left to do."""

    # ------------------------------------------------------------------ store / restore
    def store_from_tensors(self, block_id: int, layer_idx: int, ssm_state: torch.Tensor,
                           conv_state: torch.Tensor) -> None:
        self._table.check_bound()   # a deallocated context: TensorStateDeallocatedError
        slot = self.get_slot(block_id)
        if slot < 0:
            raise ValueError(f"block {block_id} has no Mamba cache slot (allocate_slots_batch)")
        layers = self._snap.ssm.shape[0]
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)) \
                or not 0 <= layer_idx < layers:
            raise ValueError(f"layer_idx={layer_idx!r} must be an int in [0, {layers}) (the "
                             "Mamba layers)")
        for name, state, into in (("ssm_state", ssm_state, self._snap.ssm),
                                  ("conv_state", conv_state, self._snap.conv)):
            if not isinstance(state, torch.Tensor) or tuple(state.shape) != into.shape[2:] \
                    or state.device.type == "meta" or not state.is_floating_point():
                raise ValueError(f"{name} must be a floating tensor of shape "
                                 f"{list(into.shape[2:])} with data, got {_shape(state)}")
        self._snap.ssm[layer_idx, slot].copy_(ssm_state)
        self._snap.conv[layer_idx, slot].copy_(conv_state)

    def store_from_live_batch(self, slots: Sequence[int], request_indices: Sequence[int]) -> None:
        """Snapshots ``slots`` take the live states of the rows ``request_indices``."""
        self._table.check_bound()   # a deallocated context: TensorStateDeallocatedError
        targets = _block_ids(slots, "slots")
        indices = _block_ids(request_indices, "request_indices")
        if targets.size != indices.size:
            raise ValueError(f"slots has {targets.size} entries, request_indices {indices.size}")
        if np.any((targets < 0) | (targets >= self.max_slots)) \
                or np.unique(targets).size != targets.size:
            raise ValueError(f"slots={targets.tolist()}: each must lie in [0, max_slots="
                             f"{self.max_slots}), each once")
        if targets.size:
            rows = self._live_slots(indices, "request_indices")
            self._snap.copy_in(targets.tolist(), rows.tolist(), self._states.conv_states,
                               self._states.ssm_states)

    def _live_slots(self, indices: np.ndarray, name: str) -> np.ndarray:
        """The Mamba slots of the live rows ``indices`` (``ValueError`` naming ``name`` for a
        row outside the live ones)."""
        total = self._table.total
        slots = self._table.rows[FIELD_MAMBA_SLOT, np.clip(indices, 0, max(total - 1, 0))]
        if np.any((indices < 0) | (indices >= total) | (slots < 0)):
            raise ValueError(f"{name}={indices.tolist()}: each must be a live row in [0, "
                             f"total_request_count={total}) holding a Mamba slot")
        return slots

    def restore_to_live(self, request_idx: int, block_id: int) -> bool:
        """The row's live state takes the block's snapshot; False when it has none."""
        self._table.check_bound()   # a deallocated context: TensorStateDeallocatedError
        live = int(self._live_slots(_block_ids([request_idx], "request_idx"), "request_idx")[0])
        slot = self.get_slot(block_id)
        if slot < 0:
            return False
        self._states.restore_snapshots([(live, slot)])
        return True

    def register_block_hashes_batch(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """0.19 registers the hashes of blocks whose state it stored; a snapshot is matched
        by its block's digest as soon as it exists, so only those with one are touched (a hash
        without a stored state is not made matchable: never a wrong state)."""
        blocks, values = _block_ids(block_ids, "block_ids"), _block_ids(hashes, "hashes")
        if blocks.size != values.size:
            raise ValueError(f"hashes has {values.size} entries, block_ids {blocks.size}")
        for block, value in zip(blocks.tolist(), values.tolist()):
            if value > 0 and self.has_state(block):
                self._snap.index.move_to_end(self._digest(block))

    # ------------------------------------------------------------------ the extraction plan
    def compute_and_store_offsets(self, req: Any, current_id: int, skip_tokens: int,
                                  prefill_chunk_length: int, num_matched_blocks: int,
                                  matched_block_ids: list, overall_required_blocks: int) -> None:
        """0.19's plan for the chunk of ``req`` in row ``current_id``: the offsets (from the
        chunk's first computed token) of the KV divergence point, the last full block of the
        prompt and the penultimate block, each kept if it falls inside the chunk's computed
        tokens on a multiple of the Mamba chunk size; and, on a final chunk of a prompt of
        whole blocks, the last block, whose state is the live one after the forward (EOS)."""
        self._table.check_bound()   # a deallocated context: TensorStateDeallocatedError
        bs, row = self.block_size, _block_id(current_id, "current_id")
        if not 0 <= row < self._intermediate_counts_cpu.shape[0]:
            raise ValueError(f"current_id={row} must be a row in [0, max_requests="
                             f"{self._intermediate_counts_cpu.shape[0]})")
        prompt_len = len(req.prompt_tokens)
        finished = int(req.finished_chunk_token_count)
        start = finished + int(skip_tokens)
        computed = int(prefill_chunk_length) - int(skip_tokens)
        last_aligned = prompt_len // bs * bs
        candidates = (int(num_matched_blocks) * bs, last_aligned,
                      (int(overall_required_blocks) - 1) * bs)
        offsets = sorted({p - start for p in candidates
                          if 0 < p - start < computed and (p - start) % self.mamba_chunk_size == 0})
        table = self._table.block_table[row]
        if offsets:
            blocks = [int(table[(start + o) // bs - 1]) for o in offsets]
            self._intermediate_offsets_cpu[row, :len(offsets)] = torch.tensor(offsets)
            self._intermediate_block_ids_cpu[row, :len(offsets)] = torch.tensor(blocks)
            self._has_intermediates = True
        self._intermediate_counts_cpu[row] = len(offsets)
        last_chunk = finished + int(prefill_chunk_length) >= prompt_len
        eos = -1
        if last_chunk and prompt_len > 0 and last_aligned == prompt_len:
            eos = int(table[prompt_len // bs - 1])
            self._has_intermediates = True
        self._eos_cache_block_id_cpu[row] = eos

    def note_add(self, req: Any, plan: Any) -> None:
        """``compute_and_store_offsets`` for an ``admission.AddPlan`` just committed (every
        chunk, as 0.19)."""
        hit = plan.prefix
        skip = 0 if hit is None else hit.tokens
        matched = [] if hit is None else hit.blocks.tolist()
        self.compute_and_store_offsets(req, plan.row, skip, plan.chunk + skip, len(matched),
                                       matched, plan.needed)

    def _prefill_rows(self) -> tuple:
        table = self._table
        return table.paused + table.num_decode, table.num_prefill

    def get_intermediate_cpu_data(self):
        """``(offsets [prefills, 3], counts [prefills])`` of the step's prefill rows (CPU
        slices), or ``(None, None)``."""
        start, count = self._prefill_rows()
        if not self._has_intermediates or count == 0:
            return None, None
        return (self._intermediate_offsets_cpu[start:start + count],
                self._intermediate_counts_cpu[start:start + count])

    def transfer_intermediate_to_gpu(self, prefill_start: int, prefill_count: int):
        """The offsets and counts of rows ``[prefill_start, + prefill_count)`` on the device."""
        if prefill_count == 0:
            return None, None
        device = self._states.device
        rows = slice(prefill_start, prefill_start + prefill_count)
        return (self._intermediate_offsets_cpu[rows].to(device, non_blocking=True),
                self._intermediate_counts_cpu[rows].to(device, non_blocking=True))

    def begin_step(self, metadata) -> None:
        """The step's extraction in ``metadata`` (``MambaMetadata``): ``intermediate_count``,
        ``per_request_intermediate_counts`` and, per state, the Mamba chunk index and the
        absolute token index (among the prefill tokens) where it is taken."""
        offsets, counts = self.get_intermediate_cpu_data()
        if offsets is None:
            return
        start, count = self._prefill_rows()
        lengths = self._table.rows[FIELD_QUERY, start:start + count].astype(np.int64)
        chunk = self.mamba_chunk_size
        chunks = np.concatenate([[0], np.cumsum(np.maximum(-(-lengths // chunk), 1))])
        starts = np.concatenate([[0], np.cumsum(lengths)])
        per_request = counts.tolist()
        found = [(chunks[i] + o // chunk - 1, starts[i] + o) for i, n in enumerate(per_request)
                 for o in offsets[i, :n].tolist()]
        metadata.intermediate_count = len(found)
        metadata.per_request_intermediate_counts = per_request
        if found:
            device = self._states.device
            metadata.intermediate_chunk_indices = torch.tensor(
                [c for c, _ in found], dtype=torch.int64, device=device)
            metadata.intermediate_abs_positions = torch.tensor(
                [p for _, p in found], dtype=torch.int32, device=device)

    # ------------------------------------------------------------------ commit
    def commit_intermediate_states(self) -> None:
        """After the forward of a model that filled the scratch: each planned state of the
        step's prefill rows goes from ``intermediate_*_out`` into its block's slot, and each
        EOS block's from the row's live state; the plan is cleared."""
        metadata = self._table_metadata
        start, count = self._prefill_rows()
        if count == 0:
            return self._clear_intermediate_state()
        block_ids = self._intermediate_block_ids_cpu[start:start + count].tolist()
        eos = self._eos_cache_block_id_cpu[start:start + count].tolist()
        blocks, sources, offset = [], [], 0
        if metadata.intermediate_count > 0:
            for i, n in enumerate(metadata.per_request_intermediate_counts):
                blocks += block_ids[i][:n]
                sources += list(range(offset, offset + n))
                offset += n
        eos_rows = [start + i for i, b in enumerate(eos) if b >= 0]
        eos_blocks = [b for b in eos if b >= 0]
        if blocks or eos_blocks:
            slots = self.allocate_slots_batch(blocks + eos_blocks)
            if blocks:
                conv, ssm = self._snap.scratch(self.max_intermediate_count)
                self._snap.copy_in(slots[:len(blocks)], sources, conv, ssm)
            self.store_from_live_batch(slots[len(blocks):], eos_rows)
        self._clear_intermediate_state()

    _table_metadata = None   # the context's MambaMetadata (set with the allocator)

    def _clear_intermediate_state(self, rows: Optional[Any] = None) -> None:
        """Clear the plan of ``rows`` (a host index; None: every row, and the flag)."""
        index = slice(None) if rows is None else rows
        self._intermediate_counts_cpu[index] = 0
        self._intermediate_offsets_cpu[index] = 0
        self._intermediate_block_ids_cpu[index] = -1
        self._eos_cache_block_id_cpu[index] = -1
        if rows is None:
            self._has_intermediates = False

    def end_step(self) -> None:
        """The update ended the step: its plan goes (0.19 clears it at the commit)."""
        if self._has_intermediates:
            self._clear_intermediate_state()

    def reset(self) -> None:
        """Every snapshot forgotten and the plan cleared (the snapshot bytes kept)."""
        self._snap.clear()
        self._clear_intermediate_state()


def attach(mamba, table, metadata, forward, *, mamba_gb: Optional[float], block_size: int,
           mamba_chunk_size: int, max_intermediate_count: int) -> Optional[MambaSlotAllocator]:
    """The context's ``mamba_slot_allocator``: 0.19 builds one for a hybrid with prefix caching
    and ``prefix_caching_mamba_gb > 0`` (None otherwise); its step hooks go to the forward pass
    (``forward.intermediates``) and the metadata gets 0.19's per-step bound."""
    snapshots = None if mamba is None else mamba.snapshots
    if snapshots is None or not mamba_gb:
        return None
    allocator = MambaSlotAllocator(snapshots, mamba, table, block_size=block_size,
                                   mamba_chunk_size=mamba_chunk_size,
                                   max_intermediate_count=max_intermediate_count)
    allocator._table_metadata = metadata
    metadata.max_intermediate_count = allocator.max_intermediate_count
    forward.intermediates = allocator
    return allocator


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {value.dtype} on {value.device}"
    return type(value).__name__


def _block_id(value: Any, name: str = "block_id") -> int:
    """An int argument (``TypeError`` naming it: 1.5 would name block 1)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an int")
    return int(value)
