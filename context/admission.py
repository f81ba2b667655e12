"""``add_request`` as a plan: every check, then what the request table will write.

``plan_add`` reads the unchanged ``RequestTable`` and the request and raises (naming the
argument, the value and the limit) on anything that cannot be added; the ``AddPlan`` it returns
is applied by ``RequestTable.commit_add``, which cannot fail on it. ``plan_dummies`` does the
same for ``add_dummy_requests_parallel`` (``RequestTable.commit_dummies``), and
``capture_requests`` builds the dummy requests that give a step a CUDA graph's exact
dimensions, as megatron-core 0.16.1 does before a capture: ``decode_req_count`` one-token
requests (ids ``0..D-1``) added as decode rows, then ``prefill_req_count`` prefills sharing the
graph's prefill tokens (``graph_ladder.dummy_request_plan``); every token id 0, every block the
dummy block. ``check_availability`` and the prefix cache queries answer the engine's
scheduler from the unchanged table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from dynctx.kernels.devices import same_device

from ._fields import FIELD_IDS, FIELD_KV_OFFSET
from .batch_dimensions import InferenceBatchDimensions
from .errors import (
    BlockOverflowError,
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TokenOverflowError,
)
from .graph_ladder import dummy_request_plan
from .prefix_cache import PrefixHit, wants_every_prompt_logit
from .requests import DynamicInferenceRequest, SamplingParams, whole_number_ids
from .staging import numpy_dtype


@dataclass(frozen=True)
class AddPlan:
    """What ``commit_add`` writes for one request (or one chunk of it)."""

    request_id: int
    row: int
    is_continuation: bool
    chunk: int
    finished: int
    gen: int
    already: int               # blocks the request holds before this chunk
    needed: int                # blocks it holds after
    tokens_before: int         # tokens of the step before this chunk
    prompt_offset: int         # where its tokens go among the step's prompt tokens
    host_prompt: Optional[np.ndarray]
    device_prompt: Optional[torch.Tensor]
    metadata: Tuple[Any, ...]
    partial: bool              # the chunk leaves prompt tokens for a later continuation
    # Prefix caching (a new request): the matched blocks (``finished`` counts their tokens,
    # ``already`` the blocks) and the chain to publish; None without caching.
    prefix: Optional[PrefixHit] = None
    # KV offload (a new request saved on the host): its ``finished`` tokens come back from
    # the host into the first of its new blocks (``offload.Offload.commit_restore``).
    restore: Any = None


def check_request_id(request_id: Any) -> int:
    if isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer)):
        raise TypeError(f"request_id={request_id!r} must be an int")
    if not 0 <= request_id < 2 ** 31:
        raise ValueError(f"request_id={request_id} must lie in [0, 2**31) (-1 marks free rows)")
    return int(request_id)


def _request_lengths(req: Any, chunk_length: Optional[int]) -> Tuple[int, int, int]:
    if not isinstance(req, DynamicInferenceRequest) and not hasattr(req, "remaining_prompt_tokens"):
        raise TypeError(f"req must be a DynamicInferenceRequest, got {type(req).__name__}")
    remaining = req.remaining_prompt_tokens
    if remaining is None:
        raise ValueError(f"request {req.request_id}: prompt_tokens is missing")
    if isinstance(remaining, torch.Tensor):
        if remaining.is_floating_point() or remaining.is_complex() or remaining.dtype == torch.bool:
            raise TypeError(f"request {req.request_id}: prompt tokens must be integer ids, "
                            f"got dtype {remaining.dtype}")
        if remaining.dim() != 1:
            raise ValueError(f"request {req.request_id}: prompt tokens must be 1-D, got shape "
                             f"{tuple(remaining.shape)}")
    remaining_length = len(remaining)
    finished = req.finished_chunk_token_count
    if isinstance(finished, bool) or not isinstance(finished, (int, np.integer)) or finished < 0:
        raise ValueError(f"request {req.request_id}: finished_chunk_token_count={finished!r} "
                         "must be an int >= 0")
    if remaining_length == 0:
        raise ValueError(f"request {req.request_id}: the prompt is empty "
                         "(remaining_prompt_tokens has no tokens)")
    chunk = remaining_length if chunk_length is None else chunk_length
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or \
            not 0 < chunk <= remaining_length:
        raise ValueError(f"chunk_length={chunk_length!r} must be an int in [1, "
                         f"{remaining_length}] (the remaining prompt length)")
    return int(chunk), remaining_length, int(finished)


def _tokens_to_generate(request_id: int, params: Any) -> int:
    """``params.num_tokens_to_generate`` checked; ``params`` is the request's
    ``sampling_params`` (a ``TypeError`` names it when it is not one)."""
    if not hasattr(params, "num_tokens_to_generate"):
        raise TypeError(f"request {request_id}: sampling_params must be a SamplingParams, got "
                        f"{type(params).__name__}")
    gen = params.num_tokens_to_generate
    if gen is None:
        raise ValueError(f"request {request_id}: num_tokens_to_generate=None must be >= 0")
    if isinstance(gen, bool) or not isinstance(gen, (int, np.integer, float, np.floating)):
        raise TypeError(f"request {request_id}: num_tokens_to_generate={gen!r} must be an int, "
                        f"got {type(gen).__name__}")
    if isinstance(gen, (float, np.floating)) and not float(gen).is_integer():
        raise ValueError(f"request {request_id}: num_tokens_to_generate={gen!r} must be a whole "
                         "number of tokens")
    if gen < 0:
        raise ValueError(f"request {request_id}: num_tokens_to_generate={gen} must be >= 0")
    return int(gen)


def metadata_values(req: DynamicInferenceRequest, metadata_types: list) -> Tuple[Any, ...]:
    """The request's metadata as numpy scalars of the context's dtypes; raises ValueError
    naming the field when a value does not fit."""
    values = []
    for (label, dtype, _), value in zip(metadata_types, req.tracked_metadata):
        np_type = numpy_dtype(dtype)
        if np.issubdtype(np_type, np.integer):
            info = np.iinfo(np_type)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or not info.min <= value <= info.max:
                raise ValueError(f"request {req.request_id}: {label}={value!r} must be an int "
                                 f"in [{info.min}, {info.max}] ({dtype})")
        elif np_type is np.bool_:
            if not isinstance(value, (bool, np.bool_, int, np.integer)):
                raise ValueError(f"request {req.request_id}: {label}={value!r} must be a bool")
        else:
            if not isinstance(value, (int, float, np.number)) or math.isnan(value):
                raise ValueError(f"request {req.request_id}: {label}={value!r} must be a "
                                 "number (not NaN)")
        values.append(np_type(value))
    return tuple(values)


def _prompt(request_id: int, prompt: Any, device: torch.device, vocab_size: Optional[int]):
    """``(host int64 array, None)`` for host prompts (ids checked), ``(None, tensor)`` for
    prompts already on the context's device."""
    if isinstance(prompt, torch.Tensor) and prompt.device.type != "cpu":
        if not same_device(prompt.device, device):
            raise ValueError(f"request {request_id}: prompt tokens live on {prompt.device}, the "
                             f"context on {device}")
        return None, prompt
    host = whole_number_ids(prompt.numpy() if isinstance(prompt, torch.Tensor) else prompt,
                            f"request {request_id}: prompt tokens")
    if host.size and host.min() < 0:
        raise ValueError(f"request {request_id}: prompt token ids must be >= 0")
    if vocab_size is not None and host.size and host.max() >= vocab_size:
        raise ValueError(f"request {request_id}: prompt token id {host.max()} is outside the "
                         f"vocabulary (vocab_size={vocab_size})")
    return host, None


