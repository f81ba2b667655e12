"""Drafters for speculative decoding: what proposes the ``k`` tokens a step verifies.

The drafter interface (how an MTP head or any other proposer plugs in) is three members:

* ``vocab_size``: the vocabulary the drafts come from (an int), or None when the drafter works
  on any (the n-gram drafter); ``Engine.from_transformers`` refuses a drafter whose vocabulary
  is not the target's before anything is built.
* ``propose(request_ids, histories, k)``: ``request_ids`` (ints) and ``histories`` (one 1-D
  int64 numpy array per request: its prompt, every token it generated, the token the next step
  forwards last) give the requests that decode next; returns up to ``k`` draft tokens per
  request, as an integer array or tensor ``[len(request_ids), k]`` of ids in ``[0,
  vocabulary)``, where a -1 ends a request's drafts: a row of -1s proposes nothing, and that
  request decodes one token without drafts (a step where none has drafts is a plain decode
  step). Drafts are proposals only: a wrong one costs compute, never a different output. The
  drafts are deterministic, so verification treats them as one-hot proposals (``q``).
* ``release(request_ids)``: those requests left the target's context (finished, or evicted
  for recompute); a drafter that keeps per-request state drops it.
  A request that comes back (re-added after an eviction, or after the engine's suspend and
  resume) is proposed for from its whole history again.

A drafter may also **follow the target's requests** step by step (the draft model does,
``engine/draft_model.py``: its own context holds every request the target holds). It then has
``follows_requests = True`` and two more methods, and ``propose`` is called more often:

* ``bind(context)``: once, when the engine is built, with the target's context (its block
  size, request rows, token budget and blocks size the drafter's own);
* ``admit(request_id, prompt)``: right after the target adds a request (its first chunk), with
  its whole prompt (1-D int64 numpy); a request re-added (after an eviction or a suspend)
  comes again, with its generated tokens in the prompt, and replaces what the drafter held;
* ``propose`` is called at every step that runs a forward pass, with the requests that decode
  next (none is an empty call), and ``k = 0`` while a prompt is being chunked (the drafter
  keeps up with their tokens and its admissions, and returns ``[n, 0]``); a request the
  target paused is missing from the calls until it runs again.

``NgramDrafter`` is prompt lookup: the longest recent n-gram of the request's own tokens that
occurred before proposes the tokens that followed it. ``make_drafter`` resolves
``Engine.from_transformers``' ``drafter`` option (a transformers model: ``engine/draft_model.py``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

DRAFTER_NAMES = ("ngram",)


class NgramDrafter:
    """Prompt lookup over each request's own tokens (no weights; any model).

    ``min_ngram`` is 2 by default: one matching token is weak evidence (vLLM's n-gram
    proposer defaults to 5), and a request without a match decodes without drafts.

    For ``n`` from ``max_ngram`` down to ``min_ngram``: the last ``n`` tokens of the history are
    searched for earlier in its last ``window`` tokens; the latest earlier occurrence proposes
    the ``k`` tokens that followed it (a continuation that runs into the end of the history is
    padded with its last proposed token). The longest ``n`` that matches wins; without a match
    the request gets no drafts (-1s), so that it decodes without speculation's cost. All
    requests are searched at once over one padded ``[requests, window]`` matrix (one pass a
    ``n``, no per-request loop)."""

    vocab_size: Optional[int] = None

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 2, window: int = 512):
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram),
                            ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram={min_ngram} must be <= max_ngram={max_ngram}")
        if window <= max_ngram:
            raise ValueError(f"window={window} must be > max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, request_ids: Sequence[int], histories: Sequence[np.ndarray],
                k: int) -> np.ndarray:
        rows = len(histories)
        if rows == 0:
            return np.zeros((0, k), dtype=np.int64)
        lengths = np.fromiter((min(len(h), self.window) for h in histories), dtype=np.int64,
                              count=rows)
        width = int(lengths.max())
        # Right-aligned: the last token of every history in the last column; -1 pads.
        padded = np.full((rows, width), -1, dtype=np.int64)
        flat = np.concatenate([h[len(h) - n:] for h, n in zip(histories, lengths)])
        columns = np.arange(width)[None, :] >= (width - lengths)[:, None]
        padded[columns] = flat
        drafts = np.full((rows, k), -1, dtype=np.int64)
        # An n-gram match needs the last token earlier on: most rows of unrepetitive text
        # have none, and then nothing is searched.
        if not (padded[:, :-1] == padded[:, -1:]).any():
            return drafts
        found = np.zeros(rows, dtype=bool)
        for n in range(min(self.max_ngram, width - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(padded, n, axis=1)
            # Windows ending before the last token (the suffix itself excluded).
            match = (windows[:, :-1] == padded[:, None, width - n:]).all(axis=-1)
            match &= (padded[:, :width - n] >= 0)
            hit = match.any(axis=1) & ~found
            if not hit.any():
                continue
            start = width - n - 1 - np.argmax(match[:, ::-1], axis=1)   # latest occurrence
            follow = start[:, None] + n + np.arange(k)[None, :]           # [rows, k]
            inside = follow < width
            taken = np.take_along_axis(padded, np.minimum(follow, width - 1), axis=1)
            # Past the end: the last proposed token inside the history repeats.
            fill = np.maximum.accumulate(np.where(inside, np.arange(k)[None, :], 0), axis=1)
            taken = np.take_along_axis(taken, fill, axis=1)
            drafts[hit] = taken[hit]
            found |= hit
        return drafts

    def release(self, request_ids: Sequence[int]) -> None:
        """Nothing is kept per request."""


def follows_requests(drafter: Any) -> bool:
    """Whether ``drafter`` follows the target's requests (module docstring)."""
    return bool(getattr(drafter, "follows_requests", False))


