"""The Triton paged attention through the engine with two layers and every prompt position's
log prob (issue 27): a causal mask that lets a query see one key ahead changes no last-token
logits of a one-layer model (the last query sees every key anyway), but every earlier position's
output, which the second layer reads back as its K/V and the prompt log probs show directly.

Under ``TRITON_INTERPRET=1`` on a CPU (tests/run_tests.sh's interpreter process), compiled on
CUDA; the torch attention paths raise, so the kernels provably ran. A prompt longer than the
token budget is chunked (its second chunk's queries start mid-sequence next to a decode
request). fp32: tokens, prompt and generated log probs equal transformers' within 1e-4."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import gib_for_blocks, hf_greedy, make_prompts, refuse_torch_references, tiny_llama
from triton_marks import needs_triton

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine

pytestmark = [pytest.mark.interpreter, needs_triton]

LOG_PROB_ATOL = 1e-4


def test_two_layers_every_prompt_log_prob_and_tokens_match_transformers(monkeypatch):
    refuse_torch_references(monkeypatch, [("dynctx.kernels.paged_attention",
                                           "paged_attention_ref")])
    from dynctx.models.paged_attention_torch import SdpaStep

    def refuse(*args, **kwargs):
        raise AssertionError("the torch attention path ran: the Triton kernels should have")

    monkeypatch.setattr(SdpaStep, "attend", refuse)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = tiny_llama(seed=41, vocab=128, hidden=32, layers=2, intermediate=64,
                    max_positions=64).to(device)
    prompts = make_prompts([5, 19, 2], hf.config.vocab_size, seed=42)
    gens = [3, 3, 3]
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=prompt,
        sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=gen,
                                       return_log_probs=True))
        for i, (prompt, gen) in enumerate(zip(prompts, gens))]
    engine = Engine.from_transformers(
        hf, block_size_tokens=8, buffer_size_gb=gib_for_blocks(hf, 8, 10),
        paused_buffer_size_gb=gib_for_blocks(hf, 8, 1), max_tokens=16, max_requests=4,
        attention_backend="triton")
    results = engine.generate_requests(requests, arrival_steps=[0, 0, 1])
    assert engine.model.attention_backend == "triton"
    assert results[1].num_prefill_chunks >= 2
    monkeypatch.undo()
    hf = hf.cpu()
    for prompt, gen, result in zip(prompts, gens, results):
        assert result.generated_tokens == hf_greedy(hf, prompt, gen)
        sequence = torch.tensor([prompt + result.generated_tokens])
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(sequence).logits[0].float(), dim=-1)
        expected = log_probs[:-1].gather(1, sequence[0, 1:, None])[:, 0].tolist()
        n = len(prompt)
        assert len(result.prompt_log_probs) == n - 1
        assert result.prompt_log_probs == pytest.approx(expected[:n - 1], abs=LOG_PROB_ATOL)
        assert result.generated_log_probs == pytest.approx(expected[n - 1:], abs=LOG_PROB_ATOL)
