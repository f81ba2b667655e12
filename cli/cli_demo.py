"""``python -m dynctx demo``: in-flight batching of a small random Llama through the context.

Builds a ``transformers`` ``LlamaForCausalLM`` with random weights (nothing downloads; ``--model``
picks another family: ``dynctx.models.random_models``), sends a
stream of requests with staggered arrivals and mixed lengths through the reference engine with
a KV buffer small enough that requests pause, resume, get evicted and get chunked, prints a
summary, checks every output against ``transformers``' greedy ``generate`` for that prompt
alone, and writes a plot of active requests, paused requests and KV utilization per step.
Exit code 1 when an output does not match.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from dynctx._cli_common import HelpFormatter, plain, program_name

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# bf16/fp16 runs may diverge from transformers at a near-tie: accepted when the top two
# reference logits lie within this much (absolute, plus relative to the top logit).
HALF_TIE_ATOL, HALF_TIE_RTOL = 2e-2, 2e-2


def build_parser(prog: str = "python -m dynctx demo") -> argparse.ArgumentParser:
    from dynctx.models.random_models import RANDOM_MODELS

    parser = argparse.ArgumentParser(prog=prog,
                                     description=plain(__doc__).replace("python -m dynctx demo",
                                                                        prog),
                                     formatter_class=HelpFormatter)
    model = parser.add_argument_group("model (a transformers causal LM, random weights)")
    model.add_argument("--model", default="llama", choices=sorted(RANDOM_MODELS),
                       help="the family: llama and deepseek_v3 run dedicated adapters, the "
                            "others the generic transformers path (windowed families: a "
                            "window of one block)")
    model.add_argument("--layers", type=int, default=2, help="decoder layers")
    model.add_argument("--hidden", type=int, default=64, help="hidden size")
    model.add_argument("--heads", type=int, default=4, help="query heads")
    model.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    model.add_argument("--intermediate", type=int, default=128, help="MLP intermediate size")
    model.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    model.add_argument("--max-seq", type=int, default=256,
                       help="max_position_embeddings, the context's max_sequence_length")
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=int, default=24, help="number of requests")
    work.add_argument("--max-new-tokens", type=int, default=32,
                      help="longest generation; each request asks for 1/4 to all of it")
    work.add_argument("--shared-prefix", type=int, default=0,
                      help="tokens every prompt starts with (a shared system prompt; prompts "
                           "stay within 3 blocks)")
    work.add_argument("--arrival-every", type=float, default=1.5,
                      help="mean engine steps between arrivals (exponential gaps)")
    ctx = parser.add_argument_group("context")
    ctx.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ctx.add_argument("--buffer-blocks", type=int, default=14,
                     help="KV buffer in blocks (sets buffer_size_gb from the model dimensions)")
    ctx.add_argument("--paused-blocks", type=int, default=3,
                     help="paused budget in blocks (sets paused_buffer_size_gb)")
    ctx.add_argument("--buffer-size-gb", type=float, default=None,
                     help="KV buffer in GiB; overrides --buffer-blocks")
    ctx.add_argument("--paused-buffer-size-gb", type=float, default=None,
                     help="paused budget in GiB; overrides --paused-blocks")
    ctx.add_argument("--max-tokens", type=int, default=32,
                     help="tokens per step; longer prompts are chunked")
    ctx.add_argument("--max-requests", type=int, default=None,
                     help="request rows (default: the context's, about one per block, capped "
                          "at --max-tokens)")
    ctx.add_argument("--kernel-backend", choices=["auto", "triton", "torch"], default=None,
                     help="kernels: compiled Triton on CUDA and the torch references on a CPU "
                          "(auto), or force one (default: $DYNCTX_KERNEL_BACKEND, else auto)")
    ctx.add_argument("--attention-backend", default="auto",
                     choices=["auto", "torch", "flashinfer", "flash_attn"],
                     help="paged attention; auto picks FlashInfer, then flash-attn, on CUDA in "
                          "fp16/bf16 when installed, else torch")
    ctx.add_argument("--rope", choices=["table", "cos_sin"], default="table",
                     help="rotary embedding through Megatron's angle table "
                          "(apply_rotary_emb_query/key) or a cos/sin cache "
                          "(apply_fused_qk_rotary_emb)")
    ctx.add_argument("--prefix-caching", choices=["off", "ref_zero", "lru"], default="off",
                     help="prefix caching and its eviction policy; the summary then shows the "
                          "cache's hit rate")
    ctx.add_argument("--fused-rope-kv-append", action="store_true",
                     help="rotate K and append K/V to the cache in one launch")
    run = parser.add_argument_group("run")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                     help="model and KV cache dtype; fp16/bf16 accept divergence at near-ties")
    run.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    run.add_argument("--threads", type=int, default=1,
                     help="torch CPU threads (1 is fastest for a small model; 0 keeps torch's)")
    run.add_argument("--async-scheduling", action="store_true",
                     help="read each step's sampled tokens one step late, after the next "
                          "step's forward is launched (the host's bookkeeping overlaps the "
                          "device's forward on CUDA); outputs are unchanged; fp32 only (the "
                          "half-precision check records logits)")
    run.add_argument("--plot", default="demo.png", help="PNG path ('' skips the plot)")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bars (they need tqdm and go to stderr)")
    run.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="tensor-parallel ranks: run under torchrun with as many processes "
                          "(PYTHONSAFEPATH=1 python -P -m torch.distributed.run "
                          "--nproc-per-node N -m dynctx demo --tensor-parallel-size N; gloo on "
                          "a CPU, NCCL on CUDA); rank 0 "
                          "prints, plots and checks, every rank must return the same outputs")
    return parser


def _start_distributed(args) -> tuple:
    """``(rank, world, created)`` of the tensor-parallel run (``(0, 1, False)`` without one).
    Initialises torch.distributed from torchrun's environment when nobody has yet."""
    import torch
    import torch.distributed as dist

    tp = args.tensor_parallel_size
    if tp < 1:
        raise SystemExit(f"--tensor-parallel-size={tp} must be >= 1")
    if tp == 1:
        return 0, 1, False
    created = False
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise SystemExit(
                f"--tensor-parallel-size={tp} needs one process per rank: launch with "
                f"PYTHONSAFEPATH=1 python -P -m torch.distributed.run --nproc-per-node {tp} "
                f"-m dynctx demo --tensor-parallel-size {tp}")
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        created = True
    world = dist.get_world_size()
    if world != tp:
        raise SystemExit(f"--tensor-parallel-size={tp} but torch.distributed has {world} "
                         f"ranks (--nproc-per-node {tp})")
    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"
    return dist.get_rank(), world, created