def check_drafter(drafter: Any, target_vocab: Optional[int]) -> None:
    """``drafter`` has the interface (module docstring) and the target's vocabulary."""
    names = ("propose", "release") + (("bind", "admit") if follows_requests(drafter) else ())
    for name in names:
        if not callable(getattr(drafter, name, None)):
            raise TypeError(f"drafter={drafter!r} must have a callable {name}() (the drafter "
                            "interface, dynctx.engine.drafters), or be 'ngram' or a "
                            "transformers causal LM")
    vocab = getattr(drafter, "vocab_size", None)
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer))):
        raise TypeError(f"drafter.vocab_size={vocab!r} must be an int or None (the drafter "
                        "interface, dynctx.engine.drafters)")
    if vocab is not None and target_vocab is not None and int(vocab) != int(target_vocab):
        raise ValueError(f"drafter has vocab_size={vocab}, the target model {target_vocab}: "
                         "drafts must come from the target's vocabulary")


def check_proposals(proposed: np.ndarray, rows: int, k: int,
                    vocab: Optional[int]) -> np.ndarray:
    """A drafter's ``propose`` answer is integer ``[rows, k]``; each row's drafts are its
    entries before its first -1 (none when it starts with -1), each in the vocabulary. Returns
    the rows' draft counts."""
    if proposed.shape != (rows, k) or proposed.dtype.kind not in "iu":
        raise ValueError(f"drafter.propose returned {proposed.dtype} {tuple(proposed.shape)}, "
                         f"expected integers [{rows} requests, num_speculative_tokens={k}]")
    ended = proposed < 0
    own = np.where(ended.any(axis=1), ended.argmax(axis=1), k) if rows else \
        np.zeros(0, dtype=np.int64)
    kept = np.arange(k)[None, :] < own[:, None]
    bad = (proposed < -1) | (kept & (proposed >= (np.inf if vocab is None else vocab)))
    if bad.any():
        raise ValueError(f"drafter.propose returned token id {int(proposed[bad][0])}, outside "
                         f"[0, vocab_size={vocab}) (-1 ends a request's drafts)")
    return own.astype(np.int64)


def make_drafter(drafter: Any, target_vocab: Optional[int]) -> Any:
    """The drafter for ``Engine.from_transformers``' ``drafter`` option other than a
    transformers model (``engine/draft_model.py`` builds those): ``"ngram"`` (case sensitive)
    or an object with the drafter interface, checked against the target's vocabulary size.
    Raises naming ``drafter``."""
    if isinstance(drafter, str):
        if drafter not in DRAFTER_NAMES:
            raise ValueError(f"drafter={drafter!r} must be one of {DRAFTER_NAMES}, a "
                             "transformers causal LM or an object with the drafter interface")
        drafter = NgramDrafter()
    check_drafter(drafter, target_vocab)
    return drafter


def is_transformers_model(value: Any) -> bool:
    config = getattr(value, "config", None)
    return (config is not None and hasattr(config, "vocab_size")
            and callable(getattr(value, "parameters", None)))
