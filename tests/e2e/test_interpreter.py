"""The composed Triton kernel path on a CPU: ``kernel_backend="triton"`` under
``TRITON_INTERPRET=1`` (set before import; ``tests/run_tests.sh`` runs this file in its own
pytest process). The torch references of the kernels are made to raise, so every context
kernel provably ran as Triton."""

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

REFERENCES = [
    ("dynctx.kernels.kv_append", "kv_append_ref"),
    ("dynctx.kernels.rope", "fused_qk_rope_ref"),
    ("dynctx.kernels.rope_kv_append", "rope_kv_append_ref"),
    ("dynctx.kernels.step_metadata", "step_metadata_ref"),
    ("dynctx.kernels.compaction", "compact_requests_ref"),
    ("dynctx.kernels.last_token_logits", "last_token_logits_ref"),
]


@pytest.fixture
def no_torch_references(monkeypatch):
    refuse_torch_references(monkeypatch, REFERENCES)


@pytest.mark.parametrize("rope, fused", [("table", False), ("cos_sin", False), ("table", True)],
                         ids=["table", "cos_sin", "fused_append"])
def test_triton_kernels_compose_through_the_engine(rope, fused, no_torch_references):
    hf = tiny_llama(seed=21, vocab=128, hidden=32, intermediate=64, max_positions=128)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = hf.to(device)
    prompts = make_prompts([3, 20, 1], hf.config.vocab_size, seed=22)
    gens = [6, 5, 6]
    engine = built(lambda: Engine.from_transformers(
        hf, rope=rope, block_size_tokens=16, buffer_size_gb=gib_for_blocks(hf, 16, 6),
        paused_buffer_size_gb=gib_for_blocks(hf, 16, 1), max_tokens=16, max_requests=4,
        kernel_backend="triton", fused_rope_kv_append=fused, attention_backend="torch",
        record_logits=True))
    assert engine.context.kernel_backend == "triton"
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 2])
    assert engine.stats.chunked_prefills == 1
    hf = hf.cpu()
    assert_matches_transformers(hf, prompts, gens, results)
