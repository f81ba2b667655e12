"""The speculative step: the target verifies each decode request's drafts in one forward pass.

With a context of ``num_speculative_tokens = k`` every decode request forwards its pending
token and ``k`` drafts (docs/SEMANTICS.md §19). ``SpeculativeStepper`` runs the synchronous
step of ``engine/step.py`` with three changes:

* after the forward, each decode request's ``1 + k`` logits rows verify its drafts
  (``engine/speculative.py``: exact greedy acceptance, or rejection sampling for sampled
  requests, vectorised over the requests); prefill rows sample their one row as always;
* the finish rules (termination id, ``num_tokens_to_generate``) run over the accepted tokens in
  order, so a request stops at the same token as without speculation;
* ``rewind_kv_cache`` drops the rejected drafts' K/V (and restores a hybrid's Mamba states),
  the drafter proposes the next step's drafts from each kept request's tokens
  (``engine/drafters.py``), and ``update_requests`` gets them as ``new_speculative_tokens``.

The host reads the device once a step: the verified tokens, accepted counts, the forwarded
drafts and the prefill samples, in one tensor. Sampled requests draw their uniforms per token
index (``sampling.uniform_draw`` for the token drawn, the same with a third key ``1`` for the
acceptance test), so a seeded request is reproducible run to run. Not supported with
speculation (refused when the engine is built, or per request with an error): async
scheduling, ``record_logits``, and log probs (the context's ``calculate_log_probs`` refuses
``k > 0``).
"""

from __future__ import annotations

import functools
import time
from typing import Any, List, Optional

import numpy as np
import torch

from .sampling import REFUSED, finish_reason, is_greedy, sample_checked, uniform_draw, upload
from .speculative import SpeculativeStats, greedy_verify, rejection_sample, target_probs
from .state import Row
from .step import REFUSED_ERROR, Batch, Stepper

LOG_PROBS_ERROR = ("return_log_probs is not supported with speculative decoding "
                   "(num_speculative_tokens > 0)")


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
    for name, value in (("async_scheduling", async_scheduling),
                        ("record_logits", record_logits)):
        if value:
            raise ValueError(f"{name}=True is not supported with speculative decoding "
                             f"(num_speculative_tokens={k})")
    return functools.partial(SpeculativeStepper, drafter=drafter)


class SpeculativeRow(Row):
    """A row of a speculative step: ``tokens``, every token the request gains (the accepted
    drafts then the target's own token, cut at the first that finishes it)."""

    def __init__(self, state: Any):
        super().__init__(state)
        self.tokens: List[int] = []
        self.accepted = 0