def plan_add(table, req: Any, chunk_length: Optional[int], *, max_sequence_length: int,
             metadata_types: list, device: torch.device, vocab_size: Optional[int]) -> AddPlan:
    """Check ``add_request(req, chunk_length)`` against the table; change nothing."""
    request_id = check_request_id(getattr(req, "request_id", None))
    chunk, remaining_length, finished = _request_lengths(req, chunk_length)
    block_size = table.block_size
    paused, total = table.paused, table.total
    is_continuation = finished > 0
    gen = _tokens_to_generate(request_id, getattr(req, "sampling_params", None))
    # As Megatron-Core's context, a generation budget beyond max_sequence_length is accepted
    # (its engine, and ours, refuse such requests at admission); update_requests finishes a
    # request when it reaches max_sequence_length. The prompt itself must fit: the block table
    # holds max_sequence_length tokens per request.
    prompt_length = finished + remaining_length
    if prompt_length > max_sequence_length:
        raise MaxSequenceLengthOverflowError(
            request_id, f"prompt ({prompt_length} tokens) exceeds max_sequence_length "
            f"({max_sequence_length}), the tokens a request's block-table row holds")
    if prompt_length + gen >= 2 ** 31:
        raise ValueError(f"request {request_id}: prompt ({prompt_length}) + "
                         f"num_tokens_to_generate ({gen}) must stay below 2**31 (the output "
                         "length is an int32 field)")
    if is_continuation:
        last_id = int(table.rows[FIELD_IDS, total - 1]) if total > paused else None
        if last_id != request_id or table.num_prefill:
            raise ValueError(
                f"request {request_id}: finished_chunk_token_count={finished} marks a "
                f"continuation, but the last active row holds request {last_id}: continue "
                "a chunked prefill first thing in the step after its previous chunk")
        if table.partial_id != request_id:
            raise ValueError(
                f"request {request_id}: finished_chunk_token_count={finished} marks a "
                "continuation, but the request is decoding, not a chunked prefill (its whole "
                "prompt was added): a continuation would replace its sampled token")
        cached = int(table.rows[FIELD_KV_OFFSET, total - 1])
        if finished != cached:
            raise ValueError(
                f"request {request_id}: finished_chunk_token_count={finished} does not match "
                f"the {cached} prompt tokens the context cached for it")
        row = total - 1
        tokens_before = table.active_tokens - 1
    else:
        if request_id in table.live_ids:
            raise ValueError(f"request_id={request_id} is already in the context")
        if total >= table.request_limit:
            raise RequestOverflowError(request_id, f"all {table.request_limit} request rows "
                                                   "are in use (max_requests)")
        if table.partial_id != -1:
            raise ValueError(f"request {request_id}: the chunked prefill request "
                             f"{table.partial_id} must stay the last active row; add new "
                             "requests before its next chunk, not after it")
        if table.hybrid and table.continuation_added:
            raise ValueError(f"request {request_id}: on a hybrid model the continuation chunk "
                             "added in this step must stay the last row (it alone starts "
                             "from its saved Mamba state); add new requests in the next step")
        row = total
        tokens_before = table.active_tokens
    partial = chunk < remaining_length
    host_prompt, device_prompt = _prompt(request_id, req.remaining_prompt_tokens[:chunk],
                                         device, vocab_size)
    prefix, skip = None, 0
    restore = None if table.offload is None or is_continuation else \
        table.offload.plan_restore(req, request_id, chunk)
    if restore is not None:
        # Its saved tokens are not computed: the chunk's queries start after them.
        skip = restore.entry.tokens
        finished, chunk = skip, chunk - skip
        if host_prompt is not None:
            host_prompt = host_prompt[skip:]
        else:
            device_prompt = device_prompt[skip:]
        if table.prefix_cache is not None:   # it matches nothing, but publishes its blocks
            prefix = replace(table.prefix_cache.plan_match(req, request_id, chunk, False),
                             restored=True)
    elif table.prefix_cache is not None and not is_continuation:
        # The matched blocks' tokens are not computed: the chunk's queries start after them.
        prefix = table.prefix_cache.plan_match(
            req, request_id, chunk, allow_hit=not wants_every_prompt_logit(req))
        skip = prefix.tokens
        finished, chunk = skip, chunk - skip
        if skip:
            if host_prompt is not None:
                host_prompt = host_prompt[skip:]
            else:
                device_prompt = device_prompt[skip:]
    if tokens_before + chunk > table.max_tokens:
        raise TokenOverflowError(request_id, f"{tokens_before} tokens in the step + chunk "
                                             f"{chunk} > max_tokens ({table.max_tokens})"
                                 + (f" ({skip} prompt tokens cached)" if skip else ""))
    # A restored request holds no block yet: every block is new. A hit holds the shared ones.
    already = 0 if restore is not None else int(prefix.blocks.size) if prefix is not None \
        else math.ceil(finished / block_size)
    needed = math.ceil((finished + chunk) / block_size)
    # The hit's idle blocks leave the free stack, and each host-tier block needs a new one.
    revived = 0 if prefix is None else prefix.taken
    if not table.allocator.is_memory_available(needed - already,
                                               potential_matched_count=revived):
        raise BlockOverflowError(request_id, f"needs {needed - already + revived} blocks, "
                                             f"{table.allocator.total_avail} free"
                                 + (f" ({revived} of them cached blocks it revives or "
                                    "restores from the host)" if revived else ""))
    metadata = () if is_continuation else metadata_values(req, metadata_types)
    if table.hybrid and not is_continuation and table.slots.free_count == 0:
        raise ContextOverflowError(request_id, "No Mamba slots available")
    # Decode rows take their pending token; dummy decode rows (fed_decode) read the prompt
    # buffer like prefills, ahead of them. Speculative steps feed every row from the prompt
    # buffer (the device writes the decode rows' tokens there): its offsets are the tokens'.
    num_decode = 0 if table.speculative else \
        table.num_decode - table.fed_decode - (1 if is_continuation else 0)
    return AddPlan(request_id=request_id, row=row, is_continuation=is_continuation,
                   chunk=chunk, finished=finished, gen=gen, already=already, needed=needed,
                   tokens_before=tokens_before, prompt_offset=tokens_before - num_decode,
                   host_prompt=host_prompt, device_prompt=device_prompt, metadata=metadata,
                   partial=partial, prefix=prefix, restore=restore)


