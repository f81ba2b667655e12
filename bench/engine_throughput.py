"""Engine throughput against transformers' batched ``generate``, same prompts, same run.

The workload (defaults): a random Llama (vocab 32000, hidden 256, 4 layers, 8 query / 2 KV
heads, intermediate 512), 64 prompts of 16-128 tokens (uniform, seeded), 64 new tokens each,
greedy, EOS ignored. transformers runs the prompts as one left-padded batch through
``generate``; our ``Engine`` takes them all at once (in-flight batching, chunked prefill).
``--model`` picks another family of the same sizes (``qwen3``, ``mistral``: the generic
transformers path); ``--integrations auto,generic`` runs the engine once per integration in
the same run (a Llama: its dedicated adapter, then the generic path), and
``--generate-batch`` adds transformers' own continuous batching (``generate_batch``).
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
    python bench/engine_throughput.py --integrations auto,generic   # dedicated vs generic
    python bench/engine_throughput.py --model qwen3 --generate-batch
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


MODELS = ("llama", "qwen3", "mistral")


def random_model(name: str, *, vocab: int, hidden: int, layers: int, heads: int,
                 kv_heads: int, intermediate: int, max_positions: int, dtype: torch.dtype,
                 device: str, seed: int = 0):
    """A random ``<name>ForCausalLM`` of the given sizes (Mistral without a window)."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    prefix = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral"}[name]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    extra = {"sliding_window": None} if name == "mistral" else {}
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                        head_dim=hidden // heads, **extra)
    return model_cls(config).eval().to(device=device, dtype=dtype)


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


