"""Tensor parallelism over torch.distributed on two CPU ranks (gloo), against transformers.

One spawn of two ranks (``distributed_ranks.run_spawned``; the ranks run ``tp_checks.all_checks``)
runs every check, so that the ranks import torch and transformers once:

* Llama (2 KV heads, one per rank; and 1 KV head, replicated on both ranks), DeepSeek-V2 (MLA:
  heads sharded, the latent replicated; a MoE layer) and NemotronH (Mamba heads and groups
  sharded; and, apart, its attention's single KV head replicated) through
  ``Engine.from_transformers(..., tensor_model_parallel_size=2)``, rank 0's requests broadcast:
  every rank returns the same tokens, equal to transformers' greedy ``generate``, and every
  step's last-token logits lie within 1e-4 (fp32) of transformers' full forward; the Llama,
  DeepSeek and NemotronH workloads pause, evict and chunk;
* speculative decoding (Llama, n-gram drafts, k = 3), synchronous and under async scheduling:
  both ranks gain the same tokens, equal to transformers';
* every rank's context has the same sizes; ranks given different memory budgets end with the
  same (smallest) block counts, and different explicit ``max_requests`` are refused on every
  rank; a context step makes no collective call;
* two pipeline stages of a hybrid with uneven layers (local layer maps) share one block count;
* lockstep under adversarial use (``tp_checks.lockstep``): sampling with and without seeds
  equal to one process's, a bad request and unpicklable arguments refused on every rank with
  the engine serving on, prefix caching (hybrid LRU with different snapshot budgets per rank;
  Llama ref_zero with the CUDA-graph stand-in), settings that differ refused on every rank, a
  rank's own bad argument raised on every rank (no rank left waiting in a collective).

and ``python -P -m torch.distributed.run --nproc-per-node 2 -m dynctx demo
--tensor-parallel-size 2`` (the README's launch) runs and checks against transformers.
Megatron-Core's own uneven-pipeline test runs in tests/megatron/test_dynamic_context.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from distributed_ranks import run_spawned
from e2e_helpers import FP32_LOGITS_ATOL

# Generous: both ranks together take about 20-25 s on a loaded 2-core machine (docs/DESIGN.md §10).
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def ranks() -> dict:
    import tp_checks

    return run_spawned(tp_checks.all_checks, world_size=2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("model", ["llama", "llama_replicated_kv", "deepseek", "nemotron_h",
                                   "nemotron_h_replicated_kv"])
def test_every_rank_matches_transformers(ranks, model):
    first, second = ranks[0][model], ranks[1][model]
    # Lockstep: the same tokens, sizes and pressure on both ranks.
    for key in ("tokens", "finish", "sizes", "pressure", "local_heads", "kv_shape"):
        assert first[key] == second[key], key
    assert all(reason == "length" for reason in first["finish"])
    # Each rank checked its half of the requests against transformers.
    assert first["checked"] + second["checked"] == len(first["tokens"])
    for out in (first, second):
        assert out["mismatches"] == [], f"requests differing from transformers: {out}"
        assert out["steps_checked"] > 0
        assert out["worst_logit_error"] <= FP32_LOGITS_ATOL, out["worst_logit_error"]
    if not model.endswith("_replicated_kv"):
        pauses, evictions, chunked = first["pressure"]
        assert pauses > 0 and evictions > 0 and chunked > 0, first["pressure"]


@pytest.mark.parametrize("mode", ["llama_speculative", "llama_speculative_async"])
def test_speculative_decoding_on_two_ranks(ranks, mode):
    """Speculative steps (k = 3, n-gram drafts), synchronous and under async scheduling: both
    ranks gain the same tokens from the same drafts, equal to transformers' greedy generate
    (and, synchronously, every gained token's logits within 1e-4), under pauses, evictions and
    chunked prefill."""
    first, second = ranks[0][mode], ranks[1][mode]
    for key in ("tokens", "finish", "sizes", "pressure", "speculative"):
        assert first[key] == second[key], key
    assert first["checked"] + second["checked"] == len(first["tokens"])
    for out in (first, second):
        assert out["mismatches"] == [], f"requests differing from transformers: {out}"
        if "worst_logit_error" in out:
            assert out["steps_checked"] > 0
            assert out["worst_logit_error"] <= FP32_LOGITS_ATOL, out["worst_logit_error"]
    spec = first["speculative"]
    assert spec["accepted_tokens"] > 0 and spec["tokens_per_forward"] > 1, spec
    pauses, evictions, chunked = first["pressure"]
    assert pauses > 0 and chunked > 0, first["pressure"]


def test_shards(ranks):
    # (query heads, KV heads) per rank: 4/2 -> 2/1; 4/1 -> 2/1 (the KV head replicated).
    heads = {model: ranks[0][model]["local_heads"] for model in ranks[0]
             if model not in ("sizing", "lockstep", "llama_speculative_async")}
    assert heads["llama"] == dict(num_q_heads=2, num_kv_heads=1)
    assert heads["llama_replicated_kv"] == dict(num_q_heads=2, num_kv_heads=1)
    assert ranks[0]["llama"]["kv_shape"][-2:] == (1, 16)
    # DeepSeek: 2 of 4 heads; the latent row (32 + 16) whole.
    assert heads["deepseek"]["num_heads"] == 2
    assert ranks[0]["deepseek"]["kv_shape"][-1] == 48
    # NemotronH: attention 2 of 4 query heads, 1 of 2 KV heads; Mamba 2 of 4 heads and 1 of 2
    # groups: conv state (16 + 2 * 8, 4), SSM state (2, 8, 8).
    assert heads["nemotron_h"] == dict(num_q_heads=2, num_kv_heads=1, mamba_heads=2, n_groups=1)
    assert ranks[0]["nemotron_h"]["mamba_shapes"] == ((32, 4), (2, 8, 8))
    # One KV head for two ranks: each holds it, with half the query heads.
    assert heads["nemotron_h_replicated_kv"] == dict(num_q_heads=2, num_kv_heads=1,
                                                    mamba_heads=2, n_groups=1)
    assert ranks[0]["nemotron_h_replicated_kv"]["kv_shape"][-2:] == (1, 16)


def test_sizes_agree_over_the_group(ranks):
    first, second = ranks[0]["sizing"], ranks[1]["sizing"]
    # Alone, the ranks' budgets (40 and 30 blocks, 8 and 5 paused) give different allocators.
    assert first["alone"][:2] == (40, 8) and second["alone"][:2] == (30, 5)
    # In one tensor-parallel group both take the smallest counts (level 0: total = buffer).
    assert first["shared"] == second["shared"]
    assert first["shared"][:2] == (30, 5)
    assert first["group"] and second["group"] and first["heads"] == 1
    for out in (first, second):
        assert out["refused"] is not None and "max_requests (from 8 to 16)" in out["refused"]
        assert out["steps"] > 3 and out["collectives_in_steps"] == []


def test_uneven_hybrid_pipeline_stages_share_the_block_count(ranks):
    first, second = ranks[0]["sizing"]["pipeline"], ranks[1]["sizing"]["pipeline"]
    # Local layer maps: global index on the stage -> index within its type.
    assert first["layer_map"] == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    assert second["layer_map"] == {0: 0, 1: 0}
    assert (first["attention_layers"], first["mamba_layers"]) == (3, 2)
    assert (second["attention_layers"], second["mamba_layers"]) == (1, 1)
    # Alone, the smaller stage fits more blocks; in the pipeline both take stage 0's count.
    assert first["alone"][0] < second["alone"][0]
    assert first["shared"] == second["shared"] and first["shared"][0] == first["alone"][0]
    # The engine runs every layer on every rank: it refuses pipeline stages.
    for out in (ranks[0]["sizing"], ranks[1]["sizing"]):
        assert "pipeline_model_parallel_size=2: the engine runs every layer" in \
            out["engine_pp_refused"]


def test_demo_runs_under_torchrun_with_two_ranks(tmp_path):
    """The README's launch (``--standalone``: a free rendezvous port), a shorter workload with a
    shared prefix through the prefix cache."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    command = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "dynctx", "demo", "--tensor-parallel-size", "2",
               "--requests", "8", "--max-new-tokens", "12", "--no-progress",
               "--prefix-caching", "lru", "--shared-prefix", "16",
               "--plot", str(tmp_path / "demo.png")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "check             OK: 8/8 outputs match transformers' greedy generate" in out
    assert "tensor parallel   2 ranks: 2 query heads and 1 KV head(s) per rank" in out
    assert re.search(r"prefix cache      lru: [1-9]\d* hits of ", out), out
    assert out.count("dynctx demo: random Llama") == 1          # rank 0 alone prints


def test_demo_tensor_parallel_without_torchrun_says_how_to_launch(monkeypatch):
    from dynctx import cli_demo

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="PYTHONSAFEPATH=1 python -P -m torch.distributed.run "
                                         "--nproc-per-node 2 -m dynctx demo "
                                         "--tensor-parallel-size 2"):
        cli_demo.main(["--tensor-parallel-size", "2", "--plot", ""])


