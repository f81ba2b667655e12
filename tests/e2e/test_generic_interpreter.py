"""The generic transformers path through the Triton kernels (``TRITON_INTERPRET=1`` on a CPU,
compiled on CUDA; tests/run_tests.sh runs this file in its interpreter process): the context's
kernels and the paged attention kernels, with the torch references made to raise, for families
with and without sliding windows and sinks."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    assert_matches_transformers,
    gib_for_blocks,
    greedy_requests,
    make_prompts,
    refuse_torch_references,
)
from generic_families import VOCAB, kv_block_bytes, tiny_family
from sizing_warning import built
from test_interpreter import REFERENCES
from triton_marks import needs_triton

from dynctx.engine import Engine

pytestmark = [pytest.mark.interpreter, needs_triton]


def engine_for(hf, **kwargs):
    """12 blocks of 8 tokens, short of one request of max_position_embeddings (256): the
    sizing warning is asserted (``built``); the prompts and generations stay within 25 tokens."""
    block_bytes = kv_block_bytes(hf)
    return built(lambda: Engine.from_transformers(
        hf, block_size_tokens=8, buffer_size_gb=gib_for_blocks(hf, 8, 12, block_bytes),
        paused_buffer_size_gb=gib_for_blocks(hf, 8, 1, block_bytes), max_tokens=16,
        max_requests=4, kernel_backend="triton", record_logits=True, **kwargs))


# (family, layers): a family without windows, the two with sliding and full layers alternating
# (gpt-oss with sinks), and Mistral's window on its one layer. The window (6 tokens) is shorter
# than the prompt of 21, so a window the kernels ignored would give other tokens.
TRITON_FAMILIES = [("olmo2", 1), ("gemma3", 2), ("gpt_oss", 2), ("mistral", 1)]


@pytest.mark.parametrize("family, layers", TRITON_FAMILIES,
                         ids=[family for family, _ in TRITON_FAMILIES])
def test_generic_path_on_the_triton_kernels(family, layers, monkeypatch):
    references = list(REFERENCES) + [("dynctx.kernels.paged_attention", "paged_attention_ref")]
    refuse_torch_references(monkeypatch, references)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Few layers: the interpreter runs the attention kernels at about half a millisecond per
    # program instance.
    hf = tiny_family(family, num_hidden_layers=layers).to(device)
    # A prompt longer than the token budget: a chunked prefill beside a decode request.
    prompts = make_prompts([3, 21, 1], VOCAB, seed=32)
    gens = [4, 3, 4]
    engine = engine_for(hf, attention_backend="triton")
    assert engine.model.path == "generic" and engine.context.kernel_backend == "triton"
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 1])
    assert engine.model.attention_backend == "triton"
    assert engine.stats.chunked_prefills == 1
    monkeypatch.undo()
    assert_matches_transformers(hf.cpu(), prompts, gens, results)


def test_a_windowed_family_replays_graphs_on_the_triton_attention(monkeypatch):
    """gpt-oss's sliding layer (with sinks) under graphs: the stand-in runner (the CUDA graph
    runner on a GPU) captures the forward with the Triton attention, whose window and sinks
    read nothing back, and replays it; a prompt longer than the window."""
    refuse_torch_references(monkeypatch, list(REFERENCES)
                            + [("dynctx.kernels.paged_attention", "paged_attention_ref")])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = tiny_family("gpt_oss", num_hidden_layers=1, layer_types=["sliding_attention"]).to(device)
    prompts = make_prompts([3, 10], VOCAB, seed=33)
    gens = [3, 4]
    engine = engine_for(hf, attention_backend="triton", num_cuda_graphs=2)
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0])
    assert engine.model.attention_backend == "triton"
    assert engine.graph_replays > 0
    monkeypatch.undo()
    assert_matches_transformers(hf.cpu(), prompts, gens, results)
