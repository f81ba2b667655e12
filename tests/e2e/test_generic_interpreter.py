"""The generic transformers path through the Triton kernels (``TRITON_INTERPRET=1`` on a CPU,
compiled on CUDA; tests/run_tests.sh runs this file in its interpreter process): the context's
kernels and, for a family without windows or sinks, the paged attention kernels, with the torch
references made to raise; a windowed family refuses the Triton attention instead of giving
other tokens."""

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
from test_interpreter import REFERENCES
from triton_marks import needs_triton

from dynctx.engine import Engine

pytestmark = [pytest.mark.interpreter, needs_triton]


def engine_for(hf, **kwargs):
    block_bytes = kv_block_bytes(hf)
    return Engine.from_transformers(
        hf, block_size_tokens=8, buffer_size_gb=gib_for_blocks(hf, 8, 12, block_bytes),
        paused_buffer_size_gb=gib_for_blocks(hf, 8, 1, block_bytes), max_tokens=16,
        max_requests=4, kernel_backend="triton", record_logits=True, **kwargs)


@pytest.mark.parametrize("family, attention", [("olmo2", "triton"), ("gemma3", "torch")],
                         ids=["olmo2-triton_attention", "gemma3-torch_attention"])
def test_generic_path_on_the_triton_kernels(family, attention, monkeypatch):
    references = list(REFERENCES)
    if attention == "triton":
        references.append(("dynctx.kernels.paged_attention", "paged_attention_ref"))
    refuse_torch_references(monkeypatch, references)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # One layer where the interpreter runs the attention kernels (about half a millisecond per
    # program instance).
    layers = dict(num_hidden_layers=1) if attention == "triton" else {}
    hf = tiny_family(family, **layers).to(device)
    # A prompt longer than the token budget: a chunked prefill beside a decode request.
    prompts = make_prompts([3, 21, 1], VOCAB, seed=32)
    gens = [4, 3, 4]
    engine = engine_for(hf, attention_backend=attention)
    assert engine.model.path == "generic" and engine.context.kernel_backend == "triton"
    results = engine.generate_requests(greedy_requests(prompts, gens), arrival_steps=[0, 0, 1])
    assert engine.model.attention_backend == attention
    assert engine.stats.chunked_prefills == 1
    monkeypatch.undo()
    assert_matches_transformers(hf.cpu(), prompts, gens, results)


def test_a_windowed_family_refuses_the_triton_attention():
    with pytest.raises(NotImplementedError, match="Gemma3ForCausalLM has sliding windows"):
        engine_for(tiny_family("gemma3"), attention_backend="triton")