def make_workload(args, vocab: int) -> tuple[List[List[int]], List[int], List[int]]:
    """Prompts (1 token to 3 blocks), generation lengths and arrival steps, from the seed."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    longest = min(3 * args.block_size, args.max_seq - args.max_new_tokens)
    lengths = [1, 2, longest] + rng.integers(1, longest + 1, size=args.requests).tolist()
    lengths = lengths[:args.requests]
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in lengths]
    if args.shared_prefix > 0:
        # Its own generator, so that the rest of the workload stays the seed's.
        shared = np.random.default_rng(args.seed + 1).integers(3, vocab, size=min(
            args.shared_prefix, longest - 1)).tolist()
        prompts = [shared + p[:longest - len(shared)] for p in prompts]
    low = max(1, args.max_new_tokens // 4)
    gens = rng.integers(low, args.max_new_tokens + 1, size=args.requests).tolist()
    gaps = rng.exponential(args.arrival_every, size=args.requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int).tolist()
    return prompts, gens, arrivals


@dataclass
class StepRecord:
    """What the plot shows of one engine step."""

    step: int
    active: int
    paused: int
    evictions: int
    kv_utilization: float


# Above this many steps the plot shows windows (mean line, min-max band) instead of every step.
PLOT_MAX_POINTS = 400


def aggregate(history: List[StepRecord], max_points: int = PLOT_MAX_POINTS) -> dict:
    """Per-window arrays for the plot: ``step`` (window start), mean/min/max of active and
    paused requests, mean KV utilization (%) and evictions per window. One window per step when
    ``history`` has at most ``max_points`` steps."""
    import numpy as np

    n = len(history)
    width = max(1, -(-n // max_points))
    steps = np.array([h.step for h in history], dtype=np.int64)
    columns = {name: np.array([getattr(h, name) for h in history], dtype=np.float64)
               for name in ("active", "paused", "evictions", "kv_utilization")}
    starts = np.arange(0, n, width)
    out = {"width": width, "step": steps[starts]}
    for name in ("active", "paused"):
        out[f"{name}_mean"] = np.add.reduceat(columns[name], starts) / np.diff(np.append(starts, n))
        out[f"{name}_min"] = np.minimum.reduceat(columns[name], starts)
        out[f"{name}_max"] = np.maximum.reduceat(columns[name], starts)
    out["kv_percent"] = 100 * np.add.reduceat(columns["kv_utilization"], starts) / \
        np.diff(np.append(starts, n))
    out["evictions"] = np.add.reduceat(columns["evictions"], starts)
    return out


def plot_history(history: List[StepRecord], path: str, title: str) -> None:
    """Active and paused requests and KV utilization per step; at more than
    ``PLOT_MAX_POINTS`` steps, per window of steps: the mean as a line, min to max as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = aggregate(history)
    width = data["width"]
    steps = data["step"]
    fig, axis = plt.subplots(figsize=(10, 4.8))
    for name, label, color in (("active", "active requests", "tab:blue"),
                               ("paused", "paused requests", "tab:orange")):
        if width == 1:
            axis.step(steps, data[f"{name}_mean"], where="post", label=label, color=color)
        else:
            axis.plot(steps, data[f"{name}_mean"], label=f"{label} (mean)", color=color)
            axis.fill_between(steps, data[f"{name}_min"], data[f"{name}_max"], step="post",
                              color=color, alpha=0.2, linewidth=0,
                              label=f"{label} (min-max)")
    evicted = data["evictions"] > 0
    if evicted.any():
        per = "" if width == 1 else f" (windows with any, of {width} steps)"
        axis.scatter(steps[evicted], [0] * int(evicted.sum()), marker="x", color="red",
                     zorder=3, label=f"evictions{per}")
    axis.set_xlabel("engine step")
    axis.set_ylabel("requests")
    axis.set_ylim(bottom=0)
    util = axis.twinx()
    util.plot(steps, data["kv_percent"], color="gray", alpha=0.7,
              label="KV blocks allocated (%)" + ("" if width == 1 else " (mean)"))
    util.set_ylabel("KV blocks allocated (%)")
    util.set_ylim(0, 105)
    lines = axis.get_legend_handles_labels()
    more = util.get_legend_handles_labels()
    # Below the plot, so that it never hides the curves.
    axis.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", fontsize=8,
                bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    if width > 1:
        title += f"\n{len(history)} steps shown in windows of {width}"
    axis.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _missing_demo_dependency(error: ImportError) -> int:
    name = error.name or str(error)
    print(f"python -m dynctx demo needs {name}, which is not installed.\n"
          "Install the demo's extras: pip install 'dynctx[demo]' (transformers, matplotlib, "
          "tqdm), or from a checkout: pip install '.[demo]'", file=sys.stderr)
    return 2


