"""The draft-model drafter: a smaller transformers causal LM of the target's vocabulary drafts
greedily through its own engine and dynctx context.

Each ``propose`` runs the draft engine over the requests that decode next: one greedy request
per target request (its whole history as the prompt, ``k`` tokens to generate), batched by the
draft engine's own scheduler (in-flight batching, chunked prefill, pauses under its memory
budget), then finished. The draft context runs prefix caching with the ``"lru"`` policy, so a
request's full KV blocks stay cached between steps and each round computes only its history's
last partial block and the new tokens (``k`` draft forward passes a round, batched over every
request). Requests therefore live in the draft context only while their drafts are computed:
a target request paused, evicted or finished simply is not proposed for, and its cached blocks
age out of the draft's cache (least recently used first). Greedy drafts are deterministic:
verification treats them as one-hot proposals.

A draft request that the draft engine cannot serve (its history beyond the draft model's
``max_position_embeddings``) gets the n-gram drafter's proposal instead: drafts never change
the outputs, only how many are accepted.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np

from dynctx.context import DynamicInferenceRequest, SamplingParams

from .drafters import NgramDrafter, check_drafter


class DraftModelDrafter:
    """Drafts with ``hf_model`` (a transformers causal LM) through ``engine_class`` (``Engine``)
    built by ``engine_class.from_transformers(hf_model, **engine_options)``, prefix caching on
    (``"lru"``) and CUDA graphs off unless ``engine_options`` say otherwise."""

    def __init__(self, hf_model: Any, engine_class: Any, **engine_options: Any):
        options: Dict[str, Any] = dict(enable_prefix_caching=True,
                                       prefix_caching_eviction_policy="lru", cuda_graphs=False)
        options.update(engine_options)
        self.engine = engine_class.from_transformers(hf_model, **options)
        self.vocab_size = int(hf_model.config.vocab_size)
        self.max_length = int(self.engine.context.max_sequence_length)
        self.fallback = NgramDrafter()
        self.rounds = 0

    def propose(self, request_ids: Sequence[int], histories: Sequence[np.ndarray],
                k: int) -> np.ndarray:
        drafts = self.fallback.propose(request_ids, histories, k)
        fits = [i for i, history in enumerate(histories) if len(history) + k <= self.max_length]
        if not fits:
            return drafts
        engine = self.engine
        # Every draft request of a round finishes in it: the ids are free again.
        requests = [DynamicInferenceRequest(
            request_id=n, prompt_tokens=histories[i].tolist(),
            sampling_params=SamplingParams(temperature=0.0, top_k=1, num_tokens_to_generate=k))
            for n, i in enumerate(fits)]
        for i, result in zip(fits, engine.generate_requests(requests)):
            tokens = result.generated_tokens
            if result.finish_reason != "error" and tokens:
                drafts[i, :len(tokens)] = tokens
                drafts[i, len(tokens):] = tokens[-1]
        self.rounds += 1
        return drafts

    def release(self, request_ids: Sequence[int]) -> None:
        """Nothing is held per request between rounds (the module docstring)."""


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