class SpeculativeStepper(Stepper):
    """``Stepper`` whose decode requests forward ``1 + k`` tokens (module docstring)."""

    def __init__(self, *, drafter: Any, **parts: Any):
        super().__init__(**parts)
        self.drafter = drafter
        self.k = int(self.context.num_speculative_tokens)
        self.counts = SpeculativeStats(self.k)
        self.stats.speculative = self.counts.as_dict()

    # ------------------------------------------------------------------ the step (Stepper.step)
    def forward(self, result: Any, in_flight: Any = None) -> Any:
        """The forward pass, the verification of the decode rows and the prefill rows'
        samples; ``batch.tokens`` is the one host read (decode: next token or ``REFUSED``,
        accepted count, forwarded drafts; then the prefill readouts)."""
        ctx, k = self.context, self.k
        ctx.initialize_attention_state()
        paused, total = ctx.paused_request_count, ctx.total_request_count
        states = [self.intake.state(int(i)) for i in ctx.host_request_ids()[paused:total]]
        decode = ctx.num_decode_requests
        result.active_requests, result.paused_requests = total - paused, paused
        result.tokens = ctx.active_token_count
        result.kv_utilization = ctx.get_kvcache_utilization_stats()["allocated_utilization"]
        full = self.checks_logits()
        forward_start = time.perf_counter()
        if self.graph_runner is not None:
            output = self.graph_runner.run(last_token_only=not full)
        else:
            output = self.model.forward(ctx, last_token_only=not full)
        failed = self._nonfinite_rows(output, full, len(states))
        for i, state in enumerate(states):
            if state.params.return_log_probs:
                failed.setdefault(i, LOG_PROBS_ERROR)
        if failed:
            output = torch.nan_to_num(output, nan=0.0, posinf=0.0, neginf=float("-inf"))
        last = ctx.last_token_logits(output) if full else output
        drafted = decode * (1 + k)
        last = last[:drafted + len(states) - decode]
        params = [state.params for state in states]
        indices = [len(state.request.generated_tokens) for state in states]
        pre_sampled, pre_readout = sample_checked(last[drafted:], params[decode:],
                                                  indices[decode:], self.rng)
        nxt, accepted, refused, drafts = self._verify(last[:drafted], decode, params[:decode],
                                                      indices[:decode])
        readout = torch.cat([nxt.masked_fill(refused, REFUSED), accepted, drafts.flatten(),
                             pre_readout])
        batch = Batch(states=states, num_decode=decode,
                      chunked_id=ctx.chunked_prefill_request_id,
                      sampled=torch.cat([nxt, pre_sampled]), readout=readout,
                      tokens=readout.tolist(), failed=failed, want_prompt_log_probs=False)
        self.stats.forward_time_s += time.perf_counter() - forward_start
        return batch

    def _verify(self, logits: torch.Tensor, decode: int, params: list, indices: list) -> tuple:
        """``(next, accepted, refused, drafts)`` of the ``decode`` decode rows from their
        ``[decode * (1 + k), V]`` logits rows."""
        ctx, k = self.context, self.k
        rows = logits.view(decode, 1 + k, logits.shape[-1]).float()
        input_ids = ctx.current_input_and_position_ids()[0][0]
        drafts = input_ids[:decode * (1 + k)].view(decode, 1 + k)[:, 1:].long()
        accepted, nxt = greedy_verify(rows.argmax(dim=-1), drafts)
        refused = ~(rows.amax(dim=-1) > float("-inf")).all(dim=1)
        sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
        if sampled:
            chosen = [params[i] for i in sampled]
            packed = np.array([sampled, [p.temperature for p in chosen],
                               [p.top_k for p in chosen], [p.top_p for p in chosen]],
                              dtype=np.float64)
            u_accept, u_draw = self._uniforms(sampled, params, indices)
            values = upload(np.concatenate([packed.repeat(1 + k, axis=1),
                                            u_accept[None], u_draw[None]]), logits.device)
            index = values[0, ::1 + k].long()
            probs = target_probs(rows[index].reshape(len(sampled) * (1 + k), -1),
                                 values[1], values[2], values[3]).view(len(sampled), 1 + k, -1)
            u_a = values[4].view(len(sampled), 1 + k)[:, :k]
            u_d = values[5].view(len(sampled), 1 + k)
            s_accepted, s_next = rejection_sample(probs, drafts[index], u_a, u_d)
            accepted = accepted.index_copy(0, index, s_accepted)
            nxt = nxt.index_copy(0, index, s_next)
            no_mass = ~(probs.sum(dim=-1) > 0).all(dim=1)
            refused = refused.index_copy(0, index, refused[index] | no_mass)
        return nxt, accepted, refused, drafts

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
        """Each active row's tokens and finish, the finish rules applied to the accepted tokens
        in order; changes nothing."""
        decode, k = batch.num_decode, self.k
        tokens = batch.tokens
        nexts, accepted = tokens[:decode], tokens[decode:2 * decode]
        drafts = tokens[2 * decode:2 * decode + decode * k]
        prefill = tokens[2 * decode + decode * k:]
        rows: List[Row] = []
        for i, state in enumerate(batch.states):
            row = SpeculativeRow(state)
            rows.append(row)
            if i in batch.failed:
                row.finish, row.error = "error", batch.failed[i]
                continue
            if state.request_id == batch.chunked_id:
                continue  # a non-final chunk: its sample is junk, the context keeps it
            if i < decode:
                token = nexts[i]
                row.accepted = accepted[i]
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
        return rows

    def update(self, batch: Any, rows: List[Row], result: Any) -> None:
        """The drafts of the next step, ``rewind_kv_cache``, ``update_requests`` with them, then
        the rows applied to the engine and the drafter told who left."""
        ctx = self.context
        if batch.chunked_id != -1 and any(row.finish == "error" and row.state.request_id ==
                                          batch.chunked_id for row in rows):
            ctx.chunked_prefill_request_id = -1
            self.scheduler.discard(batch.chunked_id)
        drafts = self._next_drafts(rows)                 # checked before anything changes
        mask = torch.from_numpy(np.fromiter((row.keep for row in rows), dtype=np.bool_,
                                            count=len(rows)))
        if batch.num_decode:
            accepted = np.zeros(len(rows), dtype=np.int64)
            accepted[:batch.num_decode] = batch.tokens[batch.num_decode:2 * batch.num_decode]
            ctx.rewind_kv_cache(torch.from_numpy(accepted))
        paused = ctx.update_requests(mask, batch.sampled, upload(drafts, ctx.device))
        result.paused_ids = [int(i) for i in paused.tolist()]
        result.evicted_ids = [int(i) for i in ctx.evicted_request_ids.tolist()]
        now = time.perf_counter()
        left = list(result.evicted_ids)
        extra = 0
        for row in rows:
            state = row.state
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
        self._count(batch, rows)
        self.stats.generated_tokens += extra
        self.after_update(result)

    def _next_drafts(self, rows: List[Row]) -> np.ndarray:
        """``new_speculative_tokens`` ``[k, active]`` int64: the drafter's proposals for each
        row that goes on decoding, zeros for the others (finishing rows, a non-final chunk)."""
        k = self.k
        drafts = np.zeros((k, len(rows)), dtype=np.int64)
        going = [i for i, row in enumerate(rows) if row.keep and row.tokens]
        if not going:
            return drafts
        ids = [rows[i].state.request_id for i in going]
        histories = [np.concatenate([
            rows[i].state.request.prompt_tokens.cpu().numpy().astype(np.int64, copy=False),
            np.asarray(rows[i].state.request.generated_tokens + rows[i].tokens,
                       dtype=np.int64)]) for i in going]
        proposed = self.drafter.propose(ids, histories, k)
        proposed = (proposed.detach().cpu().numpy() if isinstance(proposed, torch.Tensor)
                    else np.asarray(proposed))
        check_proposals(proposed, len(going), k, self._vocab())
        drafts[:, going] = proposed.T
        return drafts

    def _vocab(self) -> Optional[int]:
        return getattr(self.model, "vocab_size", None)

    def _count(self, batch: Any, rows: List[Row]) -> None:
        counts, decode = self.counts, batch.num_decode
        counts.forward_steps += 1
        counts.draft_tokens += self.k * decode
        counts.decode_rows += decode
        for row in rows[:decode]:
            counts.accepted_tokens += row.accepted
            counts.emitted_tokens += len(row.tokens)
        self.stats.speculative = counts.as_dict()


def check_proposals(proposed: np.ndarray, rows: int, k: int, vocab: Optional[int]) -> None:
    """A drafter's ``propose`` answer is integer ``[rows, k]`` within the vocabulary."""
    if proposed.shape != (rows, k) or proposed.dtype.kind not in "iu":
        raise ValueError(f"drafter.propose returned {proposed.dtype} {tuple(proposed.shape)}, "
                         f"expected integers [{rows} requests, num_speculative_tokens={k}]")
    if proposed.size and (proposed.min() < 0 or (vocab is not None and proposed.max() >= vocab)):
        raise ValueError(f"drafter.propose returned token ids in [{int(proposed.min())}, "
                         f"{int(proposed.max())}], outside [0, vocab_size={vocab})")
