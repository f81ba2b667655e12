"""The speculative step: the target verifies each decode request's drafts in one forward pass.

With a context of ``num_speculative_tokens = k`` every decode request forwards its pending
token and its drafts (``k``, or fewer: the drafter's own count, none when it proposes nothing;
docs/SEMANTICS.md §19). ``SpeculativeStepper`` runs the synchronous step of ``engine/step.py``
with three changes:

* after the forward, each decode request's logits rows verify its drafts
  (``engine/speculative.py``: exact greedy acceptance, or rejection sampling for sampled
  requests, vectorised over the requests); prefill rows sample their one row as always;
* the finish rules (termination id, ``num_tokens_to_generate``) run over the accepted tokens in
  order, so a request stops at the same token as without speculation;
* ``rewind_kv_cache`` drops the rejected drafts' K/V (and restores a hybrid's Mamba states),
  the drafter proposes the next step's drafts from each kept request's tokens
  (``engine/drafters.py``), and ``update_requests`` gets them as ``new_speculative_tokens``
  with each row's count (``draft_counts``): a step where no request has drafts is a plain
  decode step. A drafter that follows the requests (the draft model) is bound to the
  context, told of each admission, and asked at every step (``engine/drafters.py``).

The host reads the device once a step: the verified tokens, accepted counts, the forwarded
drafts and the prefill samples, in one tensor (and the log probs, when a request asks for
them, in a second). Sampled requests draw their uniforms per token index
(``sampling.uniform_draw`` for the token drawn, the same with a third key ``1`` for the
acceptance test), so a seeded request is reproducible run to run. Log probs are those of the
tokens gained (``log_prob_values``); ``record_logits`` records each gained token's row.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import torch

from .drafters import check_proposals, follows_requests
from .sampling import REFUSED, finish_reason, is_greedy, sample_checked, uniform_draw, upload
from .speculative import (
    SpeculativeStats,
    decode_windows,
    greedy_verify,
    rejection_sample,
    speculative_log_probs,
    target_probs,
)
from .state import Row
from .step import REFUSED_ERROR, Batch, Stepper


def stepper_for(context: Any, drafter: Any, *, async_scheduling: bool,
                record_logits: bool) -> Any:
    """The step class for an engine over ``context``: ``Stepper`` without speculation, else
    ``SpeculativeStepper`` bound to ``drafter``. Raises ``ValueError`` naming the option when
    speculation is asked for half-way or with an option it does not support."""
    k = int(getattr(context, "num_speculative_tokens", 0) or 0)
    if k == 0:
        if drafter is not None:
            raise ValueError(f"drafter={drafter!r} needs a context with num_speculative_tokens "
                             ">= 1 (it has 0)")
        return Stepper
    if drafter is None:
        raise ValueError(f"the context has num_speculative_tokens={k}: give the engine a "
                         "drafter (engine/drafters.py)")
    return functools.partial(SpeculativeStepper, drafter=drafter)


class SpeculativeRow(Row):
    """A row of a speculative step: ``tokens``, every token the request gains (the accepted
    drafts then the target's own token, cut at the first that finishes it), ``log_probs``
    theirs (when asked), ``drafted`` the drafts it forwarded and ``accepted`` those kept."""

    def __init__(self, state: Any):
        super().__init__(state)
        self.tokens: List[int] = []
        self.log_probs: List[float] = []
        self.accepted = 0
        self.drafted = 0


@dataclass
class SpeculativeBatch(Batch):
    """``Batch`` of a speculative step: each decode row's drafts (``draft_counts``, host) and
    the step's decode tokens; ``accepted`` the accepted counts on the device (async
    scheduling's deferred rewind); ``log_prob_values`` the log probs asked for (device fp32:
    each decode row's ``1 + k`` positions, each prefill's generated token, then the prompt
    tokens' of the prefills that ask, ``speculative_step.read_log_probs``); ``recorded``:
    ``record_logits``' ``(kv lengths, rows)``."""

    draft_counts: Any = None
    decode_tokens: int = 0
    accepted: Any = None
    log_prob_values: Any = None
    log_prob_lists: Any = None
    prompt_layout: Any = None
    recorded: Any = None


class SpeculativeStepper(Stepper):
    """``Stepper`` whose decode requests forward ``1 + `` their drafts (module docstring)."""

    def __init__(self, *, drafter: Any, **parts: Any):
        super().__init__(**parts)
        self.drafter = drafter
        self.k = int(self.context.num_speculative_tokens)
        self.counts = SpeculativeStats(self.k)
        self.stats.speculative = self.counts.as_dict()
        self._prompts: dict = {}   # request id -> (request, its prompt as numpy)
        # A drafter that follows the target's requests (engine/drafters.py) sizes itself
        # after the target's context and hears of every admission.
        self.follows = follows_requests(drafter)
        if self.follows:
            drafter.bind(self.context)

    def admit(self) -> Any:
        """``Stepper.admit``; a drafter that follows the requests hears of each new one (a
        re-added one too) with its prompt."""
        schedule = super().admit()
        if self.follows:
            for admission in schedule.admitted:
                if not admission.continuation:
                    request = self.intake.live_request(admission.request_id)
                    self.drafter.admit(admission.request_id, request.prompt_tokens.cpu().numpy()
                                       .astype(np.int64, copy=False))
        return schedule

    # ------------------------------------------------------------------ the step (Stepper.step)
    def forward(self, result: Any, in_flight: Any = None) -> Any:
        """The forward pass, the verification of the decode rows and the prefill rows'
        samples; ``batch.tokens`` is the one host read (decode: next token or ``REFUSED``,
        accepted count, forwarded drafts; then the prefill readouts), left on the device under
        async scheduling (``in_flight``, as ``Stepper.forward``'s)."""
        ctx = self.context
        ctx.initialize_attention_state()
        paused, total = ctx.paused_request_count, ctx.total_request_count
        states = [self.intake.state(int(i)) for i in ctx.host_request_ids()[paused:total]]
        decode = ctx.num_decode_requests
        queries = ctx.host_query_lengths()[paused:total].astype(np.int64)
        decode_tokens = int(queries[:decode].sum())
        result.active_requests, result.paused_requests = total - paused, paused
        result.tokens = ctx.active_token_count
        result.kv_utilization = ctx.get_kvcache_utilization_stats()["allocated_utilization"]
        want_prompt_lp = any(state.wants_prompt_log_probs for state in states[decode:])
        full = want_prompt_lp or self.checks_logits()
        forward_start = time.perf_counter()
        output, last, failed = self.run_model(full, len(states))
        last = last[:decode_tokens + len(states) - decode]
        params, indices = self.sampling_inputs(states, in_flight)
        if decode_tokens > decode:
            pre_sampled, pre_readout = sample_checked(last[decode_tokens:], params[decode:],
                                                      indices[decode:], self.rng)
            windows = decode_windows(queries[:decode], self.k)
            nxt, accepted, refused, drafts, rows = self._verify(
                last[:decode_tokens], windows, params[:decode], indices[:decode])
            readout = torch.cat([nxt.masked_fill(refused, REFUSED), accepted, drafts.flatten(),
                                 pre_readout])
        else:
            # A plain step (no row has drafts): every row samples its one row.
            sampled, row_readout = sample_checked(last, params, indices, self.rng)
            nxt, pre_sampled = sampled[:decode], sampled[decode:]
            accepted = torch.zeros(decode, dtype=torch.int64, device=last.device)
            drafts = torch.full((decode, self.k), -1, dtype=torch.int64, device=last.device)
            rows = last[:decode, None, :].expand(decode, 1 + self.k, last.shape[-1])
            readout = torch.cat([row_readout[:decode], accepted, drafts.flatten(),
                                 row_readout[decode:]])
        batch = SpeculativeBatch(
            states=states, num_decode=decode, chunked_id=ctx.chunked_prefill_request_id,
            sampled=torch.cat([nxt, pre_sampled]), readout=readout,
            tokens=readout.tolist() if in_flight is None else [], failed=failed,
            want_prompt_log_probs=want_prompt_lp, draft_counts=queries[:decode] - 1,
            decode_tokens=decode_tokens, accepted=accepted)
        if any(state.params.return_log_probs for state in states):
            batch.log_prob_values, batch.prompt_layout = log_prob_values(
                ctx, rows, drafts, accepted, nxt, last[decode_tokens:], pre_sampled,
                output if want_prompt_lp else None, states, decode, queries, decode_tokens)
            if in_flight is None or want_prompt_lp:
                batch.log_prob_lists = batch.log_prob_values.tolist()
            if in_flight is not None:
                # Read with the tokens: each decode row's positions, each prefill's token.
                batch.deferred_log_probs = batch.log_prob_values[
                    :decode * (1 + self.k) + len(states) - decode]
        if self.record_logits:
            lengths = ctx.active_attn_metadata.kv_seq_lengths[:total - paused].tolist()
            batch.recorded = (lengths, rows.float().cpu(), last[decode_tokens:].float().cpu())
        self.stats.forward_time_s += time.perf_counter() - forward_start
        return batch

    def _verify(self, logits: torch.Tensor, windows: np.ndarray, params: list,
                indices: list) -> tuple:
        """``(next, accepted, refused, drafts, rows)`` of the decode rows from their logits
        rows (``[decode tokens, V]``) and ``windows`` (``speculative.decode_windows``):
        ``drafts`` ``[D, k]`` (-1 past a row's own), ``rows`` ``[D, 1 + k, V]``."""
        ctx, k = self.context, self.k
        decode = windows.shape[1]
        index = upload(windows.reshape(-1), logits.device).view(3, decode, 1 + k)
        rows = logits.index_select(0, index[0].flatten()).view(
            decode, 1 + k, logits.shape[-1]).float()
        input_ids = ctx.current_input_and_position_ids()[0][0]
        own = index[2, :, :k].bool()
        drafts = torch.where(own, input_ids[index[1, :, :k]].long(), -1)
        accepted, nxt = greedy_verify(rows.argmax(dim=-1), drafts)
        refused = ~(rows.amax(dim=-1) > float("-inf")).all(dim=1)
        sampled = [i for i, p in enumerate(params) if not is_greedy(p) and windows[2, i, 0]]
        undrafted = [i for i, p in enumerate(params) if not is_greedy(p) and not windows[2, i, 0]]
        if undrafted:
            # A sampled row without drafts samples its one row as without speculation.
            pick = upload(np.asarray(undrafted, dtype=np.int64), logits.device)
            u_next, u_readout = sample_checked(rows[pick, 0], [params[i] for i in undrafted],
                                               [indices[i] for i in undrafted], self.rng)
            nxt = nxt.index_copy(0, pick, u_next)
            refused = refused.index_copy(0, pick, u_readout == REFUSED)
        if sampled:
            chosen = [params[i] for i in sampled]
            packed = np.array([sampled, [p.temperature for p in chosen],
                               [p.top_k for p in chosen], [p.top_p for p in chosen]],
                              dtype=np.float64)
            u_accept, u_draw = self._uniforms(sampled, params, indices)
            values = upload(np.concatenate([packed.repeat(1 + k, axis=1),
                                            u_accept[None], u_draw[None]]), logits.device)
            pick = values[0, ::1 + k].long()
            probs = target_probs(rows[pick].reshape(len(sampled) * (1 + k), -1),
                                 values[1], values[2], values[3]).view(len(sampled), 1 + k, -1)
            u_a = values[4].view(len(sampled), 1 + k)[:, :k]
            u_d = values[5].view(len(sampled), 1 + k)
            s_accepted, s_next = rejection_sample(probs, drafts[pick], u_a, u_d,
                                                  num_drafts=own[pick].sum(dim=1))
            accepted = accepted.index_copy(0, pick, s_accepted)
            nxt = nxt.index_copy(0, pick, s_next)
            no_mass = ~(probs.sum(dim=-1) > 0).all(dim=1)
            refused = refused.index_copy(0, pick, refused[pick] | no_mass)
        return nxt, accepted, refused, drafts, rows

    def _uniforms(self, sampled: list, params: list, indices: list) -> tuple:
        """The acceptance and draw uniforms ``[len(sampled) * (1 + k)]`` of the sampled decode
        rows: position ``j`` of row ``i`` belongs to its token index ``indices[i] + j``."""
        k = self.k
        u_accept = np.zeros((len(sampled), 1 + k))
        u_draw = np.zeros((len(sampled), 1 + k))
        for r, i in enumerate(sampled):
            seed = params[i].seed
            for j in range(1 + k):
                token = indices[i] + j
                u_draw[r, j] = uniform_draw(seed, token, self.rng)
                u_accept[r, j] = (float(self.rng.random()) if seed is None else float(
                    np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, token, 1]).random()))
        return u_accept.reshape(-1), u_draw.reshape(-1)

    def outcomes(self, batch: Any) -> List[Row]:
        """Each active row's tokens, log probs and finish, the finish rules applied to the
        accepted tokens in order; changes nothing."""
        decode, k = batch.num_decode, self.k
        tokens = batch.tokens
        nexts, accepted = tokens[:decode], tokens[decode:2 * decode]
        drafts = tokens[2 * decode:2 * decode + decode * k]
        prefill = tokens[2 * decode + decode * k:]
        lists = None if batch.log_prob_lists is None else read_log_probs(
            batch.log_prob_lists, batch.prompt_layout, decode, k)
        rows: List[Row] = []
        for i, state in enumerate(batch.states):
            row = SpeculativeRow(state)
            rows.append(row)
            if i in batch.failed:
                row.finish, row.error = "error", batch.failed[i]
                continue
            if lists is not None and state.params.return_log_probs:
                row.prompt_log_probs = lists[1][i]
            if state.request_id == batch.chunked_id:
                continue  # a non-final chunk: its sample is junk, the context keeps it
            if i < decode:
                token = nexts[i]
                row.accepted, row.drafted = accepted[i], int(batch.draft_counts[i])
                gained = drafts[i * k:i * k + accepted[i]] + [token]
            else:
                token = prefill[i - decode]
                gained = [token]
            if token == REFUSED:
                row.finish, row.error = "error", REFUSED_ERROR
                continue
            generated = len(state.request.generated_tokens)
            for t in gained:
                row.tokens.append(t)
                generated += 1
                row.finish = finish_reason(state.params, t, generated)
                if row.finish is not None:
                    break
            row.token = row.tokens[-1]
            if lists is not None and state.params.return_log_probs:
                row.log_probs = lists[0][i][:len(row.tokens)]
        return rows

    def update(self, batch: Any, rows: List[Row], result: Any) -> None:
        """The drafts of the next step, ``rewind_kv_cache``, ``update_requests`` with them, then
        the rows applied to the engine and the drafter told who left."""
        ctx = self.context
        if batch.chunked_id != -1 and any(row.finish == "error" and row.state.request_id ==
                                          batch.chunked_id for row in rows):
            ctx.chunked_prefill_request_id = -1
            self.scheduler.discard(batch.chunked_id)
        drafts, counts = self.next_drafts(rows, batch.chunked_id)   # checked first
        mask = torch.from_numpy(np.fromiter((row.keep for row in rows), dtype=np.bool_,
                                            count=len(rows)))
        if batch.num_decode and batch.draft_counts.any():
            accepted = np.zeros(len(rows), dtype=np.int64)
            accepted[:batch.num_decode] = batch.tokens[batch.num_decode:2 * batch.num_decode]
            ctx.rewind_kv_cache(torch.from_numpy(accepted))
        paused = ctx.update_requests(mask, batch.sampled, upload(drafts, ctx.device),
                                     draft_counts=counts)
        result.paused_ids = [int(i) for i in paused.tolist()]
        result.evicted_ids = [int(i) for i in ctx.evicted_request_ids.tolist()]
        now = time.perf_counter()
        left = list(result.evicted_ids)
        extra = 0
        for i, row in enumerate(rows):
            state = row.state
            state.prompt_log_probs.extend(row.prompt_log_probs)
            state.generated_log_probs.extend(row.log_probs)
            if batch.recorded is not None:
                record_rows(state, batch.recorded, i, batch.num_decode, batch.draft_counts,
                            len(row.tokens))
            for token in row.tokens:
                self.delivery.append_token(state, token, result.new_tokens, now,
                                           step=self.step_count)
            if row.tokens:
                result.all_new_tokens[state.request_id] = list(row.tokens)
                extra += len(row.tokens) - 1
            if row.finish is not None:
                self.delivery.finish(state, row.finish, now, step=self.step_count,
                                     error=row.error)
                left.append(state.request_id)
        if left:
            self.drafter.release(left)
        self.count(batch.num_decode, rows)
        self.stats.generated_tokens += extra
        self.after_update(result)

    def next_drafts(self, rows: List[Row], chunked_id: int = -1,
                    assumed: Optional[dict] = None) -> tuple:
        """``(new_speculative_tokens [k, active] int64, draft_counts [active])``: the drafter's
        proposals for each row that goes on decoding (a proposal's first -1 ends it), none for
        the others (finishing rows, a non-final chunk), and none at all while a prompt is
        chunked (``chunked_id`` kept: its next chunk takes the step's token budget).
        ``assumed``: async scheduling's tokens a row is taken to gain in the step in flight
        (request id -> tokens), whose next token the drafter guesses too (its first proposal,
        dropped); then a hybrid's rows forward all ``k`` drafts or none (a deferred Mamba
        restore counts a row's accepted drafts from ``k``), a shorter proposal padded with its
        last draft."""
        k = self.k
        drafts = np.zeros((k, len(rows)), dtype=np.int64)
        counts = np.zeros(len(rows), dtype=np.int64)
        # A drafter that follows the requests is told of the rows while a prompt is chunked
        # too (it proposes none then: ``width`` 0).
        chunking = any(row.keep and row.state.request_id == chunked_id for row in rows)
        if chunking and not self.follows:
            return drafts, counts
        if assumed is None:
            going = [i for i, row in enumerate(rows) if row.keep and row.tokens]
        else:
            going = [i for i, row in enumerate(rows)
                     if row.keep and row.state.request_id in assumed]
        if not going and not self.follows:
            return drafts, counts
        ids = [rows[i].state.request_id for i in going]
        tails = [rows[i].tokens if assumed is None else assumed[ids[n]]
                 for n, i in enumerate(going)]
        histories = [np.concatenate([self._prompt(rows[i].state), np.asarray(
            rows[i].state.request.generated_tokens + list(tail), dtype=np.int64)])
            for i, tail in zip(going, tails)]
        width = 0 if chunking else k if assumed is None else k + 1
        proposed = self.drafter.propose(ids, histories, width)
        if not going or width == 0:
            return drafts, counts
        proposed = (proposed.detach().cpu().numpy() if isinstance(proposed, torch.Tensor)
                    else np.asarray(proposed))
        own = check_proposals(proposed, len(going), width, self._vocab())
        if assumed is not None:
            # The first proposal guesses the token in flight: a row without it has none.
            own = np.where(own > 0, own - 1, 0)
            proposed = proposed[:, 1:]
            if getattr(self.context, "mamba_metadata", None) is not None:
                last = proposed[np.arange(len(going)), np.maximum(own - 1, 0)]
                proposed = np.where(np.arange(k)[None, :] < own[:, None], proposed,
                                    last[:, None])
                own = np.where(own > 0, k, 0)
        drafts[:, going] = np.where(np.arange(k)[:, None] < own[None, :], proposed.T, 0)
        counts[going] = own
        return drafts, counts

    def _prompt(self, state: Any) -> np.ndarray:
        """The request's prompt as int64 numpy (kept per request while it runs)."""
        prompts = self._prompts
        prompt = prompts.get(state.request_id)
        if prompt is None or prompt[0] is not state.request:
            prompt = prompts[state.request_id] = (state.request, state.request.prompt_tokens.cpu()
                                                  .numpy().astype(np.int64, copy=False))
            if len(prompts) > 4 * self.context.max_requests:
                prompts.clear()
                prompts[state.request_id] = prompt
        return prompt[1]

    def _vocab(self) -> Optional[int]:
        return getattr(self.model, "vocab_size", None)

    def count(self, decode: int, rows: List[Row]) -> None:
        """The speculative counters of a step's ``decode`` decode rows."""
        counts = self.counts
        counts.forward_steps += 1
        counts.decode_rows += decode
        for row in rows[:decode]:
            counts.draft_tokens += row.drafted
            counts.accepted_tokens += row.accepted
            counts.emitted_tokens += len(row.tokens)
        self.stats.speculative = counts.as_dict()


