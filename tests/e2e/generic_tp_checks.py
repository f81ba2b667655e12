"""What each rank of the generic path's 2-rank tensor-parallel test runs
(``test_generic_tensor_parallel.py`` spawns the ranks with ``distributed_ranks.run_spawned``):
a dense and a MoE family sharded by their own ``base_model_tp_plan``, through
``Engine.from_transformers(..., tensor_model_parallel_size=2)``, rank 0's requests broadcast,
each rank checking its share of the requests against transformers (``tp_checks._run``)."""

from __future__ import annotations

from typing import Any, Dict

from e2e_helpers import greedy_requests, make_prompts
from generic_families import VOCAB, kv_block_bytes, tiny_family
from tp_checks import TP, _engine, _run

# Six requests in 10 blocks of 8 tokens per rank (2 paused), 16 tokens a step: pauses, evictions
# and chunks, at a third of the single-process workload's reference cost.
LENGTHS = [1, 17, 30, 5, 24, 9]
GENS = [24, 16, 16, 24, 16, 24]


def family_pressure(family: str) -> Dict[str, Any]:
    hf = tiny_family(family)
    block_bytes = kv_block_bytes(hf)
    prompts = make_prompts(LENGTHS, VOCAB, seed=2)
    engine = _engine(hf, lambda h, bs: block_bytes(h, bs) / TP, block_size=8, blocks=10,
                     paused_blocks=2, max_tokens=16)
    out = _run(hf, engine, prompts, greedy_requests(prompts, GENS),
               [i // 2 for i in range(len(GENS))])
    model = engine.model
    out.update(path=model.path, sharded=model.hf_model is not hf,
               q_rows=tuple(model.hf_model.model.layers[0].self_attn.q_proj.weight.shape))
    return out


def all_checks() -> Dict[str, Any]:
    return {family: family_pressure(family) for family in ("qwen3", "qwen3_moe")}
