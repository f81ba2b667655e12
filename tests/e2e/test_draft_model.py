"""The draft-model drafter kept in step with the target's requests (``engine/draft_model.py``,
docs/SEMANTICS.md §19): greedy outputs equal transformers' greedy ``generate`` and the engine
without speculation under pauses, evictions and chunked prefill (Llama and Qwen3 on the
generic path, each with a smaller draft model, and Llama as its own draft model, which accepts
at least 99 % of its drafts), also when the draft context is given too few blocks; and, step
by step, the draft context holds what the target holds: each request admitted with the
target's admission, its draft row never growing while the target holds it paused, finished
(or evicted) with the target's row, re-added with it, and every row's tokens the target's
history followed by its drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from e2e_helpers import (
    assert_pressure_stats,
    build_engine,
    gib_for_blocks,
    greedy_requests,
    hf_greedy,
    make_prompts,
    tiny_llama,
)
from generic_families import kv_block_bytes, tiny_family, without_windows

from dynctx.engine import Engine
from dynctx.engine.draft_model import DraftModelDrafter

LENGTHS = [1, 5, 17, 40, 3, 33, 16, 48, 2, 9, 31, 12, 20, 7, 45, 15]
GENS = [40, 24, 40, 16, 40, 32, 40, 24, 40, 12, 40, 28, 36, 40, 20, 40]


def _pressure(hf, drafter, *, gib=None, step_check=None, **extra):
    """The workload of tests/e2e/test_speculative_engine.py under pressure (10 blocks of 16,
    2 paused, 32 tokens a step: pauses, evictions, chunked prefill), k = 3."""
    prompts = make_prompts(LENGTHS, hf.config.vocab_size)
    requests = greedy_requests(prompts, GENS)
    kwargs = dict(kernel_backend="torch", **extra)
    if gib is not None:
        kwargs["gib"] = gib
    engine = build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=32,
                          num_speculative_tokens=3, drafter=drafter, **kwargs)
    if step_check is not None:
        engine.step_callback = lambda result: step_check(engine, result)
    results = engine.generate_requests(requests, arrival_steps=[i // 2 for i in
                                                                 range(len(requests))])
    return engine, prompts, requests, results


class FollowCheck:
    """After each target step, the draft side against the target's context and requests."""

    def __init__(self, drafter: DraftModelDrafter):
        self.drafter = drafter
        self.steps = self.paused_rows = 0
        self.anchors = {}

    def __call__(self, engine, result):
        drafter, ctx = self.drafter, engine.context
        live = ctx.host_request_ids()[:ctx.total_request_count].tolist()
        paused = set(live[:ctx.paused_request_count])
        held = {rid for rid, seq in drafter.by_target.items() if seq.state in ("live", "queued")}
        # Every request the target holds is a row of the draft context since the step that
        # admitted it (its prompt prefilled as far as the target's), and nothing else.
        assert held == set(live), (sorted(held), sorted(live))
        for rid in live:
            seq = drafter.by_target[rid]
            request = engine._intake.state(rid).request
            assert seq.state == "live", rid
            assert seq.cached >= min(request.finished_chunk_token_count, seq.known - 1), rid
            history = np.concatenate([request.prompt_tokens.numpy(),
                                      np.asarray(request.generated_tokens, dtype=np.int64)])
            # Its tokens start with what the target has (prompt, verified tokens).
            upto = min(seq.known, len(history))
            assert np.array_equal(seq.tokens[:upto], history[:upto]), rid
            if rid in paused and seq.state == "live":
                # A paused request's draft row keeps the place the target left it at.
                anchor = self.anchors.setdefault(rid, seq.anchor)
                assert seq.anchor == anchor and seq.cached <= anchor + 4, rid
                self.paused_rows += 1
            else:
                self.anchors.pop(rid, None)
        self.steps += 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_outputs_equal_transformers_and_the_engine_without_speculation(family):
    if family == "llama":
        hf = tiny_llama()
        draft = tiny_llama(seed=1, hidden=32, intermediate=64, layers=1)
        gib = None
    else:
        hf = without_windows(tiny_family("qwen3"))
        draft = without_windows(tiny_family("qwen3", seed=1))
        gib = lambda h, bs, n: n * kv_block_bytes(hf)(h, bs) / 1024 ** 3  # noqa: E731
    sizes = {} if gib is None else dict(gib=gib)
    plain = build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=32,
                         kernel_backend="torch", **sizes)
    prompts = make_prompts(LENGTHS, hf.config.vocab_size)
    expected = [r.generated_tokens for r in plain.generate_requests(
        greedy_requests(prompts, GENS), arrival_steps=[i // 2 for i in range(len(LENGTHS))])]
    assert expected == [hf_greedy(hf, p, g) for p, g in zip(prompts, GENS)]
    # Llama also drafts for itself (every draft accepted but where floating point differs).
    for model, rate in ((draft, 0.0), (hf, 0.99))[:2 if family == "llama" else 1]:
        drafter = DraftModelDrafter(model, Engine, kernel_backend="torch")
        check = FollowCheck(drafter)
        engine, prompts, requests, results = _pressure(hf, drafter, step_check=check, **sizes)
        assert_pressure_stats(engine.stats, results)
        assert [r.generated_tokens for r in results] == expected
        assert all(r.finish_reason == "length" for r in results)
        spec = engine.stats.speculative
        assert spec["acceptance_rate"] >= rate and spec["accepted_tokens"] > 0, spec
        # Kept in step: one draft request per target admission (each new request, each one
        # re-added after an eviction), none left at the end; paused rows were followed; the
        # rejected drafts were rewound.
        assert drafter.next_id == len(requests) + engine.stats.evictions
        assert drafter.by_target == {}
        assert check.steps > 20 and check.paused_rows > 0
        assert drafter.rewound_tokens > 0


def test_a_draft_context_too_small_for_the_target_still_gives_the_outputs():
    """A draft budget given smaller than the target's (6 blocks, 1 paused, against the target's
    10 and 2): the draft context pauses and evicts rows of its own and starts over when none
    can run; those rows get the n-gram drafter's proposals meanwhile, and the outputs stay
    transformers' greedy ones."""
    hf = tiny_llama()
    prompts = make_prompts(LENGTHS[:8], hf.config.vocab_size)
    drafter = DraftModelDrafter(hf, Engine, kernel_backend="torch",
                                buffer_size_gb=gib_for_blocks(hf, 16, 6),
                                paused_buffer_size_gb=gib_for_blocks(hf, 16, 1))
    engine = build_engine(hf, block_size=16, blocks=10, paused_blocks=2, max_tokens=32,
                          num_speculative_tokens=3, drafter=drafter, kernel_backend="torch")
    results = engine.generate_requests(greedy_requests(prompts, GENS[:8]),
                                       arrival_steps=[i // 2 for i in range(8)])
    assert [r.generated_tokens for r in results] == [hf_greedy(hf, p, g)
                                                     for p, g in zip(prompts, GENS[:8])]
    assert drafter.restarts > 0 and drafter.own_pauses + drafter.own_evictions > 0
    assert engine.stats.speculative["acceptance_rate"] > 0.9


def test_each_round_rewinds_the_rejected_drafts_and_feeds_the_accepted_ones_and_the_bonus():
    """One request driven by hand through ``admit`` / ``propose`` / ``release`` (the draft
    model is the target itself, so its drafts are transformers' greedy continuation of the
    history it is given): k draft steps a round; after a partial acceptance the rejected
    drafts are rewound and the bonus token fed; after a full one, the last draft and the bonus
    (k + 1 steps); a paused request's row stays where it was; a released one finishes."""
    hf = tiny_llama(vocab=64)
    target = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                      max_tokens=64, kernel_backend="torch",
                                      num_speculative_tokens=3, drafter="ngram").context
    drafter = DraftModelDrafter(hf, Engine, kernel_backend="torch")
    drafter.bind(target)
    prompt = [3, 9, 4, 17, 8, 21, 5]
    first = hf_greedy(hf, prompt, 1)
    drafter.admit(7, np.array(prompt))

    def round_of(history):
        before = (drafter.forward_passes, drafter.rewound_tokens)
        drafts = drafter.propose([7], [np.array(history)], 3)[0].tolist()
        assert drafts == hf_greedy(hf, history, 3), history
        return drafter.forward_passes - before[0], drafter.rewound_tokens - before[1], drafts

    history = prompt + first
    assert round_of(history)[:2] == (3, 0)      # the prefill of the history gives draft 1
    passes, rewound, drafts = round_of(history)  # nothing new: already drafted
    assert (passes, rewound) == (0, 0)
    # One draft accepted, then a bonus token of the target's own (not the second draft): the
    # second draft goes (the third was never forwarded), the bonus is fed.
    bonus = (drafts[1] + 1) % 64
    history = history + drafts[:1] + [bonus]
    passes, rewound, drafts = round_of(history)
    assert (passes, rewound) == (3, 1)
    # Every draft accepted, and the bonus: the third draft and the bonus are fed (k + 1 steps).
    history = history + drafts + hf_greedy(hf, history + drafts, 1)
    passes, rewound, drafts = round_of(history)
    assert (passes, rewound) == (4, 0)
    # Paused (missing from the calls) while another request runs: its row stays in place.
    seq = drafter.by_target[7]
    cached, length = seq.cached, seq.length
    drafter.admit(8, np.array([5, 6, 7]))
    for step in range(3):
        other = [5, 6, 7] + hf_greedy(hf, [5, 6, 7], 1 + step)
        drafter.propose([8], [np.array(other)], 3)
        assert seq.cached <= cached + 4 and seq.length <= length + 4 and seq.anchor == length
    history = history + drafts[:2] + [(drafts[2] + 1) % 64]
    passes, rewound, drafts = round_of(history)
    assert seq.cached == len(history) + 2
    # Released: its row finishes at the next round's update.
    drafter.release([7])
    rows = drafter.context.total_request_count
    drafter.propose([8], [np.array(other + [1])], 3)
    assert drafter.context.total_request_count == rows - 1
    assert drafter.context.host_request_ids()[:rows - 1].tolist() == [drafter.by_target[8].draft_id]


def test_async_scheduling_drafts_from_the_assumed_tokens_and_keeps_the_outputs():
    """Under async scheduling the drafter is given each history with the step in flight's
    drafts as if accepted, and proposes one token further: the draft rows follow those
    histories (rewound when they turn out wrong), and the outputs stay transformers'. (Also:
    prefix caching for the draft context is refused, and so is a proposal before ``bind``.)"""
    hf = tiny_llama(vocab=64)
    prompts = [[3, 9, 4, 17, 8], [5, 6, 7], [11, 2, 30, 31, 32, 33, 1, 9, 20]]
    # The target with its weights nudged: drafts accepted in part, the rest rewound.
    draft = tiny_llama(vocab=64)
    with torch.no_grad():
        noise = torch.Generator().manual_seed(3)
        for weight in draft.parameters():
            weight.add_(0.001 * torch.randn(weight.shape, generator=noise))
    with pytest.raises(ValueError, match="enable_prefix_caching=True for the draft model"):
        DraftModelDrafter(draft, Engine, enable_prefix_caching=True)
    drafter = DraftModelDrafter(draft, Engine, kernel_backend="torch")
    with pytest.raises(RuntimeError, match="bind"):
        drafter.propose([0], [np.array(prompts[0])], 3)
    engine = Engine.from_transformers(hf, block_size_tokens=8, buffer_size_gb=0.01,
                                      max_tokens=64, kernel_backend="torch",
                                      num_speculative_tokens=3, drafter=drafter,
                                      async_scheduling=True)
    assert engine.generate(prompts, max_new_tokens=14, ignore_eos=True) == \
        [hf_greedy(hf, p, 14) for p in prompts]
    assert engine.stats.speculative["accepted_tokens"] > 0 and drafter.rewound_tokens > 0