def log_prob_values(ctx: Any, rows: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor,
                    nxt: torch.Tensor, prefill_logits: torch.Tensor, prefill_sampled: torch.Tensor,
                    output: Optional[torch.Tensor], states: list, decode: int,
                    queries: np.ndarray, decode_tokens: int) -> tuple:
    """The log probs a speculative step's rows ask for, as one device fp32 tensor (fp32
    log-softmax of the raw logits, as ``token_log_probs``): each decode row's ``1 + k``
    positions (its gained tokens' at their rows), each prefill's generated token's, then, with
    the full ``output``, every prefill token's but the step's last (the next prompt token's),
    and the chunked prefill's next chunk's first token. Returns ``(values, layout)``,
    ``layout`` what ``read_log_probs`` needs: the prefills' token offsets and whether a next
    chunk's token was added."""
    parts = [speculative_log_probs(rows, drafts, accepted, nxt).flatten(),
             torch.log_softmax(prefill_logits.float(), dim=-1).gather(
                 1, prefill_sampled[:, None]).squeeze(1)]
    layout = None
    if output is not None:
        total = decode_tokens + int(queries[decode:].sum())
        logits = output.reshape(-1, output.shape[-1])[decode_tokens:total].float()
        full = torch.log_softmax(logits, dim=-1)
        input_ids = ctx.current_input_and_position_ids()[0][0]
        parts.append(full[:-1].gather(1, input_ids[decode_tokens + 1:total, None].long())
                     .squeeze(1))
        chunk = ctx.chunked_prefill_request_id
        next_token = None
        if chunk != -1 and states[-1].request_id == chunk:
            next_token = int(states[-1].live.remaining_prompt_tokens[0])
            parts.append(full[-1:, next_token])
        layout = (np.concatenate([[0], np.cumsum(queries[decode:])]), next_token is not None)
    return torch.cat(parts), layout


