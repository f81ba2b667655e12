"""``python -m dynctx demo``: in-flight batching of a small random Llama through the context.

Builds a ``transformers`` ``LlamaForCausalLM`` with random weights (nothing downloads), sends a
stream of requests with staggered arrivals and mixed lengths through the reference engine with
a KV buffer small enough that requests pause, resume, get evicted and get chunked, prints a
summary, checks every output against ``transformers``' greedy ``generate`` for that prompt
alone, and writes a plot of active requests, paused requests and KV utilization per step.
Exit code 1 when an output does not match.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# bf16/fp16 runs may diverge from transformers at a near-tie: accepted when the top two
# reference logits lie within this much (absolute, plus relative to the top logit).
HALF_TIE_ATOL, HALF_TIE_RTOL = 2e-2, 2e-2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dynctx demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model (random weights)")
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--hidden", type=int, default=64)
    model.add_argument("--heads", type=int, default=4, help="query heads")
    model.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    model.add_argument("--intermediate", type=int, default=128)
    model.add_argument("--vocab", type=int, default=512)
    model.add_argument("--max-seq", type=int, default=256, help="max_position_embeddings")
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=int, default=24)
    work.add_argument("--max-new-tokens", type=int, default=32,
                      help="longest generation; requests ask for 1/4 to all of it")
    work.add_argument("--arrival-every", type=float, default=1.5,
                      help="mean engine steps between arrivals")
    ctx = parser.add_argument_group("context")
    ctx.add_argument("--block-size", type=int, default=16)
    ctx.add_argument("--buffer-blocks", type=int, default=14,
                     help="KV buffer in blocks (sets buffer_size_gb from the model dims)")
    ctx.add_argument("--paused-blocks", type=int, default=3, help="paused budget in blocks")
    ctx.add_argument("--buffer-size-gb", type=float, default=None,
                     help="overrides --buffer-blocks")
    ctx.add_argument("--paused-buffer-size-gb", type=float, default=None,
                     help="overrides --paused-blocks")
    ctx.add_argument("--max-tokens", type=int, default=32, help="tokens per step (chunking)")
    ctx.add_argument("--max-requests", type=int, default=None)
    ctx.add_argument("--kernel-backend", choices=["auto", "triton", "torch"], default=None)
    ctx.add_argument("--attention-backend", default="auto",
                     choices=["auto", "torch", "flashinfer", "flash_attn"])
    ctx.add_argument("--rope", choices=["table", "cos_sin"], default="table")
    ctx.add_argument("--fused-rope-kv-append", action="store_true")
    run = parser.add_argument_group("run")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    run.add_argument("--device", default="cpu")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--threads", type=int, default=1,
                     help="torch CPU threads (1 is fastest for a small model)")
    run.add_argument("--plot", default="demo.png", help="PNG path ('' to skip)")
    run.add_argument("--no-progress", action="store_true")
    return parser


def make_workload(args, vocab: int) -> tuple[List[List[int]], List[int], List[int]]:
    """Prompts (1 token to 3 blocks), generation lengths and arrival steps, from the seed."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    longest = min(3 * args.block_size, args.max_seq - args.max_new_tokens)
    lengths = [1, 2, longest] + rng.integers(1, longest + 1, size=args.requests).tolist()
    lengths = lengths[:args.requests]
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in lengths]
    low = max(1, args.max_new_tokens // 4)
    gens = rng.integers(low, args.max_new_tokens + 1, size=args.requests).tolist()
    gaps = rng.exponential(args.arrival_every, size=args.requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int).tolist()
    return prompts, gens, arrivals


def plot_history(history, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step for h in history]
    fig, axis = plt.subplots(figsize=(9, 4.5))
    axis.step(steps, [h.active_requests for h in history], where="post", label="active requests")
    axis.step(steps, [h.paused_requests for h in history], where="post", label="paused requests")
    evictions = [h.step for h in history if h.evicted_ids]
    if evictions:
        axis.scatter(evictions, [0] * len(evictions), marker="x", color="red", zorder=3,
                     label="evictions")
    axis.set_xlabel("engine step")
    axis.set_ylabel("requests")
    util = axis.twinx()
    util.plot(steps, [100 * h.kv_utilization for h in history], color="gray", alpha=0.7,
              label="KV utilization (%)")
    util.set_ylabel("KV blocks allocated (%)")
    util.set_ylim(0, 105)
    lines = axis.get_legend_handles_labels()
    more = util.get_legend_handles_labels()
    axis.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    axis.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from dynctx.context import DynamicInferenceRequest, SamplingParams
    from dynctx.engine import Engine

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.max_seq)
    hf_model = LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)

    head_dim = args.hidden // args.heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    block_bytes = itemsize * 2 * args.layers * args.block_size * args.kv_heads * head_dim
    buffer_gb = args.buffer_size_gb or args.buffer_blocks * block_bytes / 1024 ** 3
    paused_gb = (args.paused_buffer_size_gb if args.paused_buffer_size_gb is not None
                 else args.paused_blocks * block_bytes / 1024 ** 3)
    context_kwargs = dict(block_size_tokens=args.block_size, buffer_size_gb=buffer_gb,
                          paused_buffer_size_gb=paused_gb, max_tokens=args.max_tokens,
                          max_requests=args.max_requests, kernel_backend=args.kernel_backend,
                          fused_rope_kv_append=args.fused_rope_kv_append)
    engine = Engine.from_transformers(hf_model, rope=args.rope,
                                      attention_backend=args.attention_backend,
                                      seed=args.seed, record_logits=args.dtype != "fp32",
                                      **context_kwargs)
    ctx = engine.context
    prompts, gens, arrivals = make_workload(args, args.vocab)
    eos = engine.default_termination_id
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=prompt,
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=gen,
                                       termination_id=eos))
        for i, (prompt, gen) in enumerate(zip(prompts, gens))]
    print(f"dynctx demo: random Llama ({args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads / {args.kv_heads} KV heads, vocab {args.vocab}), {args.dtype} on "
          f"{device}; {args.requests} requests, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, arrivals over steps 0-{arrivals[-1]}")
    alloc = ctx.block_allocator
    print(f"context: {alloc.total_count - 1} KV blocks of {args.block_size} tokens "
          f"(active budget {alloc.active_count}, paused budget {alloc.paused_count}), "
          f"max_tokens {ctx.max_tokens}, max_requests {ctx.max_requests}")

    progress = None
    if not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:
            print("(no progress bar: tqdm is not installed; pip install 'dynctx[demo]')")
        else:
            progress = tqdm(total=sum(gens), unit="tok", desc="generating", leave=False,
                            file=sys.stderr)

    def on_step(result) -> None:
        if progress is not None:
            progress.update(len(result.new_tokens))
            progress.set_postfix(step=result.step, active=result.active_requests,
                                 paused=result.paused_requests, refresh=False)

    engine.step_callback = on_step
    started = time.perf_counter()
    results = engine.generate_requests(requests, arrival_steps=arrivals)
    elapsed = time.perf_counter() - started
    if progress is not None:
        progress.close()

    # Check every output against transformers' greedy generate for that prompt alone.
    exact = near_tie = 0
    mismatched = []
    for request, result in zip(requests, results):
        prompt = request.prompt_tokens.unsqueeze(0).to(device)
        reference = hf_model.generate(
            prompt, max_new_tokens=request.sampling_params.num_tokens_to_generate,
            do_sample=False, eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
        reference = reference[0, prompt.shape[1]:].tolist()
        ours = result.generated_tokens
        if ours == reference:
            exact += 1
            continue
        diverge = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b),
                       min(len(ours), len(reference)))
        if args.dtype != "fp32" and diverge < min(len(ours), len(reference)):
            sequence = result.prompt_tokens + ours[:diverge]
            with torch.no_grad():
                logits = hf_model(torch.tensor([sequence], device=device)).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            if top[0] - top[1] <= HALF_TIE_ATOL + HALF_TIE_RTOL * top[0].abs():
                near_tie += 1
                continue
        mismatched.append((result.request_id, diverge))

    stats = engine.stats
    generated = sum(len(r.generated_tokens) for r in results)
    finished = {reason: sum(r.finish_reason == reason for r in results)
                for reason in ("length", "stop", "error")}
    print(f"requests          {len(results)} ({finished['length']} length, {finished['stop']} "
          f"stop, {finished['error']} error)")
    print(f"tokens            {generated} generated, {stats.tokens_processed} processed "
          f"(prompts, recomputes and decodes)")
    print(f"steps             {stats.forward_steps} forward + {stats.idle_steps} idle")
    print(f"time              {elapsed:.2f} s: {generated / elapsed:.0f} generated tokens/s, "
          f"{stats.tokens_processed / elapsed:.0f} processed tokens/s")
    print(f"peak KV use       {100 * stats.peak_kv_utilization:.0f}% of "
          f"{alloc.total_count - 1} blocks; peak {stats.peak_active_requests} active, "
          f"{stats.peak_paused_requests} paused requests")
    print(f"pauses            {stats.pauses}")
    print(f"evictions         {stats.evictions}")
    print(f"chunked prefills  {stats.chunked_prefills} prompts in {stats.prefill_chunks} chunks")
    print(f"attention         {engine.model.attention_backend} paged attention; kernels: "
          f"{_kernel_backend_name(ctx)}")
    if args.plot:
        path = os.path.abspath(args.plot)
        try:
            plot_history(stats.history, path, f"dynctx demo: {len(results)} requests, "
                         f"{alloc.total_count - 1} KV blocks of {args.block_size}")
        except ImportError:
            print("plot              skipped: matplotlib is not installed "
                  "(pip install 'dynctx[demo]')")
        else:
            print(f"plot              {path}")
    checked = f"{exact}/{len(results)} outputs match transformers' greedy generate exactly"
    if near_tie:
        checked += f", {near_tie} diverge at a near-tie ({args.dtype}, accepted)"
    if mismatched:
        print(f"MISMATCH: {checked}; {len(mismatched)} differ (request, first differing "
              f"token): {mismatched}")
        return 1
    print(f"check             OK: {checked}")
    return 0


def _kernel_backend_name(ctx) -> str:
    from dynctx.kernels import _backend

    return _backend.resolve_backend(ctx.kernel_backend, ctx.device)


if __name__ == "__main__":
    sys.exit(main())