def kv_blocks(prompts: list, new_tokens: int, block_size: int) -> int:
    """Room for every request's whole sequence at once, twice over (the context keeps part of
    the buffer for paused requests), so all requests run together as in transformers' batch."""
    return 2 * sum(-(-(len(p) + new_tokens) // block_size) for p in prompts) + 16


def run_generate_batch(hf, prompts: list, new_tokens: int, device: str, block_size: int,
                       max_tokens: Optional[int]) -> tuple[list, float]:
    """transformers' continuous batching (``generate_batch``), greedy, EOS ignored, its paged
    cache sized as ours (block size, blocks, tokens a step; no CUDA-graph warm-up):
    ``(outputs, seconds)``."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=block_size,
                                        num_blocks=kv_blocks(prompts, new_tokens, block_size),
                                        max_batch_tokens=max_tokens or 16384)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate_batch(prompts, generation_config=config,
                                continuous_batching_config=batching, warmup=False)
    sync(device)
    seconds = time.perf_counter() - start
    return [result.generated_tokens for result in out.values()], seconds


def build_engine(hf, prompts: list, new_tokens: int, attention_backend: str, block_size: int,
                 max_tokens: Optional[int], integration: str = "auto"):
    from dynctx.engine import Engine

    config = hf.config
    head_dim = config.hidden_size // config.num_attention_heads
    itemsize = next(hf.parameters()).element_size()
    block_bytes = (itemsize * 2 * config.num_hidden_layers * block_size
                   * config.num_key_value_heads * head_dim)
    blocks = kv_blocks(prompts, new_tokens, block_size)
    sizes = {} if max_tokens is None else {"max_tokens": max_tokens}
    return Engine.from_transformers(
        hf, attention_backend=attention_backend, block_size_tokens=block_size,
        buffer_size_gb=blocks * block_bytes / 1024 ** 3,
        max_requests=-(-len(prompts) // 4) * 4 + 4, integration=integration, **sizes)


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
    parser.add_argument("--model", default="llama", choices=MODELS,
                        help="the family of the random model (same sizes)")
    parser.add_argument("--integrations", default="auto",
                        help="comma-separated Engine.from_transformers integrations to time "
                             "in the same run: auto (a dedicated adapter where the model has "
                             "one) and/or generic")
    parser.add_argument("--generate-batch", action="store_true",
                        help="also time transformers' continuous batching (generate_batch)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--requests, --new-tokens and --repeats must be >= 1")
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error(f"need 1 <= --min-prompt ({args.min_prompt}) <= --max-prompt "
                     f"({args.max_prompt})")

    integrations = args.integrations.split(",")
    if not integrations or any(i not in ("auto", "generic") for i in integrations):
        parser.error(f"--integrations {args.integrations!r}: auto and/or generic")

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hf = random_model(args.model, vocab=32000, hidden=256, layers=4, heads=8, kv_heads=2,
                      intermediate=512,
                      max_positions=max(512, args.max_prompt + args.new_tokens), dtype=dtype,
                      device=args.device)
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt,
                           hf.config.vocab_size)
    engines = {name: build_engine(hf, prompts, args.new_tokens, args.attention_backend,
                                  args.block_size, args.max_tokens, name)
               for name in integrations}
    sides = {"transformers generate": lambda n, p: run_transformers(hf, p, n, args.device)}
    if args.generate_batch:
        sides["transformers generate_batch"] = lambda n, p: run_generate_batch(
            hf, p, n, args.device, args.block_size, args.max_tokens)
    for name, engine in engines.items():
        sides[f"dynctx engine ({engine.model.path}, "
              f"{engine.model.attention_backend_request})"] = (
            lambda n, p, engine=engine: run_engine(engine, p, n, args.device))
    for _ in range(args.warmup):
        for run in sides.values():
            run(4, prompts[:4])

    # The sides alternate; each rate comes from its fastest repeat (on a shared machine other
    # work only ever adds time).
    times = {side: [] for side in sides}
    outputs = {}
    steps = {}
    for _ in range(args.repeats):
        for side, run in sides.items():
            engine = next((e for e in engines.values()
                           if side.startswith("dynctx") and e.model.path in side), None)
            before = engine.step_count if engine is not None else 0
            outputs[side], seconds = run(args.new_tokens, prompts)
            times[side].append(seconds)
            if engine is not None:
                steps[side] = engine.step_count - before
    tokens = args.requests * args.new_tokens
    reference = outputs["transformers generate"]
    rows = {side: {"tok_s": tokens / min(t), "best_s": min(t), "times_s": t,
                   "mismatched_requests": [i for i, (a, b) in enumerate(zip(outputs[side],
                                                                          reference)) if a != b]}
            for side, t in times.items()}
    engine_sides = [side for side in sides if side.startswith("dynctx")]
    first = rows[engine_sides[0]]
    identical = all(not row["mismatched_requests"] for row in rows.values())
    result = {
        "model": args.model, "requests": args.requests, "new_tokens": args.new_tokens,
        "prompt_lengths": [args.min_prompt, args.max_prompt],
        "prompt_tokens": sum(len(p) for p in prompts),
        "threads": args.threads, "device": args.device, "dtype": args.dtype,
        "attention_backend": engines[integrations[0]].model.attention_backend,
        "engine_tok_s": first["tok_s"],
        "transformers_tok_s": rows["transformers generate"]["tok_s"],
        "ratio": first["tok_s"] / rows["transformers generate"]["tok_s"],
        "engine_s": first["best_s"], "transformers_s": rows["transformers generate"]["best_s"],
        "repeats": args.repeats, "sides": rows, "engine_steps": steps,
        "identical": identical,
        "torch": torch.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "git": git_sha(),
    }
    if len(engine_sides) == 2:
        result["second_over_first_engine"] = rows[engine_sides[1]]["tok_s"] / first["tok_s"]
    print(f"workload: {args.model}, {args.requests} prompts of {args.min_prompt}-"
          f"{args.max_prompt} tokens ({result['prompt_tokens']} in all), {args.new_tokens} new "
          f"tokens each, greedy, {args.dtype} on {args.device}, {args.threads} torch thread(s)")
    for side, row in rows.items():
        runs = ", ".join(f"{t:.2f}" for t in row["times_s"])
        same = "identical" if not row["mismatched_requests"] else \
            f"requests differing: {row['mismatched_requests']}"
        extra = f"; {steps[side]} steps" if side in steps else ""
        print(f"{side:>44}: {row['tok_s']:9.1f} tok/s (best of {runs} s{extra}; {same})")
    print(f"ratio engine / transformers generate: {result['ratio']:.2f}x")
    if "second_over_first_engine" in result:
        print(f"{engine_sides[1]} / {engine_sides[0]}: "
              f"{result['second_over_first_engine']:.3f}")
    print(f"outputs identical: {identical}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["identical"] else 1)
