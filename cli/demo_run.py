"""The demo's run: its KV buffer in blocks, its workload, the engine over it, and the summary.

``python -m dynctx demo`` checks its flags (``dynctx.cli_demo``), then calls ``run``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from dynctx.demo_check import against_transformers, ranks_agree
from dynctx.demo_plot import StepRecord, plot_history
from dynctx.demo_speculative import speculative_summary

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
GIB = 1024 ** 3


class FlagError(ValueError):
    """Flags that do not fit the model they build (the KV buffer for its longest request):
    ``python -m dynctx demo`` reports it as a usage error, one line, exit code 2."""


@dataclass(frozen=True)
class KvSizing:
    """The KV buffer the flags ask for, in blocks of one rank: ``blocks`` for requests (the
    active and the paused budget; the context's padding block comes on top), ``paused_blocks``
    of them the paused budget. ``blocks_flag``/``paused_flag`` say which flags set them."""

    block_bytes: int
    blocks: int
    paused_blocks: int
    blocks_flag: str
    paused_flag: str

    @property
    def active_blocks(self) -> int:
        return self.blocks - self.paused_blocks

    @property
    def buffer_gb(self) -> float:
        return (self.blocks + 1) * self.block_bytes / GIB

    @property
    def paused_gb(self) -> float:
        return self.paused_blocks * self.block_bytes / GIB


def kv_sizing(args, block_bytes: int) -> KvSizing:
    """Blocks from ``--buffer-blocks`` / ``--paused-blocks``, or from ``--buffer-size-gb`` /
    ``--paused-buffer-size-gb`` divided as the context divides them, for blocks of
    ``block_bytes`` (one rank's, ``models.random_models.kv_block_bytes``)."""
    size = f"{block_bytes / 1024:g} KiB"
    if args.buffer_size_gb is not None:
        blocks = int(args.buffer_size_gb * GIB) // block_bytes - 1
        blocks_flag = (f"--buffer-size-gb {args.buffer_size_gb:g} ({max(blocks, 0)} blocks of "
                       f"{size} and the padding block)")
    else:
        blocks, blocks_flag = args.buffer_blocks, f"--buffer-blocks {args.buffer_blocks}"
    if args.paused_buffer_size_gb is not None:
        paused = int(args.paused_buffer_size_gb * GIB) // block_bytes
        paused_flag = (f"--paused-buffer-size-gb {args.paused_buffer_size_gb:g} ({paused} "
                       f"blocks of {size})")
    else:
        paused, paused_flag = args.paused_blocks, f"--paused-blocks {args.paused_blocks}"
    return KvSizing(block_bytes, blocks, paused, blocks_flag, paused_flag)


def buffer_problem(args, sizing: KvSizing) -> Optional[str]:
    """Why the buffer cannot run the workload's longest request, naming the flags that set it
    and what would do; None when it can."""
    needed = blocks_per_request(args)
    if sizing.active_blocks >= needed:
        return None
    longest = (f"the longest request (a {longest_prompt(args)}-token prompt + --max-new-tokens "
               f"{args.max_new_tokens}) needs {needed} blocks of --block-size {args.block_size}")
    if args.buffer_size_gb is None:
        fix = f"use --buffer-blocks {needed + sizing.paused_blocks} or more"
    else:
        gib = (needed + sizing.paused_blocks + 1) * sizing.block_bytes / GIB
        digits = 2 - math.floor(math.log10(gib))  # three significant digits, rounded up
        fix = f"use --buffer-size-gb {math.ceil(gib * 10 ** digits) / 10 ** digits:g} or more"
    return (f"{sizing.blocks_flag} with {sizing.paused_flag} leaves {sizing.active_blocks} "
            f"blocks for running requests; {longest}: {fix}")


def longest_prompt(args) -> int:
    """The workload's longest prompt: 3 blocks, or less where ``--max-seq`` needs room for
    ``--max-new-tokens``."""
    return min(3 * args.block_size, args.max_seq - args.max_new_tokens)


def max_sequence_length(args) -> int:
    """The longest request of the workload, the context's ``max_sequence_length``: the
    context needs no more, and its budget check then holds for every request."""
    return longest_prompt(args) + args.max_new_tokens


def blocks_per_request(args) -> int:
    return math.ceil(max_sequence_length(args) / args.block_size)


def make_workload(args, vocab: int) -> tuple[List[List[int]], List[int], List[int]]:
    """Prompts (1 token to ``longest_prompt``), generation lengths and arrival steps, from the
    seed."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    longest = longest_prompt(args)
    lengths = [1, 2, longest] + rng.integers(1, longest + 1, size=args.requests).tolist()
    lengths = [min(n, longest) for n in lengths[:args.requests]]
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in lengths]
    if args.shared_prefix > 0 and longest > 1:
        # Its own generator, so that the rest of the workload stays the seed's.
        shared = np.random.default_rng(args.seed + 1).integers(3, vocab, size=min(
            args.shared_prefix, longest - 1)).tolist()
        prompts = [shared + p[:longest - len(shared)] for p in prompts]
    low = max(1, args.max_new_tokens // 4)
    gens = rng.integers(low, args.max_new_tokens + 1, size=args.requests).tolist()
    gaps = rng.exponential(args.arrival_every, size=args.requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int).tolist()
    return prompts, gens, arrivals


def missing_dependency(error: ImportError) -> int:
    name = error.name or str(error)
    print(f"python -m dynctx demo needs {name}, which is not installed.\n"
          "Install the demo's extras: pip install 'dynctx[demo]' (transformers, matplotlib, "
          "tqdm), or from a checkout: pip install '.[demo]'", file=sys.stderr)
    return 2


def progress_bar(enabled: bool, **kwargs):
    """A tqdm bar on stderr, kept on screen when closed (so later output starts on a fresh
    line), or None when disabled, when stderr is not a terminal (a log gets no bar updates)
    or when tqdm is missing."""
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("(no progress bar: tqdm is not installed; pip install 'dynctx[demo]')",
              file=sys.stderr)
        return None
    return tqdm(leave=True, file=sys.stderr, dynamic_ncols=True, **kwargs)


def run(args, rank: int, world: int) -> int:
    """Build the model and the engine, generate, check against transformers, summarise; the
    exit code (1 on a mismatch)."""
    import torch

    def say(*parts, **kwargs) -> None:
        if rank == 0:
            print(*parts, **kwargs)

    from transformers.utils import logging as hf_logging

    from dynctx.context import DynamicInferenceRequest, SamplingParams
    from dynctx.demo_speculative import speculative_options
    from dynctx.engine import Engine
    from dynctx.models.random_models import kv_block_bytes, random_causal_lm

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    try:
        hf_model = random_causal_lm(
            args.model, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
            heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
            max_positions=args.max_seq, window=args.block_size,
            seed=args.seed).to(device=device, dtype=dtype)
    except (MemoryError, RuntimeError) as error:  # torch's allocation failures
        if not isinstance(error, MemoryError) and "allocate" not in str(error):
            raise
        raise FlagError(f"the random model of --vocab {args.vocab}, --hidden {args.hidden}, "
                        f"--layers {args.layers}, --intermediate {args.intermediate} does not "
                        f"fit in memory on {device}: lower them ({str(error).splitlines()[0]})"
                        ) from None
    # Blocks of one rank (its share of the KV heads, or an MLA model's latent row), checked
    # against the longest request before the context is built.
    block_bytes = kv_block_bytes(hf_model, args.block_size, world)
    if args.kv_cache_dtype == "fp8":  # one byte per cached value, whatever --dtype is
        block_bytes //= next(hf_model.parameters()).element_size()
    sizing = kv_sizing(args, block_bytes)
    problem = buffer_problem(args, sizing)
    if problem:
        raise FlagError(problem)
    # unified_memory_level=0: the paused budget lies inside the buffer on every device, so
    # the flags' blocks are the context's blocks on a CPU and on CUDA alike.
    context_kwargs = dict(block_size_tokens=args.block_size, buffer_size_gb=sizing.buffer_gb,
                          paused_buffer_size_gb=sizing.paused_gb, unified_memory_level=0,
                          max_sequence_length=max_sequence_length(args),
                          max_tokens=args.max_tokens,
                          max_requests=args.max_requests, kernel_backend=args.kernel_backend,
                          fused_rope_kv_append=args.fused_rope_kv_append,
                          kv_cache_dtype="fp8" if args.kv_cache_dtype == "fp8" else None,
                          enable_prefix_caching=args.prefix_caching != "off",
                          prefix_caching_eviction_policy=(
                              "ref_zero" if args.prefix_caching == "off"
                              else args.prefix_caching))
    if world > 1:
        context_kwargs["tensor_model_parallel_size"] = world
    context_kwargs.update(speculative_options(args, hf_model, lambda layers: random_causal_lm(
        args.model, vocab=args.vocab, hidden=args.hidden, layers=layers, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, max_positions=args.max_seq,
        window=args.block_size, seed=args.seed)))
    engine = Engine.from_transformers(hf_model, rope=args.rope,
                                      attention_backend=args.attention_backend,
                                      seed=args.seed, record_logits=args.dtype != "fp32",
                                      async_scheduling=args.async_scheduling,
                                      **context_kwargs)
    ctx = engine.context
    prompts, gens, arrivals = make_workload(args, args.vocab)
    eos = engine.default_termination_id
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=prompt,
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=gen,
                                       termination_id=eos))
        for i, (prompt, gen) in enumerate(zip(prompts, gens))]
    say(f"dynctx demo: random {type(hf_model).__name__} ({engine.model.path} path; "
        f"{args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads / {args.kv_heads} KV heads, vocab {args.vocab}), {args.dtype} on "
        f"{device}; {args.requests} requests, prompts {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, arrivals over steps 0-{arrivals[-1]}")
    alloc = ctx.block_allocator
    say(f"context: {alloc.total_count - 1} KV blocks of {args.block_size} tokens "
        f"(active budget {alloc.active_count}, paused budget {alloc.paused_count}), "
        f"max_tokens {ctx.max_tokens}, max_requests {ctx.max_requests}", flush=True)

    # The bar counts each request's generation budget: tokens as they come, and the unused rest
    # of the budget when a request stops early, so it ends at 100 %.
    progress = progress_bar(not args.no_progress and rank == 0, total=sum(gens), unit="tok",
                            desc="generating")
    counted = [0] * len(requests)
    history: List[StepRecord] = []

    def on_step(result) -> None:
        history.append(StepRecord(result.step, result.active_requests, result.paused_requests,
                                  len(result.evicted_ids), result.kv_utilization))
        if progress is None:
            return
        advance = 0
        for rid in result.new_tokens:
            if counted[rid] < gens[rid]:
                counted[rid] += 1
                advance += 1
        for finished in result.finished:
            rid = finished.request_id
            advance += gens[rid] - counted[rid]
            counted[rid] = gens[rid]
        progress.update(advance)
        progress.set_postfix(step=result.step, active=result.active_requests,
                             paused=result.paused_requests, refresh=False)

    engine.step_callback = on_step
    started = time.perf_counter()
    # Under tensor parallelism rank 0's requests are broadcast to the others (the engine does).
    results = engine.generate_requests(requests if rank == 0 else None,
                                       arrival_steps=arrivals if rank == 0 else None)
    elapsed = time.perf_counter() - started
    if progress is not None:
        progress.update(progress.total - progress.n)
        progress.close()

    if world > 1:
        code = ranks_agree(results, rank, world)
        if code:
            return code
        if rank != 0:
            return 0
    # Check every output against transformers' greedy generate for that prompt alone.
    exact = near_tie = 0
    mismatched = []
    checking = progress_bar(not args.no_progress, total=len(requests), unit="req",
                            desc="checking against transformers")
    for request, result in zip(requests, results):
        verdict = against_transformers(hf_model, request, result, eos, device,
                                       half=args.dtype != "fp32",
                                       fp8=args.kv_cache_dtype == "fp8")
        if verdict == "exact":
            exact += 1
        elif verdict == "near-tie":
            near_tie += 1
        else:
            mismatched.append((result.request_id, verdict))
        if checking is not None:
            checking.update(1)
    if checking is not None:
        checking.close()
    sys.stderr.flush()
    _summary(args, engine, results, elapsed, world, say)
    if args.plot:
        path = os.path.abspath(args.plot)
        try:
            plot_history(history, path, f"dynctx demo: {len(results)} requests, "
                         f"{alloc.total_count - 1} KV blocks of {args.block_size}")
        except ImportError:
            say("plot              skipped: matplotlib is not installed "
                "(pip install 'dynctx[demo]')")
        else:
            say(f"plot              {path}")
    checked = f"{exact}/{len(results)} outputs match transformers' greedy generate exactly"
    if near_tie:
        cause = args.dtype + (", fp8 KV cache" if args.kv_cache_dtype == "fp8" else "")
        checked += f", {near_tie} diverge at a near-tie ({cause}, accepted)"
    if mismatched:
        say(f"MISMATCH: {checked}; {len(mismatched)} differ (request, first differing "
            f"token): {mismatched}")
        return 1
    say(f"check             OK: {checked}")
    return 0


def _summary(args, engine, results, elapsed: float, world: int, say) -> None:
    """The summary lines: requests, tokens, steps, time, KV use, pauses, evictions, chunks,
    the prefix cache and the backends (``engine.stats`` holds the counts)."""
    from dynctx.kernels import backend

    ctx = engine.context
    alloc = ctx.block_allocator
    stats = engine.stats
    generated = sum(len(r.generated_tokens) for r in results)
    finished = {reason: sum(r.finish_reason == reason for r in results)
                for reason in ("length", "stop", "error")}
    say(f"requests          {len(results)} ({finished['length']} length, {finished['stop']} "
        f"stop, {finished['error']} error)")
    say(f"tokens            {generated} generated, {stats.tokens_processed} processed "
        f"(prompts, recomputes and decodes)")
    say(f"steps             {stats.forward_steps} forward + {stats.idle_steps} idle")
    if args.async_scheduling:
        counts = engine.async_scheduling_counts
        say(f"async scheduling  tokens read one step late; {counts['retired']} requests ran "
            f"one step past their termination id, {counts['early_reads']} early reads "
            "(evictions)")
    say(f"time              {elapsed:.2f} s: {generated / elapsed:.0f} generated tokens/s, "
        f"{stats.tokens_processed / elapsed:.0f} processed tokens/s")
    say(f"peak KV use       {100 * stats.peak_kv_utilization:.0f}% of "
        f"{alloc.total_count - 1} blocks; peak {stats.peak_active_requests} active, "
        f"{stats.peak_paused_requests} paused requests")
    say(f"pauses            {stats.pauses}")
    say(f"evictions         {stats.evictions}")
    say(f"chunked prefills  {stats.chunked_prefills} prompts in {stats.prefill_chunks} chunks")
    if speculative_summary(args, stats):
        say(speculative_summary(args, stats))
    if stats.prefix_cache:
        cache = stats.prefix_cache
        say(f"prefix cache      {args.prefix_caching}: {cache['prefix_cache_hits']} hits of "
            f"{cache['prefix_cache_lookups']} new adds "
            f"({100 * cache['prefix_cache_hit_rate']:.0f}%; re-adds after evictions and "
            "suspends count), "
            f"{cache['prefix_cache_prefill_skipped_tokens']} prompt tokens served from "
            f"the cache ({100 * cache['prefix_cache_token_hit_rate']:.0f}% of prefill)")
    kernels = backend.resolve_backend(ctx.kernel_backend, ctx.device)
    say(f"attention         {engine.model.attention_backend} paged attention; kernels: {kernels}")
    if world > 1:
        say(f"tensor parallel   {world} ranks: {engine.model.num_q_heads} query heads and "
            f"{engine.model.num_kv_heads} KV head(s) per rank; every rank returned the same "
            "outputs")