def read_log_probs(values: list, layout: Any, decode: int, k: int) -> tuple:
    """``(generated, prompt)``: per active row the log probs of the tokens it may gain (a
    decode row's ``1 + k`` positions, a prefill's one) and of its prompt tokens (prefills
    whose step computed them; ``[]`` otherwise), from ``log_prob_values``' host list."""
    generated = [values[i * (1 + k):(i + 1) * (1 + k)] for i in range(decode)]
    at = decode * (1 + k)
    prompt: List[List[float]] = [[] for _ in range(decode)]
    if layout is None:
        count = len(values) - at
        return generated + [[v] for v in values[at:at + count]], prompt + [[]] * count
    cu, chunk_next = layout
    prefills = len(cu) - 1
    generated += [[v] for v in values[at:at + prefills]]
    tokens = values[at + prefills:]
    for i in range(prefills):
        prompt.append(tokens[int(cu[i]):int(cu[i + 1]) - 1])
    if chunk_next:
        prompt[-1] = prompt[-1] + [tokens[-1]]
    return generated, prompt


def record_rows(state: Any, recorded: tuple, i: int, decode: int, draft_counts: np.ndarray,
                gained: int) -> None:
    """``record_logits``: the logits row of each of the ``gained`` tokens of active row ``i``
    joins ``state.step_logits`` as ``(tokens in the context before it, row)``."""
    lengths, decode_rows, prefill_rows = recorded
    if i < decode:
        before = int(lengths[i]) - int(draft_counts[i])
        for j in range(gained):
            state.step_logits.append((before + j, decode_rows[i, j].clone()))
    elif gained:
        state.step_logits.append((int(lengths[i]), prefill_rows[i - decode].clone()))
