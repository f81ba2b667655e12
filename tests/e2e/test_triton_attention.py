"""The engine with ``attention_backend="triton"``: our paged attention kernels end to end.

On a CPU the kernels run under ``TRITON_INTERPRET=1`` (set before import; ``tests/run_tests.sh``
runs this file in its interpreter process); on CUDA compiled. The torch attention paths are
made to raise, so the Triton kernels provably ran. fp32: the greedy tokens equal transformers'
and every step's logits are within ``FP32_LOGITS_ATOL`` of its full forward.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    assert_matches_transformers,
    gib_for_blocks,
    greedy_requests,
    make_prompts,
    refuse_torch_references,
    tiny_llama,
)
from sizing_warning import built
from triton_marks import needs_triton

from dynctx.engine import Engine

pytestmark = [
    pytest.mark.interpreter,
    needs_triton,
]

TORCH_ATTENTION = [
    ("dynctx.kernels.paged_attention", "paged_attention_ref"),
]


def test_triton_attention_through_the_engine(monkeypatch):
    refuse_torch_references(monkeypatch, TORCH_ATTENTION)
    from dynctx.models.paged_attention_torch import SdpaStep

    def refuse(*args, **kwargs):
        raise AssertionError("the torch attention path ran: the Triton kernels should have")

    monkeypatch.setattr(SdpaStep, "attend", refuse)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = tiny_llama(seed=31, vocab=128, hidden=32, layers=1, intermediate=64,
                    max_positions=128).to(device)
    # A prompt longer than the token budget: chunked prefill, its second chunk mid-sequence
    # next to a decode request (a mixed step), then decode-only steps.
    prompts = make_prompts([3, 21, 1], hf.config.vocab_size, seed=32)
    gens = [4, 3, 4]
    engine = built(lambda: Engine.from_transformers(
        hf, block_size_tokens=8, buffer_size_gb=gib_for_blocks(hf, 8, 12),
        paused_buffer_size_gb=gib_for_blocks(hf, 8, 1), max_tokens=16, max_requests=4,
        attention_backend="triton", record_logits=True))
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 1])
    assert engine.model.attention_backend == "triton"
    assert engine.stats.chunked_prefills == 1
    monkeypatch.undo()
    assert_matches_transformers(hf.cpu(), prompts, gens, results)
