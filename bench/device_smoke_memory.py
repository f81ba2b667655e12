"""The smoke checks of the memory paths (bench/device_smoke.py's docstring says what each
proves): the host block pool's copies, KV offload with the prefix cache's host tier (a Llama;
a NemotronH's Mamba states and snapshots), KV groups (Gemma 3, every layer windowed) and the
FP8 KV cache. Each takes the ``Env`` and returns ``(summary line, details)`` or raises, as the
checks of ``device_smoke_checks.py`` do; public APIs only, and the host pool itself
(``dynctx.context.host_pool``), which the offload paths copy through.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, List

import numpy as np
import torch
from device_smoke_checks import (
    ATTENTION_CASES,
    CheckFailed,
    Env,
    attention_case,
    attention_reference,
    hf_greedy,
    runner_name,
    tiny_llama,
)

from dynctx.context import DynamicInferenceRequest, SamplingParams
from dynctx.engine import Engine
from dynctx.kernels import paged_attention

GIB = 1024 ** 3


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` on the host (FP8 included)."""
    return tensor.detach().contiguous().view(torch.uint8).cpu()


def _greedy(prompts, gens) -> List[DynamicInferenceRequest]:
    return [DynamicInferenceRequest(
        request_id=i, prompt_tokens=list(p),
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=g,
                                       termination_id=None))
        for i, (p, g) in enumerate(zip(prompts, gens))]


def _random_prompts(lengths, vocab: int, seed: int) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _busy_callback(env: Env, ms: float) -> Callable:
    """A step callback that queues ``ms`` of device work after every step (CUDA), so the next
    step's uploads and copies are enqueued while the device is still busy."""
    return lambda result: env.busy(ms)


def _engine(hf, env: Env, *, block_bytes: int, blocks: int, paused_blocks: int, block_size: int,
            max_tokens: int, **kwargs) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the sizing warning of small buffers
        return Engine.from_transformers(
            hf, device=env.device, block_size_tokens=block_size,
            buffer_size_gb=blocks * block_bytes / GIB,
            paused_buffer_size_gb=paused_blocks * block_bytes / GIB, max_tokens=max_tokens,
            **kwargs)


def _outputs(results) -> Dict[int, List[int]]:
    return {r.request_id: list(r.generated_tokens) for r in results}


# ------------------------------------------------------------------------------ host pool
#: (device buffer shape, block dimension): a K/V buffer ``[2, layers, blocks, bs, H, D]`` and
#: an MLA latent buffer ``[layers, blocks, bs, rank + rope]``.
POOL_LAYOUTS = {"kv": ((2, 3, 12, 16, 2, 64), 2), "mla": ((3, 12, 16, 96), 1)}
#: Blocks saved (a run of host slots broken in two) and where they are loaded back.
SAVED_BLOCKS, LOADED_BLOCKS = np.array([7, 0, 3, 4, 11]), np.array([1, 2, 9, 10, 5])
#: A hybrid's Mamba states: conv ``[layers, slots, dim, kernel]`` bf16, SSM fp32.
CONV_SHAPE, SSM_SHAPE = (2, 6, 40, 4), (2, 6, 4, 8, 8)


