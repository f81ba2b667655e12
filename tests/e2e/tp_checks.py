"""What each rank of the 2-rank tensor-parallel test runs (``test_tensor_parallel.py`` spawns
the ranks with ``distributed_ranks.run_spawned``; this module is imported by the children).

``all_checks()`` runs, on every rank, one workload per model through
``Engine.from_transformers(..., tensor_model_parallel_size=2)`` and the context checks, and
returns plain data for the parent to assert on: every rank's generated tokens and sizes (they
must be equal), and this rank's share of the comparison with transformers (rank ``r`` checks the
requests ``i`` with ``i % world == r``, so the two ranks split the reference work).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
import torch
import torch.distributed as dist
from e2e_helpers import (
    block_bytes,
    gib_for_blocks,
    greedy_requests,
    hf_greedy,
    make_prompts,
    pressure_workload,
    step_logit_errors,
    tiny_llama,
)
from test_deepseek_mla import tiny_deepseek
from test_nemotron_h import GENS as NEMOTRON_GENS
from test_nemotron_h import LENGTHS as NEMOTRON_LENGTHS
from test_nemotron_h import block_bytes as nemotron_block_bytes
from test_nemotron_h import tiny_nemotron_h

from dynctx.context import DynamicInferenceContext, DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine
from dynctx.engine.drafters import NgramDrafter
from dynctx.models.deepseek import mla_block_bytes

TP = 2
# The pressure workload of the single-process tests (test_deepseek_mla.py's).
LENGTHS = [1, 5, 17, 40, 3, 33, 16, 48, 2, 9]
GENS = [36, 24, 36, 16, 36, 28, 36, 24, 36, 12]
# The longest request (48 + 40 tokens) in blocks of 16: the context needs no more.
MAX_SEQUENCE_LENGTH = 96


def _sizes(ctx: DynamicInferenceContext) -> tuple:
    alloc = ctx.block_allocator
    return (alloc.total_count, alloc.paused_count, alloc.active_count, ctx.max_requests,
            ctx.max_tokens)


def _run(hf: Any, engine: Engine, prompts: List[List[int]], requests: list,
         arrivals: List[int]) -> Dict[str, Any]:
    """Run the workload (rank 0's requests: the others pass None) and check this rank's share
    of the requests against transformers (greedy tokens; every step's logits)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = engine.generate_requests(requests if rank == 0 else None,
                                       arrival_steps=arrivals if rank == 0 else None)
    mine = [i for i in range(len(results)) if i % world == rank]
    mismatches = [i for i in mine if results[i].generated_tokens != hf_greedy(
        hf, prompts[i], len(results[i].generated_tokens))]
    errors = step_logit_errors(hf, [results[i] for i in mine])
    worst = max(float((ours.cpu() - theirs).abs().max()) for _, _, ours, theirs in errors)
    stats = engine.stats
    return dict(tokens=[r.generated_tokens for r in results],
                finish=[r.finish_reason for r in results], sizes=_sizes(engine.context),
                pressure=(stats.pauses, stats.evictions, stats.chunked_prefills),
                checked=len(mine), mismatches=mismatches, worst_logit_error=worst,
                steps_checked=len(errors), local_heads=_local_heads(engine.model),
                kv_shape=tuple(engine.context.memory_buffer.shape))


def _local_heads(model: Any) -> dict:
    return {name: getattr(model, name) for name in ("num_q_heads", "num_kv_heads", "num_heads",
                                                    "mamba_heads", "n_groups")
            if hasattr(model, name)}


def _engine(hf: Any, per_rank_block_bytes: Callable[[Any, int], float], *, block_size: int,
            blocks: int, paused_blocks: int, max_tokens: int, **kwargs: Any) -> Engine:
    """An engine of ``blocks`` (``paused_blocks``) blocks per rank."""
    return Engine.from_transformers(
        hf, block_size_tokens=block_size, max_tokens=max_tokens, kernel_backend="torch",
        buffer_size_gb=gib_for_blocks(hf, block_size, blocks, per_rank_block_bytes),
        paused_buffer_size_gb=gib_for_blocks(hf, block_size, paused_blocks,
                                             per_rank_block_bytes),
        **dict(dict(record_logits=True), **kwargs), tensor_model_parallel_size=TP,
        max_sequence_length=MAX_SEQUENCE_LENGTH)


def llama_pressure() -> Dict[str, Any]:
    """2 KV heads, one per rank; 14 blocks of 16 (3 paused): pauses, evictions, chunks."""
    hf = tiny_llama()
    case = dict(scale=1)
    prompts, requests, arrivals = pressure_workload(hf, case, LENGTHS, GENS)
    engine = _engine(hf, lambda hf, bs: block_bytes(hf, bs) / TP, block_size=16, blocks=14,
                     paused_blocks=3, max_tokens=32)
    return _run(hf, engine, prompts, requests, arrivals)


def llama_replicated_kv() -> Dict[str, Any]:
    """One KV head for two ranks: each rank holds it (replicated), and half the query heads."""
    hf = tiny_llama(kv_heads=1, seed=3)
    prompts = make_prompts([7, 20, 3], hf.config.vocab_size, seed=5)
    requests = greedy_requests(prompts, [8, 8, 8])
    engine = _engine(hf, block_bytes, block_size=16, blocks=12, paused_blocks=2, max_tokens=64,
                     rope="cos_sin")
    return _run(hf, engine, prompts, requests, [0, 0, 1])


def deepseek_pressure() -> Dict[str, Any]:
    """MLA (the latent replicated: per-rank blocks as large as one process's) with a MoE
    layer; 14 blocks of 16 (3 paused)."""
    hf = tiny_deepseek()
    prompts, requests, arrivals = pressure_workload(hf, dict(scale=1), LENGTHS, GENS)
    engine = _engine(hf, lambda hf, bs: mla_block_bytes(hf.config, bs), block_size=16,
                     blocks=14, paused_blocks=3, max_tokens=32)
    return _run(hf, engine, prompts, requests, arrivals)


def nemotron_h_pressure() -> Dict[str, Any]:
    """Mamba heads and groups, attention heads and MLP channels split in two; 12 blocks of 16
    (2 paused), test_nemotron_h.py's workload."""
    hf = tiny_nemotron_h()
    prompts = make_prompts(NEMOTRON_LENGTHS, hf.config.vocab_size)
    requests = greedy_requests(prompts, NEMOTRON_GENS)
    engine = _engine(hf, lambda hf, bs: nemotron_block_bytes(hf, bs) / TP, block_size=16,
                     blocks=12, paused_blocks=2, max_tokens=32, attention_backend="torch")
    out = _run(hf, engine, prompts, requests, [i // 2 for i in range(len(prompts))])
    ctx = engine.context
    out["mamba_shapes"] = (tuple(ctx.mamba_conv_states_shape), tuple(ctx.mamba_ssm_states_shape))
    return out


def llama_speculative() -> Dict[str, Any]:
    """Speculative decoding on two ranks (k = 3, n-gram drafts on prompts that repeat): every
    rank drafts alike from the same tokens, verifies the same logits, rewinds alike; under
    pressure, every gained token's logits recorded and checked."""
    hf = tiny_llama()
    prompts = [([3, 4, 5, 6, 7] * 10)[:n] for n in LENGTHS[:8]]
    requests = greedy_requests(prompts, GENS[:8])
    engine = _engine(hf, lambda hf, bs: block_bytes(hf, bs) / TP, block_size=16, blocks=14,
                     paused_blocks=3, max_tokens=32, num_speculative_tokens=3,
                     drafter=NgramDrafter(min_ngram=1))
    out = _run(hf, engine, prompts, requests, [i // 2 for i in range(len(prompts))])
    out["speculative"] = engine.stats.speculative
    return out


def llama_speculative_async() -> Dict[str, Any]:
    """The same under async scheduling (rewinds deferred and settled alike on both ranks)."""
    hf = tiny_llama()
    prompts = [([3, 4, 5, 6, 7] * 10)[:n] for n in LENGTHS[:8]]
    requests = greedy_requests(prompts, GENS[:8])
    engine = _engine(hf, lambda hf, bs: block_bytes(hf, bs) / TP, block_size=16, blocks=14,
                     paused_blocks=3, max_tokens=32, num_speculative_tokens=3,
                     drafter=NgramDrafter(min_ngram=1), async_scheduling=True,
                     record_logits=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = engine.generate_requests(requests if rank == 0 else None,
                                       arrival_steps=[i // 2 for i in range(len(prompts))]
                                       if rank == 0 else None)
    mine = [i for i in range(len(results)) if i % world == rank]
    stats = engine.stats
    return dict(tokens=[r.generated_tokens for r in results],
                finish=[r.finish_reason for r in results], sizes=_sizes(engine.context),
                pressure=(stats.pauses, stats.evictions, stats.chunked_prefills),
                checked=len(mine), speculative=stats.speculative,
                mismatches=[i for i in mine if results[i].generated_tokens != hf_greedy(
                    hf, prompts[i], len(results[i].generated_tokens))])


def nemotron_h_replicated_kv() -> Dict[str, Any]:
    """NemotronH attention with one KV head for two ranks (replicated on both)."""
    hf = tiny_nemotron_h(kv_heads=1, seed=2)
    prompts = make_prompts([7, 20, 3, 30], hf.config.vocab_size, seed=6)
    requests = greedy_requests(prompts, [8, 8, 8, 8])
    engine = _engine(hf, nemotron_block_bytes, block_size=16, blocks=12, paused_blocks=2,
                     max_tokens=32, attention_backend="torch")
    return _run(hf, engine, prompts, requests, [0, 0, 1, 2])


def sizing() -> Dict[str, Any]:
    """Contexts whose ranks are given different memory budgets (tensor parallelism) or hold
    different layers (pipeline stages of a hybrid): MIN over the group makes their allocators
    equal; different explicit sizes are refused on every rank; a context step makes no
    collective call."""
    rank = dist.get_rank()
    block = 4 * 2 * 2 * 4 * 1 * 8            # fp32, K+V, 2 layers, 4 tokens, 1 head per rank, 8
    gib = 1024 ** 3

    def make(**overrides: Any) -> DynamicInferenceContext:
        args = dict(params_dtype=torch.float32, num_layers=2, kv_channels=8,
                    num_attention_heads=2, max_sequence_length=64, block_size_tokens=4,
                    buffer_size_gb=(40 if rank == 0 else 30) * block / gib,
                    paused_buffer_size_gb=(8 if rank == 0 else 5) * block / gib,
                    max_tokens=64, max_requests=8, unified_memory_level=0, device="cpu")
        args.update(overrides)
        return DynamicInferenceContext(**args)

    alone = make(num_attention_heads=1)           # tp 1 (same block bytes): its own budget
    shared = make(tensor_model_parallel_size=TP)         # the default group of 2 ranks
    try:
        make(tensor_model_parallel_size=TP, max_requests=8 if rank == 0 else 16)
        refused = None
    except ValueError as error:
        refused = str(error)

    # Two pipeline stages with uneven hybrid layers (stage 0: 3 attention + 2 Mamba layers,
    # stage 1: 1 + 1): each stage's layer map is local; both take the smaller block count.
    from types import SimpleNamespace

    from dynctx.context import MambaInferenceStateConfig

    types = ["*", "M", "*", "M", "*"] if rank == 0 else ["M", "*"]
    stage_args = dict(num_layers=len(types), max_requests=8, paused_buffer_size_gb=None,
                      buffer_size_gb=100 * block / gib,
                      mamba_inference_state_config=MambaInferenceStateConfig(
                          types, (6, 4), (2, 4, 3)))
    stage_alone = make(num_attention_heads=1, **stage_args)
    stage = make(num_attention_heads=1, pipeline_model_parallel_size=2,
                 pg_collection=SimpleNamespace(pp=dist.group.WORLD), **stage_args)
    pipeline = dict(alone=_sizes(stage_alone), shared=_sizes(stage),
                    layer_map=dict(stage.layer_map), attention_layers=stage.num_attention_layers,
                    mamba_layers=stage.num_mamba_layers)

    try:
        Engine.from_transformers(tiny_llama(), buffer_size_gb=0.001,
                                 pipeline_model_parallel_size=2,
                                 pg_collection=SimpleNamespace(pp=dist.group.WORLD))
        engine_pp_refused = None
    except NotImplementedError as error:
        engine_pp_refused = str(error)

    # A few context steps with every torch.distributed collective counted.
    calls = []
    names = ("all_reduce", "broadcast", "all_gather", "barrier", "broadcast_object_list",
             "all_gather_object", "reduce", "send", "recv")
    saved = {name: getattr(dist, name) for name in names}
    for name in names:
        setattr(dist, name, lambda *a, _n=name, **k: calls.append(_n) or saved[_n](*a, **k))
    try:
        for rid, length in enumerate((3, 9, 17)):
            shared.add_request(DynamicInferenceRequest(
                request_id=rid, prompt_tokens=torch.arange(1, length + 1),
                sampling_params=SamplingParams(num_tokens_to_generate=4)))
        steps = 0
        while shared.has_unfinished_requests():
            shared.initialize_attention_state()
            active = shared.total_request_count - shared.paused_request_count
            mask = shared.get_active_sequence_lengths() + 1 < shared.get_max_sequence_lengths()
            shared.update_requests(mask, torch.ones(active, dtype=torch.int64))
            steps += 1
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return dict(alone=_sizes(alone), shared=_sizes(shared), refused=refused, steps=steps,
                pipeline=pipeline, engine_pp_refused=engine_pp_refused,
                collectives_in_steps=calls, heads=shared.num_attention_heads_per_partition,
                group=shared.tensor_parallel_group is not None)


def _guard(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the ``"Type: message"`` of what it raised."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - compared on every rank by the parent
        return f"{type(error).__name__}: {error}"


def _sampled_requests(prompts: List[List[int]]) -> list:
    """Temperature, top-k and top-p, with and without per-request seeds; request 4 draws its
    stop token (5) as its fifth token."""
    out = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(num_tokens_to_generate=8, temperature=0.8,
                                top_k=20 if i % 2 else 0, top_p=0.9 if i % 3 else 0.0,
                                seed=None if i % 4 == 0 else 100 + i, return_log_probs=i == 1,
                                termination_id=5 if i == 4 else None)
        out.append(DynamicInferenceRequest(request_id=i, prompt_tokens=torch.tensor(prompt),
                                           sampling_params=params))
    return out


def lockstep() -> Dict[str, Any]:
    """Adversarial lockstep checks (the parent asserts every rank returned the same):

    * sampling (seeded and unseeded draws, top-k/top-p, a stop token, arrival steps) equals a
      one-process engine's, token for token;
    * a bad request is refused on every rank and the engine serves the next ones; arguments
      rank 0 cannot send (a generator) raise on every rank instead of hanging the broadcast;
    * prefix caching (LRU) on the hybrid, the ranks given different Mamba snapshot budgets
      (MIN over the group), and ref_zero caching on the Llama with the CUDA-graph stand-in:
      greedy tokens equal to transformers';
    * settings that differ between ranks (prefix caching, the engine's seed) are refused on
      every rank alike; a rank whose own arguments are bad (or fail after the agreement)
      raises, and so do the others (naming it) instead of waiting for it."""
    rank = dist.get_rank()
    first = rank == 0
    hf = tiny_llama()
    common = dict(block_size_tokens=16, max_tokens=64, kernel_backend="torch",
                  max_sequence_length=128)
    gib = gib_for_blocks(hf, 16, 20)
    prompts = make_prompts([3, 9, 20, 33, 5, 17], hf.config.vocab_size)
    arrivals = [0, 1, 1, 2, 3, 3]
    engine = Engine.from_transformers(hf, buffer_size_gb=gib / TP, seed=7,
                                      tensor_model_parallel_size=TP, **common)
    results = engine.generate_requests(_sampled_requests(prompts) if first else None,
                                       arrival_steps=arrivals if first else None)
    alone = Engine.from_transformers(hf, buffer_size_gb=gib, seed=7, **common).generate_requests(
        _sampled_requests(prompts), arrival_steps=arrivals)
    out: Dict[str, Any] = dict(
        sampled=[(r.generated_tokens, r.finish_reason, r.generated_log_probs) for r in results],
        sampled_alone=[(r.generated_tokens, r.finish_reason, r.generated_log_probs)
                       for r in alone])

    bad = DynamicInferenceRequest(request_id=50, prompt_tokens=torch.tensor([1, 999]),
                                  sampling_params=SamplingParams(num_tokens_to_generate=3))
    out["bad_request"] = _guard(lambda: engine.add_request(bad if first else None))
    too_long = DynamicInferenceRequest(request_id=51, prompt_tokens=torch.arange(1, 120),
                                       sampling_params=SamplingParams(num_tokens_to_generate=30))
    good = greedy_requests(make_prompts([4, 7], hf.config.vocab_size, seed=2), [5, 5])
    good[0].request_id, good[1].request_id = 52, 53
    served = engine.generate_requests([too_long] + good if first else None)
    out["served"] = [(r.finish_reason, r.generated_tokens) for r in served]
    out["served_reference"] = [hf_greedy(hf, r.prompt_tokens, 5) for r in served[1:]]
    out["unpicklable"] = _guard(lambda: engine.generate(
        (p for p in [[1, 2, 3]]) if first else None, max_new_tokens=3))
    out["after_unpicklable"] = engine.generate([[1, 2, 3]] if first else None, max_new_tokens=3)
    out["after_reference"] = hf_greedy(hf, [1, 2, 3], 3)

    out["differ_caching"] = _guard(lambda: Engine.from_transformers(
        hf, buffer_size_gb=gib / TP, tensor_model_parallel_size=TP, enable_prefix_caching=first,
        **common))
    out["differ_seed"] = _guard(lambda: Engine.from_transformers(
        hf, buffer_size_gb=gib / TP, tensor_model_parallel_size=TP, seed=rank, **common))
    # A rank whose own arguments are bad raises its error; the others raise too, naming it,
    # instead of waiting for it in the agreement (the context's, then the engine's).
    out["bad_on_one_rank"] = _guard(lambda: DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
        max_sequence_length=64, buffer_size_gb=0.001 if first else -1.0, max_tokens=64,
        device="cpu", tensor_model_parallel_size=TP))
    # A policy (a string: compared by digest) that differs, refused in the agreement; rank 1's
    # num_cuda_graphs=True agrees with rank 0's 1 (an integer as itself) but fails the graph
    # ladder's check after the agreement: rank 0 raises too (the check-out).
    out["differ_policy"] = _guard(lambda: DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
        max_sequence_length=64, buffer_size_gb=0.001, max_tokens=64, device="cpu",
        tensor_model_parallel_size=TP, enable_prefix_caching=True,
        prefix_caching_eviction_policy="lru" if first else "ref_zero",
        num_cuda_graphs=4 if first else np.int64(4)))
    out["fails_after_agreement"] = _guard(lambda: DynamicInferenceContext(
        params_dtype=torch.float32, num_layers=2, kv_channels=8, num_attention_heads=2,
        max_sequence_length=64, buffer_size_gb=0.001, max_tokens=64, device="cpu",
        tensor_model_parallel_size=TP, num_cuda_graphs=1 if first else True).max_requests)
    out["bad_engine_on_one_rank"] = _guard(lambda: Engine.from_transformers(
        hf, buffer_size_gb=gib / TP, tensor_model_parallel_size=TP, seed=0 if first else -1,
        **common))
    for case in ("differ_caching", "differ_seed", "differ_policy", "bad_on_one_rank",
                 "bad_engine_on_one_rank", "fails_after_agreement"):
        out[case] = out[case] if isinstance(out[case], str) else "built"
    out["prefix_caching"] = {name: _prefix_cached(name) for name in ("nemotron_h_lru",
                                                                     "llama_ref_zero_graphs")}
    # Async scheduling on two ranks (greedy, request 2 stopping at its fourth token): one
    # process's synchronous outputs; a setting that differs between ranks is refused.
    stopping = greedy_requests(prompts, [8] * len(prompts))
    stopping[2].sampling_params.termination_id = hf_greedy(hf, prompts[2], 8)[3]
    outputs = {}
    for mode, ranks in (("async", TP), ("async_alone", 1)):
        tp_kwargs = dict(tensor_model_parallel_size=TP) if ranks > 1 else {}
        engine = Engine.from_transformers(hf, buffer_size_gb=gib / ranks, seed=7,
                                          async_scheduling=mode == "async", **tp_kwargs,
                                          **common)
        requests = stopping if first or ranks == 1 else None
        outputs[mode] = [(r.generated_tokens, r.finish_reason) for r in engine.generate_requests(
            requests, arrival_steps=arrivals if first or ranks == 1 else None)]
    out.update(outputs)
    out["differ_async"] = _guard(lambda: Engine.from_transformers(
        hf, buffer_size_gb=gib / TP, tensor_model_parallel_size=TP, async_scheduling=first,
        **common))
    out["differ_async"] = out["differ_async"] if isinstance(out["differ_async"], str) \
        else "built"
    return out


def _prefix_cached(name: str) -> Dict[str, Any]:
    """Requests sharing a 32-token prefix through a prefix-caching engine on two ranks."""
    rank = dist.get_rank()
    if name == "nemotron_h_lru":
        hf = tiny_nemotron_h()
        # Rank 1 is given room for twice the Mamba snapshots: the group takes rank 0's count.
        c = hf.config
        kv = 4 * 2 * c.layers_block_type.count("full_attention") * 16 * c.num_key_value_heads \
            * c.head_dim
        snapshot = nemotron_block_bytes(hf, 16) - kv          # one request's Mamba state, fp32
        kwargs = dict(attention_backend="torch", prefix_caching_eviction_policy="lru",
                      prefix_caching_mamba_gb=(3 + 3 * rank) * snapshot / TP / 1024 ** 3,
                      buffer_size_gb=gib_for_blocks(hf, 16, 16, nemotron_block_bytes) / TP,
                      cuda_graphs=False)
    else:
        hf = tiny_llama()
        kwargs = dict(buffer_size_gb=gib_for_blocks(hf, 16, 16) / TP, num_cuda_graphs=4,
                      cuda_graphs=True)
    vocab = hf.config.vocab_size
    shared = make_prompts([32], vocab, seed=9)[0]
    prompts = [shared + p for p in make_prompts([3, 5, 17, 1, 9, 20], vocab, seed=4)]
    engine = Engine.from_transformers(
        hf, block_size_tokens=16, max_tokens=32, kernel_backend="torch",
        tensor_model_parallel_size=TP, max_sequence_length=96, enable_prefix_caching=True,
        **kwargs)
    results = engine.generate_requests(
        greedy_requests(prompts, [6] * len(prompts)) if rank == 0 else None,
        arrival_steps=[0, 0, 2, 3, 4, 8] if rank == 0 else None)
    mine = [i for i in range(len(results)) if i % TP == rank]
    mamba = engine.context.prefix_cache.mamba
    return dict(tokens=[r.generated_tokens for r in results],
                mismatches=[i for i in mine if results[i].generated_tokens
                            != hf_greedy(hf, prompts[i], 6)],
                hits=engine.stats.prefix_cache["prefix_cache_hits"],
                snapshots=None if mamba is None else mamba.count,
                replays=engine.graph_replays)


def all_checks() -> Dict[str, Any]:
    """Every check above, in one spawn (the ranks pay for importing torch and transformers
    once)."""
    return {name: fn() for name, fn in (
        ("sizing", sizing), ("llama", llama_pressure), ("llama_replicated_kv", llama_replicated_kv),
        ("deepseek", deepseek_pressure), ("nemotron_h", nemotron_h_pressure),
        ("nemotron_h_replicated_kv", nemotron_h_replicated_kv),
        ("llama_speculative", llama_speculative),
        ("llama_speculative_async", llama_speculative_async), ("lockstep", lockstep))}
