"""The generic transformers path under tensor parallelism (two CPU ranks over gloo): Qwen3
(dense, a windowed layer) and Qwen3-MoE sharded by their own ``base_model_tp_plan``
(models/tp_plan.py) equal transformers' greedy ``generate`` on every rank, every step's
logits within fp32 tolerance, under pauses, evictions and chunked prefill; plans the generic
path does not run are refused naming the style."""

from __future__ import annotations

import pytest
from distributed_ranks import run_spawned
from e2e_helpers import FP32_LOGITS_ATOL
from generic_families import tiny_family

from dynctx.models import TensorParallel
from dynctx.models.tp_plan import plan_actions

TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def ranks() -> dict:
    import generic_tp_checks

    return run_spawned(generic_tp_checks.all_checks, world_size=2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_every_rank_matches_transformers(ranks, family):
    first, second = ranks[0][family], ranks[1][family]
    for key in ("tokens", "finish", "sizes", "pressure", "local_heads", "kv_shape"):
        assert first[key] == second[key], key
    assert first["path"] == "generic" and first["sharded"]
    # Half of the 4 query heads of 8 dims, half of the 2 KV heads, on each rank.
    assert first["local_heads"] == dict(num_q_heads=2, num_kv_heads=1)
    assert first["q_rows"] == (16, 32) and first["kv_shape"][-2:] == (1, 8)
    assert all(reason == "length" for reason in first["finish"])
    assert first["checked"] + second["checked"] == len(first["tokens"])
    for out in (first, second):
        assert out["mismatches"] == [], f"requests differing from transformers: {out}"
        assert out["steps_checked"] > 0
        assert out["worst_logit_error"] <= FP32_LOGITS_ATOL, out["worst_logit_error"]
    pauses, evictions, chunked = first["pressure"]
    assert pauses > 0 and evictions > 0 and chunked > 0, first["pressure"]


class _TwoRanks(TensorParallel):
    """A rank of two for the plan checks (no process group: nothing is reduced)."""

    def __init__(self):
        super().__init__(2, 0, None)


@pytest.mark.parametrize("family, message", [
    ("olmo2", r"colwise_gather_output"),
    ("gpt_oss", r"embedding_rowwise|has no base_model_tp_plan"),
], ids=["olmo2", "gpt_oss"])
def test_plans_off_the_supported_styles_are_refused(family, message):
    with pytest.raises(NotImplementedError, match=message):
        plan_actions(tiny_family(family), _TwoRanks())


def test_sizes_the_ranks_do_not_divide_are_refused():
    model = tiny_family("qwen2", num_key_value_heads=1)
    with pytest.raises(ValueError, match="num_key_value_heads=1 must be divisible"):
        plan_actions(model, _TwoRanks())


def test_the_plan_shards_every_planned_layer():
    actions = dict(plan_actions(tiny_family("qwen3_moe"), _TwoRanks()))
    assert actions["layers.0.self_attn.q_proj"] == "colwise"
    assert actions["layers.1.self_attn.o_proj"] == "rowwise"
    assert actions["layers.0.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert actions["layers.0.mlp.experts.down_proj"] == "rowwise"
    assert actions["layers.0.mlp.experts"] == "moe_tp_experts"