# ---------------------------------------------------------------------- in one process
def test_engine_tensor_parallel_needs_torch_distributed():
    from e2e_helpers import tiny_llama

    from dynctx.engine import Engine

    with pytest.raises(RuntimeError, match="tensor_model_parallel_size=2 needs torch.distributed "
                                           "initialised.*torchrun"):
        Engine.from_transformers(tiny_llama(), buffer_size_gb=0.001,
                                 tensor_model_parallel_size=2)


def test_engine_refuses_pipeline_stages():
    from e2e_helpers import tiny_llama

    from dynctx.engine import Engine

    class Stages:
        pp = None

    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2 needs the pipeline's "
                                         "process group"):
        Engine.from_transformers(tiny_llama(), buffer_size_gb=0.001,
                                 pipeline_model_parallel_size=2, pg_collection=Stages())


def test_shards_that_do_not_divide_are_refused_naming_the_sizes():
    from e2e_helpers import tiny_llama
    from test_deepseek_mla import tiny_deepseek
    from test_nemotron_h import tiny_nemotron_h

    from dynctx.models import DeepseekV2Adapter, LlamaAdapter, NemotronHAdapter, TensorParallel

    three = TensorParallel(3, 0)
    with pytest.raises(ValueError, match="num_attention_heads=4 must be divisible by "
                                         "tensor_model_parallel_size=3"):
        LlamaAdapter.from_transformers(tiny_llama(), tensor_parallel=three)
    with pytest.raises(ValueError, match="num_key_value_heads=2 must divide "
                                         "tensor_model_parallel_size=3 when it is smaller"):
        LlamaAdapter.from_transformers(tiny_llama(hidden=48, heads=6, kv_heads=2),
                                       tensor_parallel=three)
    with pytest.raises(ValueError, match="num_attention_heads=4 must be divisible"):
        DeepseekV2Adapter.from_transformers(tiny_deepseek(), tensor_parallel=three)
    with pytest.raises(ValueError, match="n_groups=1 must be divisible by "
                                         "tensor_model_parallel_size=2"):
        NemotronHAdapter.from_transformers(tiny_nemotron_h(groups=1),
                                           tensor_parallel=TensorParallel(2, 0))