def _progress_bar(enabled: bool, **kwargs):
    """A tqdm bar on stderr, kept on screen when closed (so later output starts on a fresh
    line, also in a log), or None when disabled or tqdm is missing."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("(no progress bar: tqdm is not installed; pip install 'dynctx[demo]')")
        return None
    return tqdm(leave=True, file=sys.stderr, dynamic_ncols=True, **kwargs)


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    parser = build_parser(prog or f"{program_name()} demo")
    args = parser.parse_args(argv)
    if args.shared_prefix < 0:
        parser.error(f"argument --shared-prefix: {args.shared_prefix} must be >= 0")
    rank, world, created = _start_distributed(args)
    if not created:
        return _main(args, rank, world)
    import torch.distributed as dist

    code = _main(args, rank, world)
    # Free the engine now (its context and model hold the process group, in reference cycles):
    # a group left for the interpreter's exit to destroy sometimes aborted a rank there
    # ("terminate called without an active exception"). Then the ranks leave together.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return code


def _main(args, rank: int, world: int) -> int:
    import torch

    def say(*parts, **kwargs) -> None:
        if rank == 0:
            print(*parts, **kwargs)

    try:
        import transformers  # noqa: F401  (the demo's extra; its models come from it)
        from transformers.utils import logging as hf_logging
    except ImportError as error:
        return _missing_demo_dependency(error)

    from dynctx.context import DynamicInferenceRequest, SamplingParams
    from dynctx.engine import Engine
    from dynctx.models.random_models import kv_block_bytes, random_causal_lm

    hf_logging.set_verbosity_error()
    if args.async_scheduling and args.dtype != "fp32":
        raise SystemExit(f"--async-scheduling with --dtype {args.dtype}: the half-precision "
                         "check records every step's logits (record_logits), which async "
                         "scheduling refuses; use --dtype fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    hf_model = random_causal_lm(
        args.model, vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, max_positions=args.max_seq,
        window=args.block_size, seed=args.seed).to(device=device, dtype=dtype)
    # One rank's block: its share of the KV heads (one, replicated, past their count).
    block_bytes = kv_block_bytes(hf_model, args.block_size, world)
    buffer_gb = args.buffer_size_gb or args.buffer_blocks * block_bytes / 1024 ** 3
    paused_gb = (args.paused_buffer_size_gb if args.paused_buffer_size_gb is not None
                 else args.paused_blocks * block_bytes / 1024 ** 3)
    # The longest request the workload makes (make_workload: a prompt of at most 3 blocks):
    # the context needs no more, and its budget check then holds for every request.
    max_sequence_length = min(args.max_seq, 3 * args.block_size + args.max_new_tokens)
    context_kwargs = dict(block_size_tokens=args.block_size, buffer_size_gb=buffer_gb,
                          max_sequence_length=max_sequence_length,
                          paused_buffer_size_gb=paused_gb, max_tokens=args.max_tokens,
                          max_requests=args.max_requests, kernel_backend=args.kernel_backend,
                          fused_rope_kv_append=args.fused_rope_kv_append,
                          enable_prefix_caching=args.prefix_caching != "off",
                          prefix_caching_eviction_policy=(
                              "ref_zero" if args.prefix_caching == "off"
                              else args.prefix_caching))
    if world > 1:
        context_kwargs["tensor_model_parallel_size"] = world
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
    progress = _progress_bar(not args.no_progress and rank == 0, total=sum(gens), unit="tok",
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
        code = _check_ranks_agree(results, rank, world)
        if code:
            return code
        if rank != 0:
            return 0
    # Check every output against transformers' greedy generate for that prompt alone.
    exact = near_tie = 0
    mismatched = []
    checking = _progress_bar(not args.no_progress, total=len(requests), unit="req",
                             desc="checking against transformers")
    for request, result in zip(requests, results):
        verdict = _check_against_transformers(hf_model, request, result, eos, device,
                                              half=args.dtype != "fp32")
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
    if stats.prefix_cache:
        cache = stats.prefix_cache
        say(f"prefix cache      {args.prefix_caching}: {cache['prefix_cache_hits']} hits of "
            f"{cache['prefix_cache_lookups']} new adds "
            f"({100 * cache['prefix_cache_hit_rate']:.0f}%; re-adds after evictions and "
            "suspends count), "
            f"{cache['prefix_cache_prefill_skipped_tokens']} prompt tokens served from "
            f"the cache ({100 * cache['prefix_cache_token_hit_rate']:.0f}% of prefill)")
    say(f"attention         {engine.model.attention_backend} paged attention; kernels: "
        f"{_kernel_backend_name(ctx)}")
    if world > 1:
        say(f"tensor parallel   {world} ranks: {engine.model.num_q_heads} query heads and "
            f"{engine.model.num_kv_heads} KV head(s) per rank; every rank returned the same "
            "outputs")
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
        checked += f", {near_tie} diverge at a near-tie ({args.dtype}, accepted)"
    if mismatched:
        say(f"MISMATCH: {checked}; {len(mismatched)} differ (request, first differing "
            f"token): {mismatched}")
        return 1
    say(f"check             OK: {checked}")
    return 0


def _check_ranks_agree(results, rank: int, world: int) -> int:
    """0 when every rank generated rank 0's tokens; else 1 on every rank (rank 0 says which)."""
    import torch.distributed as dist

    mine = [r.generated_tokens for r in results]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    differ = [r for r in range(1, world) if gathered[r] != gathered[0]]
    if differ and rank == 0:
        print(f"MISMATCH: ranks {differ} generated other tokens than rank 0")
    return 1 if differ else 0


def _check_against_transformers(hf_model, request, result, eos, device, *, half: bool):
    """``"exact"``, ``"near-tie"`` (fp16/bf16 diverging where the reference's top two logits
    nearly tie), or the index of the first token that differs."""
    import torch

    prompt = request.prompt_tokens.unsqueeze(0).to(device)
    reference = hf_model.generate(
        prompt, max_new_tokens=request.sampling_params.num_tokens_to_generate,
        do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    reference = reference[0, prompt.shape[1]:].tolist()
    ours = result.generated_tokens
    if ours == reference:
        return "exact"
    diverge = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b),
                   min(len(ours), len(reference)))
    if half and diverge < min(len(ours), len(reference)):
        sequence = result.prompt_tokens + ours[:diverge]
        with torch.no_grad():
            logits = hf_model(torch.tensor([sequence], device=device)).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        if top[0] - top[1] <= HALF_TIE_ATOL + HALF_TIE_RTOL * top[0].abs():
            return "near-tie"
    return diverge


def _kernel_backend_name(ctx) -> str:
    from dynctx.kernels import _backend

    return _backend.resolve_backend(ctx.kernel_backend, ctx.device)


if __name__ == "__main__":
    sys.exit(main())
