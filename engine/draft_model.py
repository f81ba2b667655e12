"""The draft-model drafter: a smaller transformers causal LM of the target's vocabulary drafts
greedily in its own dynctx context, kept in step with the target's requests.

The drafter follows the target's requests (``engine/drafters.py``): the draft context holds
every request the target holds, for its whole life in the target.

* **Admitted** when the target admits it (``admit``): its prompt joins the draft scheduler's
  queue (the engine's ``Scheduler`` over the draft context: chunked when it does not fit a
  step) and is prefilled in the draft's next forward pass, in the same target step.
* **Each target step** (``propose``, after the target verified its drafts): the draft context
  is in the middle of its last step (the forward of the previous round ran, its update waits).
  Each request's tokens are compared with the target's history: the draft's own tokens past
  the first difference are rewound (``rewind_tokens``: the rejected drafts, across the draft
  steps that cached them) and ``update_requests`` gives each row its next token: the first
  token of the history it has not forwarded yet (the target's bonus token; the last accepted
  draft too, when every draft was accepted). Then ``k`` draft decode steps (``k + 1`` when a
  row has two tokens to catch up, fewer for rows that need fewer), each forwarding every row's
  next token: a token the history dictates, else the draft's own argmax, which is a draft.
  The last step's update waits for the next round. While the target chunks a prompt (no
  drafts, ``k = 0``) the draft runs a step only for its own admissions.
* **Paused** with the target's row: a request the target paused is missing from ``propose``;
  its draft row goes back, at each round, to where the target left it (its drafts kept), so
  it never grows while paused (the draft context forwards every row it holds, so the paused
  row's step tokens are recomputed and dropped).
* **Evicted or finished** (``release``): the row is finished at the next round's update; a
  request the target re-adds (after an eviction or a suspend) comes back through ``admit``
  with its generated tokens in the prompt, as a new draft request.

The draft context is sized from the target's (``bind``): the same block size and request rows,
the target's token budget plus a token a row, and its blocks plus a few a row, so that it holds
whatever the target holds. Options given to the drafter win over these sizes: should the
draft context then pause or evict a row of its own, or finish one at the draft model's
``max_position_embeddings``, that row gets the n-gram drafter's proposal until it is back in
step; should it find no row able to run, it starts over, every request re-added. Drafts never
change the outputs, only how many are accepted. Greedy drafts are deterministic:
verification treats them as one-hot proposals. A draft model with sliding windows keeps every
block (``kv_groups=False``: a rewind may reach tokens a window passed); a hybrid draft model
(Mamba layers) is refused at ``bind``: its states cannot go back to earlier steps.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from dynctx.context import DynamicInferenceRequest, SamplingParams

from .drafters import NgramDrafter, check_drafter
from .scheduler import Scheduler


class DraftSequence:
    """One target request in the draft context. ``tokens[:length]``: what the draft row should
    hold (the target's history, ``known`` tokens long, then the draft's own tokens); ``cached``:
    the tokens the draft context holds (forwarded; in the middle of a step, that step's too),
    of which the first ``valid`` equal ``tokens``; ``pending``: the token the draft context
    forwards next (None while its prompt is added); ``anchor``: where a paused target row's
    draft row goes back to; ``state``: "queued" (in the draft scheduler), "live" (a row),
    "leaving" (its row finishes at the next update) or "gone" (the draft context cannot hold it
    any more); ``request``/``prompt``: the draft request the scheduler adds."""

    __slots__ = ("draft_id", "tokens", "length", "known", "cached", "valid", "pending",
                 "anchor", "state", "request", "prompt")

    def __init__(self, draft_id: int, tokens: np.ndarray):
        self.draft_id = draft_id
        self.tokens = np.zeros(max(32, 2 * len(tokens)), dtype=np.int64)
        self.tokens[:len(tokens)] = tokens
        self.length = self.known = self.anchor = len(tokens)
        self.cached = self.valid = 0
        self.pending: Optional[int] = None
        self.state = "queued"
        self.request: Optional[DynamicInferenceRequest] = None
        self.prompt: Optional[np.ndarray] = None

    def _room(self, length: int) -> None:
        if length > self.tokens.size:
            grown = np.zeros(max(length, 2 * self.tokens.size), dtype=np.int64)
            grown[:self.length] = self.tokens[:self.length]
            self.tokens = grown

    def follow(self, history: np.ndarray) -> None:
        """The target's ``history``: kept where ``tokens`` continue it, else ``tokens`` become
        it (what followed the first difference goes, and ``valid`` stops there)."""
        n = len(history)
        upto = min(n, self.length)
        differ = np.flatnonzero(self.tokens[:upto] != history[:upto])
        first = int(differ[0]) if differ.size else upto
        if first < n:
            self._room(n)
            self.tokens[first:n] = history[first:]
            self.length = n
            self.valid = min(self.valid, first)
        self.known = n

    def truncate(self, length: int) -> None:
        if self.length > length:
            self.length = length
            self.valid = min(self.valid, length)

    def append(self, token: int) -> None:
        self._room(self.length + 1)
        self.tokens[self.length] = token
        self.length += 1

    def drafts(self, width: int) -> np.ndarray:
        """Up to ``width`` drafts after the history, each sampled from forwarded tokens that
        all equal ``tokens``."""
        count = max(0, min(width, self.length - self.known, self.valid + 1 - self.known))
        return self.tokens[self.known:self.known + count]


class DraftModelDrafter:
    """Drafts with ``hf_model`` (a transformers causal LM) in a context of its own, kept in step
    with the target's requests (module docstring). ``engine_class.from_transformers`` builds
    the draft model's adapter and context at ``bind``, from ``engine_options`` (the kernel
    backend, the device, ...) and the sizes the target's context gives; an option given here
    wins. Counters: ``rounds`` (``propose`` calls that ran the draft), ``forward_passes``,
    ``tokens_processed`` and ``rewound_tokens`` of the draft context; what only a draft budget
    given smaller than the target's makes happen: ``own_pauses`` and ``own_evictions`` (rows
    the draft context paused or evicted by itself), ``restarts`` (the draft context emptied and
    its requests re-added: ``update_requests`` found no row able to run)."""

    follows_requests = True

    def __init__(self, hf_model: Any, engine_class: Any, **engine_options: Any):
        if engine_options.get("enable_prefix_caching"):
            raise ValueError("enable_prefix_caching=True for the draft model's context: a "
                             "draft row's rewind may reach the last token of its prompt, "
                             "whose block prefix caching would have published")
        self.hf_model, self.engine_class = hf_model, engine_class
        self.options = dict(engine_options)
        self.vocab_size = int(hf_model.config.vocab_size)
        self.fallback = NgramDrafter()
        self.engine: Any = None
        self.context: Any = None
        self.scheduler: Optional[Scheduler] = None
        self.by_target: Dict[int, DraftSequence] = {}
        self.by_draft: Dict[int, DraftSequence] = {}
        self.next_id = 0
        self.in_step = False     # the draft context's last forward waits for its update
        self.rounds = self.forward_passes = self.tokens_processed = self.rewound_tokens = 0
        self.restarts = self.own_pauses = self.own_evictions = 0

    # ------------------------------------------------------------------ the interface
    def bind(self, target: Any) -> None:
        """Build the draft context, sized from the ``target`` context (module docstring)."""
        k = int(getattr(target, "num_speculative_tokens", 0) or 0)
        bs, rows = int(target.block_size_tokens), int(target.max_requests)
        per_row = math.ceil((k + 4) / bs) + 1
        blocks = int(target.block_allocator.total_count) + rows * per_row + 2
        limit = int(getattr(self.hf_model.config, "max_position_embeddings", 0) or 0)
        length = int(target.max_sequence_length) + k + 4
        sizes = dict(block_size_tokens=bs, max_requests=rows,
                     max_tokens=int(target.max_tokens) + rows,
                     max_sequence_length=min(length, limit) if limit else length,
                     buffer_size_gb=blocks * kv_bytes_per_block(self.hf_model, bs) / 1024 ** 3,
                     paused_buffer_size_gb=0.0, cuda_graphs=False, kv_groups=False)
        sizes.update(self.options)
        engine = self.engine_class.from_transformers(self.hf_model, **sizes)
        context = engine.context
        if context.is_hybrid_model:
            raise ValueError(f"drafter={type(self.hf_model).__name__}: a draft model with Mamba "
                             "layers cannot rewind its rejected drafts past the step in flight "
                             "(rewind_tokens); use one of attention layers")
        self.engine, self.context, self.model = engine, context, engine.model
        self.scheduler = Scheduler(context, enable_chunked_prefill=True)

    def admit(self, request_id: int, prompt: np.ndarray) -> None:
        """The target added request ``request_id`` with ``prompt``: its draft request joins
        the draft scheduler's queue (one it held before is replaced)."""
        self._check_bound()
        self.release([request_id])
        seq = self.by_target[int(request_id)] = self._new(np.asarray(prompt, dtype=np.int64))
        seq.anchor = seq.length

    def release(self, request_ids: Sequence[int]) -> None:
        """The requests left the target: a queued draft request leaves the queue; a row
        finishes at the next update."""
        for request_id in request_ids:
            seq = self.by_target.pop(int(request_id), None)
            if seq is None:
                continue
            if seq.state == "queued":
                self.scheduler.discard(seq.draft_id)
                self.by_draft.pop(seq.draft_id, None)
            elif seq.state == "live":
                seq.state = "leaving"

    def propose(self, request_ids: Sequence[int], histories: Sequence[np.ndarray],
                k: int) -> np.ndarray:
        """Drafts for ``request_ids`` (module docstring): ``[n, k]``, -1 past a row's own."""
        self._check_bound()
        seqs: List[DraftSequence] = []
        for request_id, history in zip(request_ids, histories):
            seq = self.by_target.get(int(request_id))
            if seq is None:   # never admitted here (a drafter bound late): queued now
                seq = self.by_target[int(request_id)] = self._new(history)
            seq.follow(history)
            seqs.append(seq)
        followed = {id(seq) for seq in seqs}
        # Rows short of k drafts, or (k = 0) of the history's tokens: the draft steps run.
        wanting = [seq for seq in seqs if seq.state in ("live", "queued")
                   and (len(seq.drafts(k)) < k or seq.valid < seq.known - 1)]
        if wanting or self.scheduler.waiting or self.context.chunked_prefill_request_id != -1:
            self.rounds += 1
            self._round(followed, wanting, k)
        drafts = np.full((len(seqs), k), -1, dtype=np.int64)
        empty = []
        for i, seq in enumerate(seqs):
            own = seq.drafts(k)
            drafts[i, :len(own)] = own
            if len(own) == 0 and k:
                empty.append(i)
            if seq.state == "live":
                seq.anchor = seq.length
        if empty:
            drafts[empty] = self.fallback.propose([request_ids[i] for i in empty],
                                                  [histories[i] for i in empty], k)
        return drafts

    # ------------------------------------------------------------------ a round
    def _check_bound(self) -> None:
        if self.context is None:
            raise RuntimeError("DraftModelDrafter.bind(target_context) comes first (the "
                               "engine calls it when built with this drafter)")

    def _new(self, tokens: np.ndarray) -> DraftSequence:
        seq = DraftSequence(self.next_id, tokens)
        self.by_draft[self.next_id] = seq
        self.scheduler.submit(self.next_id, 0)
        self.scheduler.release(0)
        self.next_id += 1
        return seq

    def _round(self, followed: set, wanting: List[DraftSequence], k: int) -> None:
        """Settle the step in flight against the histories, then up to ``k + 1`` draft steps
        (one while a prompt is chunked: ``k = 0``), until each wanting row has ``k`` drafts;
        the last step's update waits."""
        self._settle(followed)
        for passes in range(max(1, k + 1)):
            if not self._forward(followed):
                return
            wanting = [seq for seq in wanting if seq.state == "live"
                       and len(seq.drafts(k)) < k]
            if not wanting or passes == k:
                return
            self._update(None)

    def _settle(self, followed: set) -> None:
        """The step in flight's update: each live row rewound to the tokens it holds right
        (a row the target did not ask for goes back to its anchor first), its next token the
        first it has not forwarded; leaving rows finish."""
        ctx = self.context
        if not self.in_step:
            if ctx.total_request_count and not ctx.get_active_request_count():
                self._update(None)   # every row paused: an update resumes what fits
            return
        paused, total = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids()[paused:total].tolist()
        chunked = ctx.chunked_prefill_request_id
        counts = np.zeros(len(ids), dtype=np.int64)
        keep = np.ones(len(ids), dtype=np.bool_)
        tokens = np.zeros(len(ids), dtype=np.int64)
        for i, draft_id in enumerate(ids):
            seq = self.by_draft[draft_id]
            if seq.state != "live":
                keep[i] = False
                if draft_id == chunked:
                    ctx.chunked_prefill_request_id = chunked = -1
                    self.scheduler.discard(draft_id)
                continue
            if draft_id == chunked:
                continue
            if id(seq) not in followed:
                seq.truncate(seq.anchor)
            kept = min(seq.valid, seq.length - 1)
            if kept < 1:   # nothing right to keep: recomputed from its tokens
                keep[i] = False
                seq.state = "leaving"
                self._requeue(seq)
                continue
            counts[i] = seq.cached - kept
            seq.cached = seq.valid = kept
            seq.pending = tokens[i] = int(seq.tokens[kept])
        if counts.any():
            ctx.rewind_tokens(counts)
            self.rewound_tokens += int(counts.sum())
        self._update(keep, tokens)

    def _requeue(self, seq: DraftSequence) -> None:
        """A new draft request with ``seq``'s tokens takes its place."""
        for request_id, held in self.by_target.items():
            if held is seq:
                fresh = self.by_target[request_id] = self._new(seq.tokens[:seq.length])
                fresh.known, fresh.anchor = seq.known, seq.anchor
                return

    def _update(self, keep: Optional[np.ndarray], tokens: Optional[np.ndarray] = None) -> None:
        """``update_requests`` of the step in flight (``keep``: the mask, None: every row kept
        with its pending token); rows the draft context evicted are queued again, rows it
        finished at its ``max_sequence_length`` are gone."""
        ctx = self.context
        active = ctx.get_active_request_count()
        if keep is None:
            ids = ctx.host_request_ids()[ctx.paused_request_count:ctx.total_request_count]
            keep = np.ones(active, dtype=np.bool_)
            tokens = np.array([self.by_draft[i].pending or 0 for i in ids.tolist()],
                              dtype=np.int64)
        finished = ctx.host_request_ids()[ctx.paused_request_count:ctx.total_request_count][
            ~keep].tolist()
        try:
            ctx.update_requests(torch.from_numpy(keep), torch.from_numpy(tokens).to(ctx.device))
        except RuntimeError as error:
            if "no request can run" not in str(error):
                raise
            # No row of the draft context can run (its blocks, given smaller than the
            # target's, cannot hold its paused rows): it starts over, every row re-added.
            self._start_over()
            return
        self.in_step = False
        for draft_id in finished:
            self.by_draft.pop(draft_id, None)
        for draft_id in ctx.max_length_finished_request_ids.tolist():
            self.by_draft.pop(draft_id).state = "gone"
        self.own_pauses += len(ctx.newly_paused_request_ids)
        requeue = []
        for draft_id in ctx.evicted_request_ids.tolist():
            seq = self.by_draft[draft_id]
            if seq.state == "live":
                seq.state, seq.request, seq.pending = "queued", None, None
                seq.cached = seq.valid = 0
                requeue.append(draft_id)
                self.own_evictions += 1
            else:
                del self.by_draft[draft_id]
        self.scheduler.after_update(requeue)

    def _start_over(self) -> None:
        """Empty the draft context (``reset``) and queue every request it held again, with
        its tokens as the prompt."""
        self.context.reset()
        self.scheduler.clear()
        self.in_step = False
        for draft_id, seq in list(self.by_draft.items()):
            if seq.state == "leaving":
                del self.by_draft[draft_id]
                continue
            seq.state, seq.request, seq.pending = "queued", None, None
            seq.cached = seq.valid = 0
            self.scheduler.submit(draft_id, 0)
        self.scheduler.release(0)
        self.restarts += 1

    def _request_for(self, draft_id: int) -> DynamicInferenceRequest:
        """The scheduler's request of a queued draft request: its tokens as the prompt (built
        anew while none of it was added)."""
        seq = self.by_draft[draft_id]
        request = seq.request
        if request is None or (request.finished_chunk_token_count == 0
                               and not np.array_equal(seq.prompt, seq.tokens[:seq.length])):
            seq.prompt = seq.tokens[:seq.length].copy()
            room = max(1, self.context.max_sequence_length - seq.length)
            request = seq.request = DynamicInferenceRequest(
                request_id=draft_id, prompt_tokens=torch.from_numpy(seq.prompt),
                sampling_params=SamplingParams(temperature=0.0, top_k=1,
                                               num_tokens_to_generate=room))
        return request

    def _forward(self, followed: set) -> bool:
        """One draft step: admissions, the forward pass, each row's next token (module
        docstring). False when no row can run."""
        ctx, scheduler = self.context, self.scheduler
        schedule = scheduler.schedule(self._request_for)
        for admission in schedule.admitted:
            if not admission.continuation:
                self.by_draft[admission.request_id].state = "live"
        for draft_id, _ in schedule.refused:
            self.by_draft.pop(draft_id).state = "gone"
        if ctx.active_token_count == 0:
            return False
        ctx.initialize_attention_state()
        paused, total = ctx.paused_request_count, ctx.total_request_count
        ids = ctx.host_request_ids()[paused:total].tolist()
        queries = ctx.host_query_lengths()[paused:total].tolist()
        decode = ctx.num_decode_requests
        full = getattr(ctx, "vocab_size", None) is not None or bool(getattr(ctx, "validate",
                                                                           False))
        output = self.model.forward(ctx, last_token_only=not full)
        logits = ctx.last_token_logits(output) if full else output
        samples = logits[:len(ids)].argmax(dim=-1).tolist()
        self.in_step = True
        self.forward_passes += 1
        self.tokens_processed += int(sum(queries))
        chunked = ctx.chunked_prefill_request_id
        for i, (draft_id, query, sample) in enumerate(zip(ids, queries, samples)):
            seq = self.by_draft[draft_id]
            at = seq.cached
            if i >= decode:   # a prompt chunk: the tokens of its request's prompt
                upto = max(0, min(query, seq.length - at))
                same = seq.prompt[at:at + upto] == seq.tokens[at:at + upto]
                if seq.valid == at:
                    seq.valid += int(np.argmin(same)) if not same.all() else upto
            elif seq.valid == at and at < seq.length and seq.tokens[at] == seq.pending:
                seq.valid += 1
            seq.cached = at + query
            if draft_id == chunked:
                seq.pending = None   # a non-final chunk: its next chunk follows
                continue
            if seq.cached >= seq.length:
                seq.append(sample)   # the draft's own token
            seq.pending = int(seq.tokens[seq.cached])
        return True


def kv_bytes_per_block(hf_model: Any, block_size: int) -> int:
    """A block's K/V bytes for ``hf_model`` (full attention: K and V, every layer, its KV heads
    and head size, its parameters' dtype)."""
    config = hf_model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(hf_model.parameters()).element_size()
    return 2 * int(config.num_hidden_layers) * block_size * int(heads) * int(head_dim) * itemsize


def draft_model_drafter(hf_model: Any, target_vocab: Any, engine_class: Any,
                        **engine_options: Any) -> DraftModelDrafter:
    """``Engine.from_transformers``' ``drafter`` given as a transformers causal LM: refused
    (``ValueError`` naming ``drafter``) before anything is built when its vocabulary is not
    the target's."""
    vocab = hf_model.config.vocab_size
    if target_vocab is not None and vocab != target_vocab:
        raise ValueError(f"drafter has vocab_size={vocab}, the target model {target_vocab}: "
                         "drafts must come from the target's vocabulary")
    drafter = DraftModelDrafter(hf_model, engine_class, **engine_options)
    check_drafter(drafter, target_vocab)
    return drafter
