"""Prefix caching on a shared-system-prompt workload: with and without caching, same run.

The workload (defaults): 64 requests, each a 1,024-token shared prefix (the "system prompt")
plus its own 32-token suffix, 8 new tokens each, greedy, arriving one per engine step, through
the reference ``Engine`` on a CPU (one torch thread) with KV blocks of 16 tokens and a buffer
large enough that nothing is evicted (so that the token counts compare exactly). It runs twice
per model, caching off and on ("lru"), and reports for each: the prompt tokens the model
computed, the prompt tokens served from the cache, the share of the shared prefix tokens that
were not computed (the target: >= 90 %), the wall time, and whether every request's generated
tokens are identical between the two runs.

Models: a tiny random Llama, and a tiny random NemotronH (Mamba2 + attention hybrid) whose hits
resume from Mamba state snapshots (``prefix_caching_mamba_gb``); on the hybrid the second
request recomputes the prefix once, its first chunk ending where the cached blocks end, so that
the state there is snapshotted for every later request (docs/SEMANTICS.md §17). With
``--models gemma3 mistral`` the windowed families (sliding windows of ``--window`` tokens,
much shorter than the shared prefix; Gemma 3 alternating sliding and full layers, Mistral
windowed on every layer) run on KV groups, whose hits read the windows' kept copies of the
prefix's last blocks (docs/SEMANTICS.md §22).

Usage::

    python bench/prefix_caching.py                       # both models; prints the table
    python bench/prefix_caching.py --requests 8 --models llama   # a quick run
    python bench/prefix_caching.py --json bench/results/prefix_caching_cpu.json  # the committed one

Results are written only where ``--json`` points.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


WINDOWED = ("gemma3", "mistral")


def tiny_model(kind: str, max_positions: int, window: int = 64):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind in WINDOWED:
        from dynctx.models.random_models import random_causal_lm

        return random_causal_lm(kind, max_positions=max_positions, window=window)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max_positions)
        return LlamaForCausalLM(config).eval()
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=512, hidden_size=64, hybrid_override_pattern="M*-M", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=4,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16,
        max_position_embeddings=max_positions)
    return NemotronHForCausalLM(config).eval()


def workload(args, vocab: int):
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, vocab, (args.prefix,), generator=generator).tolist()
    return [prefix + torch.randint(3, vocab, (args.suffix,), generator=generator).tolist()
            for _ in range(args.requests)]


def run_once(kind: str, hf, prompts, args, caching: bool) -> dict:
    from dynctx.context import DynamicInferenceRequest, SamplingParams
    from dynctx.engine import Engine

    length = args.prefix + args.suffix + args.new_tokens
    blocks = args.requests * (-(-length // args.block_size) + 1) + 8
    context = dict(block_size_tokens=args.block_size, max_tokens=args.max_tokens,
                   buffer_size_gb=2.0, paused_buffer_size_gb=0.05, max_requests=args.requests,
                   kernel_backend="torch", max_sequence_length=length + args.block_size)
    if caching:
        context.update(enable_prefix_caching=True, prefix_caching_eviction_policy="lru")
        if kind == "nemotron_h":
            context["prefix_caching_mamba_gb"] = 0.01
    engine = Engine.from_transformers(hf, attention_backend="torch", **context)
    assert engine.context.block_allocator.total_count > blocks, "raise buffer_size_gb"
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=prompt,
        sampling_params=SamplingParams(temperature=1.0, top_k=1,
                                       num_tokens_to_generate=args.new_tokens))
        for i, prompt in enumerate(prompts)]
    started = time.perf_counter()
    results = engine.generate_requests(requests, arrival_steps=list(range(len(requests))))
    wall = time.perf_counter() - started
    stats = engine.stats
    if stats.evictions:
        raise RuntimeError(f"{stats.evictions} evictions: the token counts would not compare")
    decode_tokens = sum(len(r.generated_tokens) - 1 for r in results)
    prompt_tokens = sum(len(p) for p in prompts)
    computed = stats.tokens_processed - decode_tokens
    cache = stats.prefix_cache
    skipped = cache.get("prefix_cache_prefill_skipped_tokens", 0)
    if computed + skipped != prompt_tokens:
        raise RuntimeError(f"prompt tokens {prompt_tokens} != computed {computed} + served "
                           f"from the cache {skipped}")
    shared = args.prefix * args.requests
    return {
        "prefix_caching": caching,
        "wall_s": round(wall, 3),
        "forward_steps": stats.forward_steps,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": computed,
        "prefill_tokens_from_cache": skipped,
        "shared_prefix_tokens": shared,
        "shared_prefix_tokens_skipped_pct": round(100 * skipped / shared, 2),
        "prefix_cache": {k: (round(v, 4) if isinstance(v, float) else v)
                         for k, v in cache.items()},
        "kv_groups": engine.context.kv_group_usage() is not None,
        "outputs": [r.generated_tokens for r in results],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=32, help="tokens of each request's own")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per step")
    parser.add_argument("--models", nargs="+", default=["llama", "nemotron_h"],
                        choices=["llama", "nemotron_h", *WINDOWED])
    parser.add_argument("--window", type=int, default=64,
                        help="the windowed families' sliding window")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"workload": {k: getattr(args, k) for k in ("requests", "prefix", "suffix",
                                                    "new_tokens", "block_size", "max_tokens",
                                                    "window")},
           "arrivals": "one request per engine step", "device": "cpu",
           "threads": args.threads, "torch": torch.__version__,
           "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "git": git_sha(),
           "command": " ".join(["python bench/prefix_caching.py", *(argv or sys.argv[1:])]),
           "models": {}}
    ok = True
    print(f"{'model':<11} {'caching':<8} {'computed':>9} {'cached':>8} {'shared skipped':>15} "
          f"{'wall s':>8}  outputs")
    for kind in args.models:
        hf = tiny_model(kind, args.prefix + args.suffix + args.new_tokens + 2 * args.block_size,
                        args.window)
        prompts = workload(args, hf.config.vocab_size)
        runs = [run_once(kind, hf, prompts, args, caching) for caching in (False, True)]
        same = runs[0]["outputs"] == runs[1]["outputs"]
        ok &= same and runs[1]["shared_prefix_tokens_skipped_pct"] >= 90.0
        for run in runs:
            print(f"{kind:<11} {('on' if run['prefix_caching'] else 'off'):<8} "
                  f"{run['prefill_tokens_computed']:>9} {run['prefill_tokens_from_cache']:>8} "
                  f"{run['shared_prefix_tokens_skipped_pct']:>14.1f}% {run['wall_s']:>8.2f}  "
                  f"{'identical' if same else 'DIFFER'}")
        for run in runs:
            del run["outputs"]
        out["models"][kind] = {"off": runs[0], "on": runs[1], "outputs_identical": same,
                               "speedup": round(runs[0]["wall_s"] / runs[1]["wall_s"], 2)}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
