"""A short engine run on ``kernel_backend="triton"`` gives exactly the tokens of the same run on
``kernel_backend="torch"``: a tiny random Llama, three requests (one arriving later, one long
enough to be chunked), a few tokens each, greedy. Under ``TRITON_INTERPRET=1`` on a CPU
(``tests/run_tests.sh`` runs this file in the interpreter process), compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import gib_for_blocks, greedy_requests, make_prompts, tiny_llama
from sizing_warning import built
from tolerances import LOG_SOFTMAX_TOLERANCE
from triton_marks import needs_triton

from dynctx.engine import Engine

pytestmark = [
    pytest.mark.interpreter,
    needs_triton,
]


def _run(hf, backend: str, prompts, gens):
    engine = built(lambda: Engine.from_transformers(
        hf, rope="table", block_size_tokens=8, buffer_size_gb=gib_for_blocks(hf, 8, 8),
        paused_buffer_size_gb=gib_for_blocks(hf, 8, 2), max_tokens=16, max_requests=4,
        kernel_backend=backend, attention_backend="torch", record_logits=True))
    assert engine.context.kernel_backend == backend
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 1])
    return results, engine.stats


def test_engine_tokens_identical_on_triton_and_torch():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = tiny_llama(seed=31, vocab=96, hidden=32, intermediate=64, max_positions=64).to(device)
    prompts = make_prompts([4, 21, 2], hf.config.vocab_size, seed=32)
    gens = [4, 3, 4]
    triton_results, triton_stats = _run(hf, "triton", prompts, gens)
    torch_results, torch_stats = _run(hf, "torch", prompts, gens)
    assert torch_stats.chunked_prefills >= 1, "the 21-token prompt was meant to be chunked"
    assert triton_stats.chunked_prefills == torch_stats.chunked_prefills
    for got, want in zip(triton_results, torch_results):
        assert got.finish_reason == want.finish_reason == "length", (got.error, want.error)
        assert got.generated_tokens == want.generated_tokens, \
            f"request {got.request_id}: triton {got.generated_tokens} torch {want.generated_tokens}"
        assert len(got.generated_tokens) == gens[got.request_id]
        assert [p for p, _ in got.step_logits] == [p for p, _ in want.step_logits]
        for (_, g), (_, w) in zip(got.step_logits, want.step_logits):
            torch.testing.assert_close(g, w, **LOG_SOFTMAX_TOLERANCE)
