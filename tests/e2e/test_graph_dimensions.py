"""The engine on a random Llama with CUDA graph batch dimensions on (``num_cuda_graphs``) and
capture off (``cuda_graphs=False``): steps run padded to Megatron's graph shapes (decode-only and
mixed), the forward eager, and every request's tokens and every step's logits equal
transformers' as without graphs. With capture on: tests/e2e/test_graph_replay.py."""

from __future__ import annotations

import pytest
from e2e_helpers import (
    FP32_LOGITS_ATOL,
    assert_pressure_stats,
    assert_requests_match_greedy,
    build_engine,
    case_engine_sizes,
    pressure_workload,
    tiny_llama,
    worst_logit_error,
)
from test_llama_engine import BASE_GENS, BASE_LENGTHS

from dynctx.context.graph_ladder import graph_fits_step

CASE = dict(block_size=16, blocks=14, paused_blocks=3, max_tokens=32, max_requests=8, scale=1)


@pytest.mark.parametrize("mixed", [2, None], ids=["mixed", "decode-only"])
def test_pressure_workload_in_graph_shapes_matches_transformers(mixed):
    hf = tiny_llama()
    prompts, requests, arrivals = pressure_workload(hf, CASE, BASE_LENGTHS, BASE_GENS)
    shapes = []

    def record(step):
        ctx = engine.context
        if not step.idle:
            shapes.append((ctx.batch_dimensions, ctx.padded_batch_dimensions,
                           ctx.using_cuda_graph_this_step()))

    engine = build_engine(hf, **case_engine_sizes(CASE), kernel_backend="torch",
                          record_logits=True, num_cuda_graphs=4, cuda_graphs=False,
                          cuda_graph_mixed_prefill_count=mixed, step_callback=record)
    graphs = engine.context.cuda_graph_batch_dimensions_list
    assert graphs and any(g.prefill_req_count for g in graphs) == (mixed is not None)
    results = engine.generate_requests(requests, arrival_steps=arrivals)

    assert_pressure_stats(engine.stats, results)
    in_graph = [(real, padded) for real, padded, used in shapes if used]
    assert len(in_graph) >= len(shapes) // 2
    assert all(padded in graphs and graph_fits_step(padded, real) for real, padded in in_graph)
    # Padding beyond the eager one: steps in a graph with more tokens than they have.
    assert any(padded.token_count > real.token_count for real, padded in in_graph)
    if mixed is not None:
        assert any(real.prefill_req_count for real, _ in in_graph)
    assert_requests_match_greedy(hf, requests, prompts, results)
    worst = worst_logit_error(hf, results)
    assert worst <= FP32_LOGITS_ATOL, f"step logits differ by {worst}"