def test_lockstep_under_adversarial_use(ranks):
    """tp_checks.lockstep: every rank returns the same, and what it returns is right."""
    first, second = ranks[0]["lockstep"], ranks[1]["lockstep"]
    one_rank = ("bad_on_one_rank", "bad_engine_on_one_rank", "fails_after_agreement")
    assert {k: v for k, v in first.items() if k not in one_rank} == \
        {k: v for k, v in second.items() if k not in one_rank}
    # Rank 1's own bad argument: its error there; rank 0 raises too, naming rank 1 (no hang).
    assert second["bad_on_one_rank"] == "ValueError: buffer_size_gb=-1.0 must be a positive number"
    assert second["bad_engine_on_one_rank"] == "ValueError: seed=-1 must lie in [0, inf]"
    assert second["fails_after_agreement"] == ("TypeError: num_cuda_graphs=True must be an "
                                               "int, got bool")
    assert first["fails_after_agreement"] == (
        "RuntimeError: tensor/pipeline-parallel rank 1 raised after the ranks agreed, before they "
        "could build their contexts together (that rank's error says why); every rank stops")
    for case, what in zip(one_rank[:2], ("contexts", "engines")):
        assert first[case] == ("RuntimeError: tensor/pipeline-parallel rank 1 raised while its "
                               "arguments were checked, before the ranks could build their "
                               f"{what} together (that rank's error names the argument); every "
                               "rank stops")
    # Async scheduling on two ranks: one process's synchronous outputs; refused when it differs.
    assert first["async"] == first["async_alone"]
    assert [reason for _, reason in first["async"]].count("stop") >= 1
    assert "async_scheduling" in first["differ_async"], first["differ_async"]
    # Seeded and unseeded sampling, top-k/top-p and a stop token: one process's tokens.
    tokens = [(t, reason) for t, reason, _ in first["sampled"]]
    assert tokens == [(t, reason) for t, reason, _ in first["sampled_alone"]]
    assert len({tuple(t) for t, _ in tokens}) == len(tokens)
    assert tokens[4][1] == "stop" and tokens[4][0][-1] == 5 and len(tokens[4][0]) < 8
    ours, alone = first["sampled"][1][2], first["sampled_alone"][1][2]
    assert len(ours) == 8 and max(abs(a - b) for a, b in zip(ours, alone)) <= FP32_LOGITS_ATOL
    # A bad request raises on every rank; one that can never run finishes with an error; the
    # engine serves the others, and still serves after arguments rank 0 could not send.
    assert first["bad_request"] == ("ValueError: request.prompt_tokens[1]=999 is outside the "
                                    "vocabulary [0, 256) (vocab_size)")
    assert [reason for reason, _ in first["served"]] == ["error", "length", "length"]
    assert [t for _, t in first["served"][1:]] == first["served_reference"]
    assert first["unpicklable"].startswith("TypeError: the arguments of tensor-parallel rank 0 "
                                           "cannot be sent to the other ranks (TypeError: "
                                           "cannot pickle 'generator' object)")
    assert first["after_unpicklable"] == [first["after_reference"]]
    # Settings that would make the ranks' bookkeeping diverge are refused on every rank.
    assert "must build their contexts with the same enable_prefix_caching (from 0 to 1)" in \
        first["differ_caching"]
    assert "must build their engines with the same seed (from 0 to 1)" in first["differ_seed"]
    assert "must build their contexts with the same prefix_caching_eviction_policy (differs " \
        "between ranks): every rank" in first["differ_policy"]
    # Prefix caching under tensor parallelism: hits, tokens equal to transformers'.
    for name, out in first["prefix_caching"].items():
        assert out["mismatches"] == [] and out["hits"] == 5, (name, out)
    # Rank 1 had room for 6 Mamba snapshots, rank 0 for 3: both hold 3.
    assert first["prefix_caching"]["nemotron_h_lru"]["snapshots"] == 3
    assert first["prefix_caching"]["llama_ref_zero_graphs"]["replays"] > 0
