"""Engine throughput against transformers' batched ``generate``, same prompts, same run.

The workload (defaults): a random Llama (vocab 32000, hidden 256, 4 layers, 8 query / 2 KV
heads, intermediate 512), 64 prompts of 16-128 tokens (uniform, seeded), 64 new tokens each,
greedy, EOS ignored. transformers runs the prompts as one left-padded batch through
``generate``; our ``Engine`` takes them all at once (in-flight batching, chunked prefill).
Generated tokens per second counts ``requests * new_tokens`` over the wall time of the whole
generation (prefill included) on each side. Outputs are compared token for token.

One torch thread by default (``--threads``), so the number does not depend on how many cores
happen to be free. The sides alternate ``--repeats`` times (default 2) and each rate is taken
from its fastest run: on a shared machine other work only ever adds time. The model runs in
fp32 on a CPU unless ``--device``/``--dtype`` say otherwise.

Usage::

    python bench/engine_throughput.py                         # the full comparison
    python bench/engine_throughput.py --requests 8 --new-tokens 8   # a quick run
    python bench/engine_throughput.py --attention-backend torch --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_llama(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int, max_positions: int, dtype: torch.dtype, device: str,
                 seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    # Ids from 3 on: 0-2 are pad/BOS/EOS in the default Llama config.
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_transformers(hf, prompts: list, new_tokens: int, device: str) -> tuple[list, float]:
    """Batched greedy ``generate`` over left-padded prompts: ``(outputs, seconds)``."""
    pad = 0
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, longest - len(prompt):] = torch.tensor(prompt)
        mask[i, longest - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                          eos_token_id=None)
    sync(device)
    seconds = time.perf_counter() - start
    return out[:, longest:].tolist(), seconds


def build_engine(hf, prompts: list, new_tokens: int, attention_backend: str, block_size: int,
                 max_tokens: Optional[int]):
    from dynctx.engine import Engine

    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    itemsize = next(hf.parameters()).element_size()
    block_bytes = (itemsize * 2 * config.num_hidden_layers * block_size
                   * config.num_key_value_heads * head_dim)
    # Room for every request's whole sequence at once, twice over (the context keeps part of
    # the buffer for paused requests), so all requests run together as in transformers' batch.
    blocks = 2 * sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) + 16
    sizes = {} if max_tokens is None else {"max_tokens": max_tokens}
    return Engine.from_transformers(
        hf, attention_backend=attention_backend, block_size_tokens=block_size,
        buffer_size_gb=blocks * block_bytes / 1024 ** 3,
        max_requests=-(-len(prompts) // 4) * 4 + 4, **sizes)


def run_engine(engine, prompts: list, new_tokens: int, device: str) -> tuple[list, float]:
    sync(device)
    start = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    sync(device)
    return out, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="the engine's token budget per step (default: the context's, "
                             "16384: every prompt of the default workload in one step)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed warm-up runs of each side on 4 prompts")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of each side, alternating; the fastest counts")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--requests, --new-tokens and --repeats must be >= 1")
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error(f"need 1 <= --min-prompt ({args.min_prompt}) <= --max-prompt "
                     f"({args.max_prompt})")

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hf = random_llama(vocab=32000, hidden=256, layers=4, heads=8, kv_heads=2, intermediate=512,
                      max_positions=max(512, args.max_prompt + args.new_tokens), dtype=dtype,
                      device=args.device)
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt,
                           hf.config.vocab_size)
    engine = build_engine(hf, prompts, args.new_tokens, args.attention_backend,
                          args.block_size, args.max_tokens)
    for _ in range(args.warmup):
        run_transformers(hf, prompts[:4], 4, args.device)
        run_engine(engine, prompts[:4], 4, args.device)

    # The two sides alternate; each rate comes from its fastest repeat (on a shared machine other
    # work only ever adds time).
    their_times, our_times = [], []
    for _ in range(args.repeats):
        theirs, seconds = run_transformers(hf, prompts, args.new_tokens, args.device)
        their_times.append(seconds)
        steps_before = engine.step_count
        ours, seconds = run_engine(engine, prompts, args.new_tokens, args.device)
        our_times.append(seconds)
        steps = engine.step_count - steps_before
    their_seconds, our_seconds = min(their_times), min(our_times)
    tokens = args.requests * args.new_tokens
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    result = {
        "requests": args.requests, "new_tokens": args.new_tokens,
        "prompt_lengths": [args.min_prompt, args.max_prompt],
        "prompt_tokens": sum(len(p) for p in prompts),
        "threads": args.threads, "device": args.device, "dtype": args.dtype,
        "attention_backend": engine.model.attention_backend,
        "engine_tok_s": tokens / our_seconds, "transformers_tok_s": tokens / their_seconds,
        "ratio": their_seconds / our_seconds,
        "engine_s": our_seconds, "transformers_s": their_seconds, "repeats": args.repeats,
        "engine_times_s": our_times, "transformers_times_s": their_times,
        "identical": not mismatched, "mismatched_requests": mismatched,
        "engine_steps": steps,
        "torch": torch.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "git": git_sha(),
    }
    print(f"workload: {args.requests} prompts of {args.min_prompt}-{args.max_prompt} tokens "
          f"({result['prompt_tokens']} in all), {args.new_tokens} new tokens each, greedy, "
          f"{args.dtype} on {args.device}, {args.threads} torch thread(s)")
    def runs(times):
        return ", ".join(f"{t:.2f}" for t in times)

    print(f"transformers generate : {result['transformers_tok_s']:9.1f} tok/s "
          f"(best of {runs(their_times)} s)")
    print(f"dynctx engine ({result['attention_backend']:>5}): {result['engine_tok_s']:9.1f} tok/s "
          f"(best of {runs(our_times)} s; {steps} steps)")
    print(f"ratio engine / transformers: {result['ratio']:.2f}x")
    print(f"outputs identical: {result['identical']}"
          + ("" if not mismatched else f" (requests differing: {mismatched})"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["identical"] else 1)