@dataclass(frozen=True)
class DummyPlan:
    """What ``commit_dummies`` writes for ``add_dummy_requests_parallel``: rows ``[row, row +
    len(ids))`` whose blocks are all the dummy block (no block is allocated)."""

    row: int
    ids: np.ndarray            # int64 [n]
    lengths: np.ndarray        # int64 [n] prompt tokens
    gens: np.ndarray           # int64 [n] num_tokens_to_generate
    blocks: np.ndarray         # int64 [n] blocks each row spans (all the dummy block)
    metadata: Tuple[Tuple[Any, ...], ...]
    host_prompts: Tuple[Optional[np.ndarray], ...]
    device_prompts: Tuple[Optional[torch.Tensor], ...]
    prompt_offset: int         # where the first row's tokens go among the step's prompt tokens
    count_as_prefill: bool


def plan_dummies(table, requests: Any, count_as_prefill: bool, *, max_sequence_length: int,
                 metadata_types: list, device: torch.device, vocab_size: Optional[int],
                 max_tokens: int) -> DummyPlan:
    """Check ``add_dummy_requests_parallel(requests, count_as_prefill)``; change nothing."""
    if isinstance(requests, (DynamicInferenceRequest, str)) or not hasattr(requests, "__len__"):
        raise TypeError("requests must be a sequence of DynamicInferenceRequest, got "
                        f"{type(requests).__name__}")
    requests = list(requests)
    if not isinstance(count_as_prefill, (bool, np.bool_)):
        raise TypeError(f"count_as_prefill={count_as_prefill!r} must be a bool")
    n = len(requests)
    ids, lengths, gens, metadata, host_prompts, device_prompts = [], [], [], [], [], []
    for req in requests:
        if not isinstance(req, DynamicInferenceRequest):
            raise TypeError(f"add_dummy_requests_parallel takes DynamicInferenceRequest "
                            f"objects, got {type(req).__name__}")
        request_id = check_request_id(req.request_id)
        if req.finished_chunk_token_count:
            raise ValueError(f"request {request_id}: finished_chunk_token_count="
                             f"{req.finished_chunk_token_count}: dummy requests are whole "
                             "prompts (no chunked continuation)")
        length, _, _ = _request_lengths(req, None)
        if length > max_sequence_length:
            raise MaxSequenceLengthOverflowError(
                request_id, f"prompt ({length} tokens) exceeds max_sequence_length "
                f"({max_sequence_length})")
        gen = _tokens_to_generate(request_id, getattr(req, "sampling_params", None))
        if length + gen >= 2 ** 31:
            raise ValueError(f"request {request_id}: prompt ({length}) + num_tokens_to_generate "
                             f"({gen}) must stay below 2**31")
        host, on_device = _prompt(request_id, req.remaining_prompt_tokens, device, vocab_size)
        ids.append(request_id)
        lengths.append(length)
        gens.append(gen)
        metadata.append(metadata_values(req, metadata_types))
        host_prompts.append(host)
        device_prompts.append(on_device)
    if len(set(ids)) != n or table.live_ids.intersection(ids):
        taken = sorted(set(i for i in ids if ids.count(i) > 1) | table.live_ids.intersection(ids))
        raise ValueError(f"request ids {taken} are already in the context or listed twice")
    last = ids[-1] if ids else None
    if table.total + n > table.request_limit:
        raise RequestOverflowError(last, f"{table.total} rows in use + {n} dummy requests > "
                                         f"max_requests ({table.request_limit})")
    tokens = int(sum(lengths))
    if table.active_tokens + tokens > max_tokens:
        raise TokenOverflowError(last, f"{table.active_tokens} tokens in the step + {tokens} "
                                       f"dummy tokens > max_tokens ({max_tokens})")
    if n and table.partial_id != -1:
        raise ValueError(f"the chunked prefill request {table.partial_id} must stay the last "
                         "active row; add dummy requests before its next chunk")
    if n and table.hybrid and table.continuation_added:
        raise ValueError("on a hybrid model the continuation chunk added in this step must stay "
                         "the last row; add dummy requests in the next step")
    if n and not count_as_prefill and table.num_prefill:
        raise ValueError(f"count_as_prefill=False adds decode rows, which must precede the "
                         f"{table.num_prefill} prefill rows of the step; add them first")
    if n and table.hybrid and table.slots.free_count < n:
        raise ContextOverflowError(last, f"No Mamba slots available ({table.slots.free_count} "
                                         f"free for {n} dummy requests)")
    lengths = np.asarray(lengths, dtype=np.int64)
    real_decode = 0 if table.speculative else table.num_decode - table.fed_decode
    return DummyPlan(
        row=table.total, ids=np.asarray(ids, dtype=np.int64), lengths=lengths,
        gens=np.asarray(gens, dtype=np.int64), blocks=-(-lengths // table.block_size),
        metadata=tuple(metadata), host_prompts=tuple(host_prompts),
        device_prompts=tuple(device_prompts),
        prompt_offset=table.active_tokens - real_decode, count_as_prefill=bool(count_as_prefill))


def check_request(req: Any) -> None:
    """The queries' ``req`` is a request (``add_request``'s ``TypeError``)."""
    if not isinstance(req, DynamicInferenceRequest) and not hasattr(req, "remaining_prompt_tokens"):
        raise TypeError(f"req must be a DynamicInferenceRequest, got {type(req).__name__}")


def check_availability(table, req: Any) -> Tuple[bool, bool, bool]:
    """``(request slot free, tokens fit, KV blocks available)`` for the whole remaining prompt
    of ``req``, less what the prefix cache holds of it; host only."""
    check_request(req)
    table.check_bound(getattr(req, "request_id", None))
    remaining, finished = req.remaining_prompt_length, req.finished_chunk_token_count
    skip, shared, taken = (0, 0, 0) if table.prefix_cache is None else \
        table.prefix_cache.lookup(req)
    bs = table.block_size
    blocks = math.ceil((remaining + finished) / bs) - math.ceil(finished / bs) - shared
    restored = 0 if table.offload is None else table.offload.lookup(req)
    if restored:  # KV offload: the saved tokens cost no step tokens, every block is new
        skip, taken, blocks = restored, 0, math.ceil(remaining / bs)
    return (table.total < table.request_limit and table.paused == 0,
            table.active_tokens + remaining - skip <= table.max_tokens,
            table.allocator.is_memory_available(blocks, potential_matched_count=taken))


def prefix_cache_lookup(table, req: Any) -> int:
    """Prompt tokens the next ``add_request`` of the new request ``req`` would take from the
    prefix cache, or restore from the host (KV offload), when its chunk covers them and one
    token more; 0 without either. Host only (a prompt on the device is copied once)."""
    check_request(req)
    table.check_bound(getattr(req, "request_id", None))
    if table.offload is not None and table.offload.lookup(req):
        return table.offload.lookup(req)   # KV offload: the request's saved tokens
    return 0 if table.prefix_cache is None else table.prefix_cache.lookup(req)[0]


def prefix_cache_first_chunk_boundary(table, req: Any) -> int:
    """Hybrids with prefix caching: the prompt position the first chunk of the new request
    ``req`` should end at, so that its Mamba state at the end of its cached blocks is
    snapshotted for later requests (0: no such boundary; always 0 for other models)."""
    check_request(req)
    table.check_bound(getattr(req, "request_id", None))
    return 0 if table.prefix_cache is None else table.prefix_cache.first_chunk_boundary(req)


def get_prefix_cache_stats(table) -> dict:
    """Megatron-Core 0.19's counters (``prefix_cache_hits``, ``..._blocks_matched``,
    ``..._prefill_skipped_tokens``, ``..._prefill_computed_tokens``) plus lookups, the hit rates
    and the cached blocks now (``PrefixCache.stats_dict``); empty without caching."""
    return {} if table.prefix_cache is None else table.prefix_cache.stats_dict()


def capture_requests(table, graph_dimensions: InferenceBatchDimensions, *,
                     max_tokens: int, max_sequence_length: int
                     ) -> Tuple[List[DynamicInferenceRequest], List[DynamicInferenceRequest]]:
    """``(decode requests, prefill requests)`` of ``graph_dimensions``'s dummies for the empty
    ``table``; changes nothing.

    Raises ``TypeError`` for anything but an ``InferenceBatchDimensions``, ``RuntimeError``
    when the table holds requests, ``ValueError`` for dimensions no dummy set can give (a
    chunked-prefill graph, fewer prefill tokens than prefill requests), and the context's
    overflow errors when they exceed ``max_requests``, ``max_tokens``, ``max_sequence_length``
    or (hybrids) the free Mamba slots.
    """
    if not isinstance(graph_dimensions, InferenceBatchDimensions):
        raise TypeError(f"graph_dimensions must be an InferenceBatchDimensions, got "
                        f"{type(graph_dimensions).__name__}")
    if table.total:
        raise RuntimeError(
            f"add_dummy_requests_for_cudagraph_capture needs an empty context, it holds "
            f"{table.total} requests (call reset() first)")
    per_decode = table.decode_query
    decode, prefill_lengths = dummy_request_plan(graph_dimensions, per_decode)
    count, tokens = decode + len(prefill_lengths), decode * per_decode + sum(prefill_lengths)
    if count > table.request_limit:
        raise RequestOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                              f"requests > max_requests ({table.request_limit})")
    if tokens > max_tokens:
        raise TokenOverflowError(count - 1, f"graph {graph_dimensions} needs {tokens} "
                                            f"tokens > max_tokens ({max_tokens})")
    if prefill_lengths and prefill_lengths[0] > max_sequence_length:
        raise MaxSequenceLengthOverflowError(
            decode, f"graph {graph_dimensions} needs a {prefill_lengths[0]}-token prefill > "
            f"max_sequence_length ({max_sequence_length})")
    if table.hybrid and table.slots.free_count < count:
        raise ContextOverflowError(count - 1, f"graph {graph_dimensions} needs {count} "
                                              "Mamba slots; No Mamba slots available")
    # Megatron's dummies: prompts of token 0, one token to generate, no termination id.
    params = SamplingParams(num_tokens_to_generate=1, termination_id=-1)
    zeros = torch.zeros(max([per_decode] + prefill_lengths), dtype=torch.int64)
    # A decode dummy holds 1 + num_speculative_tokens tokens (0.19's capture dummies).
    decode_requests = [DynamicInferenceRequest(request_id=i, prompt_tokens=zeros[:per_decode],
                                               sampling_params=params) for i in range(decode)]
    prefill_requests = [DynamicInferenceRequest(request_id=decode + i,
                                                prompt_tokens=zeros[:length],
                                                sampling_params=params)
                        for i, length in enumerate(prefill_lengths)]
    return decode_requests, prefill_requests