def _pool_round_trip(env: Env, pool_class, dtype, shape, block_dim, gen) -> dict:
    """Blocks written behind a busy kernel, saved to host slots, the device buffer cleared,
    loaded back into other blocks behind another busy kernel, and read at once on the current
    stream: the host copy and the blocks read back must be the written bytes."""
    first = torch.randn(shape, generator=gen).to(dtype)
    second = torch.randn(shape, generator=gen).to(dtype)
    block_shape = tuple(n for i, n in enumerate(shape) if i != block_dim)
    pool = pool_class(blocks=8, block_shape=block_shape, block_dim=block_dim, dtype=dtype,
                      device=env.device)
    pool.allocate()
    slots = np.concatenate([pool.take(2, 0)[0], pool.take(3, 0)[0]])
    buffer = first.to(env.device)
    written = second.to(env.device)
    env.sync()
    env.busy(20)
    buffer.copy_(written)   # queued behind the busy kernel: the save must copy these bytes
    pool.save(buffer, SAVED_BLOCKS, slots)
    host_waited = None
    if env.cuda:
        event = torch.cuda.Event()
        event.record(pool.copier.stream)
        host_waited = bool(event.query())   # False: the copies were still queued
    buffer.view(torch.uint8).zero_()   # ordered after the save's gather
    env.busy(20)
    pool.load(buffer, slots, LOADED_BLOCKS)
    after = buffer.clone()   # a read on the current stream right after the load
    env.sync()
    host_same = all(torch.equal(_bytes(pool.kv[int(slot)]),
                                _bytes(second.select(block_dim, int(block))))
                    for slot, block in zip(slots, SAVED_BLOCKS))
    device_same = all(torch.equal(_bytes(after.select(block_dim, int(dst))),
                                  _bytes(second.select(block_dim, int(src))))
                      for src, dst in zip(SAVED_BLOCKS, LOADED_BLOCKS))
    others = [b for b in range(shape[block_dim]) if b not in LOADED_BLOCKS]
    others_zero = all(not _bytes(after.select(block_dim, b)).any() for b in others)
    pool.give(slots, np.empty(0, dtype=np.int64))
    pool.check(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    return dict(host_copy_equal=host_same, loaded_blocks_equal=device_same,
                other_blocks_untouched=others_zero, pinned=bool(pool.kv.is_pinned()),
                side_stream=pool.copier.stream is not None, host_waited_for_copy=host_waited,
                bytes_each_way=int(SAVED_BLOCKS.size * pool.block_bytes(block_shape, dtype)))


def _pool_states(env: Env, pool_class, gen) -> dict:
    """A hybrid's Mamba states (bf16 conv, fp32 SSM) saved from two slots and loaded into two
    others, written and read around busy kernels as the blocks are."""
    conv = torch.randn(CONV_SHAPE, generator=gen).to(torch.bfloat16)
    ssm = torch.randn(SSM_SHAPE, generator=gen)
    shapes = [(CONV_SHAPE[0], *CONV_SHAPE[2:]), (SSM_SHAPE[0], *SSM_SHAPE[2:])]
    pool = pool_class(blocks=1, block_shape=(4, 4), block_dim=0, dtype=torch.float32,
                      device=env.device, states=4, state_shapes=shapes,
                      state_dtypes=[torch.bfloat16, torch.float32])
    pool.allocate()
    _, host = pool.take(0, 2)
    states = (torch.zeros_like(conv, device=env.device), torch.zeros_like(ssm, device=env.device))
    written = (conv.to(env.device), ssm.to(env.device))
    kv = torch.zeros(4, 4, 4, device=env.device)
    env.sync()
    env.busy(20)
    for state, values in zip(states, written):
        state.copy_(values)   # queued behind the busy kernel, as the blocks are
    empty = np.empty(0, dtype=np.int64)
    pool.save(kv, empty, empty, states=states, device_slots=np.array([4, 1]), host_states=host)
    for state in states:
        state.zero_()
    env.busy(20)
    pool.load(kv, empty, empty, states=states, host_states=host[::-1].copy(),
              device_slots=np.array([0, 5]))
    after = [state.clone() for state in states]
    env.sync()
    same = all(torch.equal(_bytes(got[:, dst]), _bytes(want[:, src]))
               for got, want in zip(after, (conv, ssm)) for src, dst in ((1, 0), (4, 5)))
    return dict(states_equal=same, pinned=bool(pool.mamba[0].is_pinned()))


def check_host_pool_copies(env: Env):
    from dynctx.context.host_pool import HostBlockPool

    gen = torch.Generator().manual_seed(11)
    details, problems = {}, []
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        for layout, (shape, block_dim) in POOL_LAYOUTS.items():
            name = f"{str(dtype).replace('torch.', '')}_{layout}"
            got = details[name] = _pool_round_trip(env, HostBlockPool, dtype, shape, block_dim,
                                                   gen)
            for key in ("host_copy_equal", "loaded_blocks_equal", "other_blocks_untouched"):
                if not got[key]:
                    problems.append(f"{name}: {key.replace('_', ' ')} is False")
            if env.cuda and not (got["pinned"] and got["side_stream"]):
                problems.append(f"{name}: the pool is not pinned or has no side stream")
    details["mamba_states"] = _pool_states(env, HostBlockPool, gen)
    if not details["mamba_states"]["states_equal"]:
        problems.append("mamba states: the states loaded back differ from those saved")
    if problems:
        raise CheckFailed("; ".join(problems), details)
    waited = [d["host_waited_for_copy"] for d in details.values() if "host_waited_for_copy" in d]
    where = (f"pinned, side stream; the copy still queued when save returned in "
             f"{waited.count(False)} of {len(waited)}" if env.cuda else "synchronous on a CPU")
    return (f"blocks (fp32/bf16/fp8, K/V and MLA layouts) and Mamba states saved behind a busy "
            f"kernel and loaded back: byte-equal ({where})"), details


# ------------------------------------------------------------------------------ offload
def _prefix_workload(vocab: int):
    """Ten prompts: one of two 48-token prefixes (alternating) + a suffix of 2..20 tokens; in
    12 blocks of 16 they pause, get evicted and chunk, and push each other's prefix out."""
    first, second = _random_prompts([48, 48], vocab, seed=31)
    suffixes = _random_prompts([9, 5, 20, 3, 14, 6, 17, 2, 11, 7], vocab, seed=32)
    prompts = [(first if i % 2 == 0 else second) + s for i, s in enumerate(suffixes)]
    gens = [24, 20, 24, 16, 24, 22, 20, 24, 18, 24]
    arrivals = [0, 0, 2, 3, 5, 6, 8, 9, 11, 12]
    return prompts, gens, arrivals


def _llama_block_bytes(hf, block_size: int) -> int:
    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 4 * 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * head_dim


OFFLOAD_SIZES = dict(blocks=12, paused_blocks=2, block_size=16, max_tokens=32)
HOST_BLOCKS = 16


def _offload_run(engine, prompts, gens, arrivals) -> tuple:
    results = engine.generate_requests(_greedy(prompts, gens), arrival_steps=arrivals)
    ctx = engine.context
    offload = getattr(ctx._parts, "offload", None)
    if offload is not None:
        offload.check()   # every host slot free or owned exactly once
    stats = dict(ctx.get_kv_offload_stats(), evictions=engine.stats.evictions,
                 pauses=engine.stats.pauses, chunked_prefills=engine.stats.chunked_prefills)
    if offload is not None:
        stats["host_pool_pinned"] = bool(offload.pool.kv.is_pinned())
    return _outputs(results), stats


def _offload_verdict(name: str, outputs: dict, reference: dict, hf_tokens: dict,
                     stats: dict, needed: tuple, problems: list) -> None:
    if outputs != reference:
        problems.append(f"{name}: tokens differ from the engine without offload")
    if outputs != hf_tokens:
        problems.append(f"{name}: tokens differ from transformers' greedy generate")
    for key in needed:
        if not stats.get(key):
            problems.append(f"{name}: {key} is {stats.get(key)} (the path did not run)")


def check_kv_offload(env: Env):
    hf = tiny_llama(env, seed=5)
    prompts, gens, arrivals = _prefix_workload(hf.config.vocab_size)
    hf_tokens = {i: hf_greedy(hf, p, g) for i, (p, g) in enumerate(zip(prompts, gens))}
    block_bytes = _llama_block_bytes(hf, OFFLOAD_SIZES["block_size"])
    sizes = dict(OFFLOAD_SIZES, block_bytes=block_bytes)
    reference, plain = _offload_run(_engine(hf, env, **sizes), prompts, gens, arrivals)
    engine = _engine(hf, env, **sizes, enable_prefix_caching=True,
                     prefix_caching_eviction_policy="lru",
                     kv_offload_gb=HOST_BLOCKS * block_bytes / GIB,
                     step_callback=_busy_callback(env, 2))
    outputs, stats = _offload_run(engine, prompts, gens, arrivals)
    details = dict(without_offload=plain, offload_and_host_tier=stats)
    problems: List[str] = []
    _offload_verdict("llama", outputs, reference, hf_tokens, stats,
                     ("evictions", "kv_offload_restored_requests",
                      "kv_offload_prefix_spilled_blocks", "kv_offload_prefix_restored_blocks"),
                     problems)
    if env.cuda and not stats.get("host_pool_pinned"):
        problems.append("the host pool is not pinned on CUDA")
    if problems:
        raise CheckFailed("; ".join(problems), details)
    return (f"Llama under pressure, 2 ms busy kernel after each step: {stats['evictions']} "
            f"evictions swapped ({stats['kv_offload_restored_tokens']} tokens restored), "
            f"{stats['kv_offload_prefix_spilled_blocks']} prefix blocks spilled, "
            f"{stats['kv_offload_prefix_restored_blocks']} restored; tokens = without offload "
            "= transformers"), details


def tiny_nemotron_h(env: Env, seed: int = 3):
    """A NemotronH of pattern ``M*-M`` (two Mamba layers, one attention, one MLP), fp32."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(
        vocab_size=128, hidden_size=64, hybrid_override_pattern="M*-M", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=4,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16,
        max_position_embeddings=256)
    model = NemotronHForCausalLM(config).eval().to(device=env.device, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _mamba_state_bytes(hf) -> int:
    c = hf.config
    conv_dim = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
    ssm = c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size
    return 4 * c.layers_block_type.count("linear_attention") * (conv_dim * c.conv_kernel + ssm)


def _hybrid_block_bytes(hf, block_size: int) -> int:
    """KV bytes of one block plus one request's Mamba state (the context budgets both)."""
    c = hf.config
    kv = 4 * 2 * c.layers_block_type.count("full_attention") * block_size \
        * c.num_key_value_heads * c.head_dim
    return kv + _mamba_state_bytes(hf)


def check_mamba_offload(env: Env):
    hf = tiny_nemotron_h(env)
    prompts, gens, arrivals = _prefix_workload(hf.config.vocab_size)
    hf_tokens = {i: hf_greedy(hf, p, g) for i, (p, g) in enumerate(zip(prompts, gens))}
    block_bytes = _hybrid_block_bytes(hf, OFFLOAD_SIZES["block_size"])
    sizes = dict(OFFLOAD_SIZES, block_bytes=block_bytes)
    common = dict(enable_prefix_caching=True, prefix_caching_eviction_policy="lru",
                  prefix_caching_mamba_gb=_mamba_state_bytes(hf) / GIB)
    reference, plain = _offload_run(_engine(hf, env, **sizes, **common), prompts, gens,
                                    arrivals)
    engine = _engine(hf, env, **sizes, **common, kv_offload_gb=HOST_BLOCKS * block_bytes / GIB,
                     prefix_caching_host_tier=True, step_callback=_busy_callback(env, 2))
    outputs, stats = _offload_run(engine, prompts, gens, arrivals)
    stats["host_state_slots"] = int(engine.context._parts.offload.pool.states.count)
    details = dict(without_offload=plain, offload_and_host_tier=stats,
                   snapshot_budget=int(engine.context.prefix_cache.mamba.count))
    problems: List[str] = []
    _offload_verdict("nemotron_h", outputs, reference, hf_tokens, stats,
                     ("kv_offload_restored_requests", "kv_offload_prefix_spilled_snapshots",
                      "kv_offload_prefix_restored_snapshots",
                      "kv_offload_prefix_restored_blocks"), problems)
    if problems:
        raise CheckFailed("; ".join(problems), details)
    return (f"NemotronH under pressure: {stats['kv_offload_restored_requests']} requests "
            f"swapped with their Mamba state, {stats['kv_offload_prefix_spilled_snapshots']} "
            f"snapshots spilled, {stats['kv_offload_prefix_restored_snapshots']} restored; "
            "tokens = without offload = transformers"), details


# ------------------------------------------------------------------------------ KV groups
GROUP_LENGTHS = [1, 5, 17, 40, 3, 33, 16, 36]
GROUP_GENS = [24, 16, 24, 12, 24, 20, 16, 12]
GROUP_SIZES = dict(block_size=8, blocks=10, paused_blocks=2, max_tokens=16, max_requests=8)
WINDOW = 6
GEMMA3_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def _windowed_model(env: Env, family: str):
    from dynctx.models.random_models import random_causal_lm

    extra = dict(layers=6, layer_types=GEMMA3_TYPES) if family == "gemma3" else {}
    model = random_causal_lm(family, vocab=128, hidden=32, heads=4, kv_heads=2, intermediate=64,
                             max_positions=256, window=WINDOW, initializer_range=0.1, **extra)
    model = model.to(device=env.device, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class HeldSpy:
    """A step callback: the fewest blocks a windowed group held, against group 0's, over the
    steps (a windowed group holding fewer is a window's blocks released), with a busy kernel
    queued after every step (CUDA) so that each step's map upload waits behind it."""

    def __init__(self, env: Env, engine: Engine):
        self.env, self.ctx = env, engine.context
        self.steps = self.fewer = 0
        self.max_held: List[int] = []

    def __call__(self, result) -> None:
        usage = self.ctx.kv_group_usage()
        held = usage["held"]
        self.max_held = [max(a, b) for a, b in zip(self.max_held, held)] or list(held)
        self.steps += 1
        self.fewer += any(h < held[0] for h in held[1:])
        self.env.busy(2)


def _group_run(env: Env, hf, prompts, *, kv_groups: bool, graphs: bool) -> tuple:
    from dynctx.models.random_models import kv_block_bytes

    sizes = dict(GROUP_SIZES)
    sizes["block_bytes"] = kv_block_bytes(hf, sizes["block_size"])
    engine = _engine(hf, env, **sizes, kv_groups=kv_groups,
                     **(dict(num_cuda_graphs=4) if graphs else {}))
    spy = None
    if kv_groups:
        spy = engine.step_callback = HeldSpy(env, engine)
    results = engine.generate_requests(_greedy(prompts, GROUP_GENS),
                                       arrival_steps=[i // 2 for i in range(len(prompts))])
    usage = engine.context.kv_group_usage()
    info = dict(groups=None if usage is None else dict(windows=usage["windows"],
                                                       layers=usage["layers"],
                                                       blocks=usage["blocks"]),
                evictions=engine.stats.evictions, pauses=engine.stats.pauses,
                graph_replays=engine.graph_replays, runner=runner_name(engine))
    if spy is not None:
        info.update(steps=spy.steps, steps_windowed_held_fewer=spy.fewer,
                    max_held=spy.max_held, held_at_end=usage["held"])
    return _outputs(results), info


def check_kv_groups(env: Env):
    details, problems = {}, []
    for family in ("gemma3", "mistral"):
        hf = _windowed_model(env, family)
        prompts = _random_prompts(GROUP_LENGTHS, 128, seed=2)
        hf_tokens = {i: hf_greedy(hf, p, g) for i, (p, g) in
                     enumerate(zip(prompts, GROUP_GENS))}
        single, single_info = _group_run(env, hf, prompts, kv_groups=False, graphs=False)
        details[f"{family}_one_group"] = single_info
        for graphs in (False, True):
            mode = f"{family}_{'graphs' if graphs else 'eager'}"
            got, info = _group_run(env, hf, prompts, kv_groups=True, graphs=graphs)
            details[mode] = info
            if got != single:
                problems.append(f"{mode}: tokens differ from one group's")
            if got != hf_tokens:
                problems.append(f"{mode}: tokens differ from transformers' greedy generate")
            if not info["steps_windowed_held_fewer"]:
                problems.append(f"{mode}: no windowed group ever held fewer blocks than group 0")
            if graphs and not info["graph_replays"]:
                problems.append(f"{mode}: no graph replayed")
            if any(info["held_at_end"]):
                problems.append(f"{mode}: blocks held at the end: {info['held_at_end']}")
    if details["mistral_eager"]["groups"]["layers"][0] != 0:
        problems.append("mistral: group 0 holds layers (every layer should be windowed)")
    if problems:
        raise CheckFailed("; ".join(problems), details)
    replays = details["gemma3_graphs"]["graph_replays"]
    return (f"Gemma 3 (5 sliding + 1 full, window {WINDOW}) and Mistral (every layer windowed) "
            f"under pressure, eager and graphs ({replays} replays), 2 ms busy kernel after each "
            "step: tokens = one group's = transformers, windows' blocks released"), details


# ------------------------------------------------------------------------------ FP8
FP8_TOLERANCE = 0.02   # prompt log probs, the Triton path against the torch path (both FP8)


def _fp8_kv_append(env: Env, gen) -> dict:
    """``kv_append`` into e4m3 and e5m2 caches from fp32/bf16 K/V with per-head scales, against
    ``kv_append_ref``: bit-exact."""
    from dynctx.kernels import kv_append
    from dynctx.kernels.kv_append import kv_append_ref

    out = {}
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for src in (torch.float32, torch.bfloat16):
            blocks, bs, heads, dim, n = 6, 16, 2, 64, 37
            cache = torch.zeros(2, blocks, bs, heads, dim).to(kv_dtype).to(env.device)
            want = cache.clone()
            key = (torch.randn(n, heads, dim, generator=gen) * 40).to(env.device, src)
            value = (torch.randn(n, heads, dim, generator=gen) * 3).to(env.device, src)
            perm = torch.randperm(blocks * bs, generator=gen)[:n]
            block_ids, slots = (perm // bs).to(env.device), (perm % bs).to(env.device)
            scales = torch.tensor([0.05, 1.5], device=env.device)
            kv_append(cache[0], cache[1], key, value, block_ids, slots, key_scale=scales,
                      value_scale=scales.flip(0).contiguous(), backend=env.kernel_backend)
            kv_append_ref(want[0], want[1], key, value, block_ids, slots, key_scale=scales,
                          value_scale=scales.flip(0).contiguous())
            name = f"{str(kv_dtype).replace('torch.float8_', '')}_from_" \
                   f"{str(src).replace('torch.', '')}"
            out[name] = bool(torch.equal(_bytes(cache), _bytes(want)))
    return out


def _fp8_attention(env: Env, gen) -> dict:
    """Paged attention over an e4m3 cache (per-head scales), decode and mixed steps, against
    the float64 reference over the dequantized cache."""
    from dynctx.kernels.fp8 import dequantize_ref, quantize_ref

    out = {}
    dtype = torch.float16 if env.cuda or env.interpreting else torch.float32
    for label, (q_lens, kv_lens, decode) in ATTENTION_CASES.items():
        case = attention_case(env, dtype, q_lens, kv_lens, seed=3)
        scales = torch.tensor([0.02, 0.007], device=env.device)
        quantized = {}
        for name in ("key_cache", "value_cache"):
            quantized[name] = quantize_ref(case[name].float(), scales[:, None],
                                           torch.float8_e4m3fn)
        fp8 = dict(case, **quantized)
        out_tensor = torch.full_like(case["query"], float("nan"))
        paged_attention(fp8["query"], fp8["key_cache"], fp8["value_cache"],
                        fp8["cu_query_lengths"], fp8["kv_seq_lengths"], fp8["block_table"],
                        max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens),
                        num_decode_requests=decode, out=out_tensor, key_scale=scales,
                        value_scale=scales, backend=env.kernel_backend)
        reference = dict(fp8, **{name: dequantize_ref(q, scales[:, None])
                                 for name, q in quantized.items()})
        want = attention_reference(reference, q_lens, kv_lens)
        got = out_tensor.double().cpu()
        error = float("nan") if got.isnan().any() else float((got - want).abs().max())
        out[f"{label}_max_abs_error"] = error
    out["dtype"] = str(dtype).replace("torch.", "")
    return out


def _scoring(prompts, gen: int = 3) -> List[DynamicInferenceRequest]:
    return [DynamicInferenceRequest(
        request_id=i, prompt_tokens=list(p),
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=gen,
                                       return_log_probs=True, termination_id=None))
        for i, p in enumerate(prompts)]


def _fp8_engine(env: Env, hf, prompts, *, kernels: str, attention: str, **kwargs) -> tuple:
    engine = _engine(hf, env, block_bytes=_llama_block_bytes(hf, 16), blocks=24,
                     paused_blocks=2, block_size=16, max_tokens=64, kernel_backend=kernels,
                     attention_backend=attention, **kwargs)
    results = sorted(engine.generate_requests(_scoring(prompts)), key=lambda r: r.request_id)
    return ([torch.tensor(r.prompt_log_probs) for r in results],
            [list(r.generated_tokens) for r in results], engine)


def _log_prob_error(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _fp8_flashinfer(env: Env, prompts) -> dict:
    """FlashInfer's FP8 path (a bf16 model: FlashInfer has no fp32 kernels) against the torch
    path on the same cache dtype, where FlashInfer is installed."""
    from dynctx.models.paged_attention import flashinfer_available

    if not flashinfer_available(env.device):
        return dict(status="absent (not installed, or no CUDA device): not run")
    hf = copy.deepcopy(tiny_llama(env)).to(torch.bfloat16)
    theirs, _, _ = _fp8_engine(env, hf, prompts, kernels="torch", attention="flashinfer",
                               kv_cache_dtype="fp8")
    ours, _, _ = _fp8_engine(env, hf, prompts, kernels="torch", attention="torch",
                             kv_cache_dtype="fp8")
    return dict(status="ran", max_log_prob_error_vs_torch=_log_prob_error(theirs, ours))


def check_fp8_kv(env: Env):
    gen = torch.Generator().manual_seed(21)
    details: Dict[str, object] = dict(kv_append_bit_exact=_fp8_kv_append(env, gen),
                                      attention=_fp8_attention(env, gen))
    problems = [f"kv_append {name}: not bit-exact against kv_append_ref"
                for name, same in details["kv_append_bit_exact"].items() if not same]
    tolerance = 4e-3 if details["attention"]["dtype"] == "float16" else 5e-5
    for key, error in details["attention"].items():
        if key.endswith("error") and not error <= tolerance:
            problems.append(f"paged attention {key}: {error:.3g} over {tolerance:g}")
    # The engine: the kernels' path (Triton; on a CPU the interpreter) against the torch path,
    # both on an FP8 cache, and the params-dtype cache for scale.
    hf = tiny_llama(env)
    prompts = _random_prompts([7, 30, 19], hf.config.vocab_size, seed=4)
    kernels = "triton" if env.kernel_backend == "triton" else "torch"
    ours, tokens, engine = _fp8_engine(env, hf, prompts, kernels=kernels, attention=kernels,
                                       kv_cache_dtype="fp8")
    torch_fp8, torch_tokens, _ = _fp8_engine(env, hf, prompts, kernels="torch",
                                             attention="torch", kv_cache_dtype="fp8")
    full, _, _ = _fp8_engine(env, hf, prompts, kernels="torch", attention="torch")
    buffer = engine.context.memory_buffer
    details["engine"] = dict(
        path=kernels, cache_dtype=str(buffer.dtype).replace("torch.", ""),
        max_log_prob_error_vs_torch_fp8=_log_prob_error(ours, torch_fp8),
        same_tokens_as_torch_fp8=tokens == torch_tokens,
        max_log_prob_error_vs_params_dtype=_log_prob_error(ours, full))
    eng = details["engine"]
    if buffer.dtype != torch.float8_e4m3fn:
        problems.append(f"the engine's cache is {buffer.dtype}, not float8_e4m3fn")
    if not eng["max_log_prob_error_vs_torch_fp8"] <= FP8_TOLERANCE:
        problems.append(f"engine: prompt log probs differ from the torch FP8 path by "
                        f"{eng['max_log_prob_error_vs_torch_fp8']:.3g} (over {FP8_TOLERANCE})")
    if not 0 < eng["max_log_prob_error_vs_params_dtype"] < 0.1:
        problems.append(f"engine: FP8 against the params-dtype cache "
                        f"{eng['max_log_prob_error_vs_params_dtype']:.3g} (expected in (0, 0.1))")
    details["flashinfer"] = _fp8_flashinfer(env, prompts)
    error = details["flashinfer"].get("max_log_prob_error_vs_torch")
    if error is not None and not error <= 0.05:
        problems.append(f"flashinfer FP8: prompt log probs differ from torch by {error:.3g}")
    if problems:
        raise CheckFailed("; ".join(problems), details)
    worst = max(v for k, v in details["attention"].items() if k.endswith("error"))
    return (f"kv_append e4m3/e5m2 bit-exact; attention over e4m3 max error {worst:.1e}; engine "
            f"({kernels}) log probs within {eng['max_log_prob_error_vs_torch_fp8']:.1e} of the "
            f"torch FP8 path; flashinfer {details['flashinfer']['status'].split(' ')[0]}"), details


CHECK_FUNCTIONS: Dict[str, Callable[[Env], tuple]] = {
    "host_pool_copies": check_host_pool_copies,
    "kv_offload": check_kv_offload,
    "mamba_offload": check_mamba_offload,
    "kv_groups": check_kv_groups,
    "fp8_kv": check_fp8_kv,
}

