"""FP8 KV cache: the accuracy it costs and the capacity it buys, on a CPU (one torch thread).

Accuracy, teacher-forced (a random model is chaotic: one flipped greedy token changes everything
after it, so generations are not compared). The same long random sequences (default 2 of 2,048
tokens) are scored by a random Llama (default: 4 layers, hidden 256, 8 query / 2 KV heads of
32, vocab 2,048, fp32, one prefill per sequence) through the engine's model adapter and context,
once with the params-dtype cache and once per FP8 setting. Per position: the relative logit
error ``||l_fp8 - l_ref|| / ||l_ref||``, whether the argmax agrees, and the agreement where the
reference's top-2 margin exceeds 5 % of its logits' spread (max - min); plus the largest change
of the prompt log probs the engine returns (``return_log_probs``) over the same sequences.
Settings: e4m3 with dynamic per-layer scales (the default), e4m3 per KV head, e5m2 per layer;
and, as the yardstick, an emulation outside dynctx: transformers' own forward of the same model
with every layer's rotated K and V quantized to e4m3 and back in fp32 (per-tensor scale ``2 x
amax / 448`` of that sequence) before SDPA, against transformers' plain forward: what per-tensor
e4m3 costs by itself, so that the rows above show what dynctx adds to it (nothing, if equal).

Capacity: a memory-bound workload (default 64 requests of 192-token prompts + 64 new tokens,
all arriving at once, a token budget of 16 prompts a step so that admission never binds)
through the engine at the same ``buffer_size_gb`` (about 10 whole requests' blocks in bf16)
with a bf16 cache and an e4m3 one (bf16 Llama, torch attention); reports the KV blocks, the
steps the workload takes, the mean and the peak number of requests in a step (rows past their
prompt or chunking it), and the ratio of the means (goal 2.0x). The peak overstates bf16's
concurrency: requests admitted with part of their prompt hold few blocks until they pause.

Usage::

    OMP_NUM_THREADS=1 python bench/fp8_kv.py                 # the table (a few minutes)
    python bench/fp8_kv.py --seq 256 --sequences 1 --requests 8 --layers 2   # a quick run
    python bench/fp8_kv.py --json bench/results/fp8_kv_cpu.json              # the committed one

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
SETTINGS = {"bf16 reference": None,
            "e4m3, per layer (dynamic)": dict(kv_cache_dtype="fp8", kv_scales="dynamic"),
            "e4m3, per KV head (dynamic)": dict(kv_cache_dtype="fp8",
                                               kv_scales="dynamic_per_head"),
            "e5m2, per layer (dynamic)": dict(kv_cache_dtype=torch.float8_e5m2)}


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_llama(args, dtype: torch.dtype, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).eval().to(dtype)


def build_engine(hf, buffer_size_gb: float, max_tokens: int, **kwargs):
    import warnings

    from dynctx.engine import Engine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small buffers warn about long requests by design
        return Engine.from_transformers(hf, block_size_tokens=16, buffer_size_gb=buffer_size_gb,
                                        max_tokens=max_tokens, attention_backend="torch",
                                        kernel_backend="torch", **kwargs)


def sequence_logits(engine, tokens: list) -> torch.Tensor:
    """fp32 ``[len, vocab]`` logits of every position of ``tokens``, one prefill through the
    engine's model adapter and context (the forward a prompt-log-prob step runs)."""
    from dynctx.context import DynamicInferenceRequest, SamplingParams

    ctx = engine.context
    ctx.reset()
    ctx.add_request(DynamicInferenceRequest(
        request_id=0, prompt_tokens=torch.tensor(tokens),
        sampling_params=SamplingParams(num_tokens_to_generate=1)))
    ctx.initialize_attention_state()
    with torch.no_grad():
        logits = engine.model.forward(ctx, last_token_only=False)
    ctx.reset()
    return logits.reshape(-1, logits.shape[-1])[:len(tokens)].float()


def prompt_log_probs(engine, sequences: list) -> list:
    from dynctx.context import DynamicInferenceRequest, SamplingParams

    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=list(seq),
        sampling_params=SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=1,
                                       return_log_probs=True))
        for i, seq in enumerate(sequences)]
    results = sorted(engine.generate_requests(requests), key=lambda r: r.request_id)
    return [torch.tensor(r.prompt_log_probs) for r in results]


def accuracy(args) -> list:
    length = args.seq
    hf = random_llama(args, torch.float32, length + 8)
    gen = torch.Generator().manual_seed(args.seed + 1)
    sequences = [torch.randint(0, args.vocab, (length,), generator=gen).tolist()
                 for _ in range(args.sequences)]
    gib = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 4 \
        * (length + 64) * args.sequences / 1024 ** 3
    rows, reference, reference_lp = [], None, None
    for name, options in SETTINGS.items():
        start = time.perf_counter()
        engine = build_engine(hf, 2 * gib, max_tokens=length + 16, **(options or {}))
        logits = [sequence_logits(engine, seq) for seq in sequences]
        log_probs = prompt_log_probs(engine, sequences)
        seconds = time.perf_counter() - start
        if options is None:
            reference, reference_lp = logits, log_probs
            continue
        rows.append(compare(
            name, logits, reference,
            kv_dtype=str(engine.context.kv_cache_dtype).removeprefix("torch."),
            kv_scales=options.get("kv_scales", "dynamic"),
            max_prompt_log_prob_change=max(float((a - b).abs().max())
                                           for a, b in zip(log_probs, reference_lp)),
            seconds=round(seconds, 2)))
    rows.append(compare("emulated e4m3 (transformers)", emulated_logits(hf, sequences, True),
                        emulated_logits(hf, sequences, False), kv_dtype="float8_e4m3fn",
                        kv_scales="per sequence", max_prompt_log_prob_change=float("nan")))
    return rows


def emulated_logits(hf, sequences: list, quantize: bool) -> list:
    """transformers' forward of each sequence, K/V quantized to e4m3 and back when ``quantize``
    (an attention function registered for the call, put back after)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dynctx.kernels.fp8 import dequantize_ref, quantize_ref

    def fake_fp8(x):
        scale = (x.abs().amax().float() * 2 / 448.0).clamp_min(1e-30)
        return dequantize_ref(quantize_ref(x, scale, torch.float8_e4m3fn), scale).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, fake_fp8(key), fake_fp8(value),
                                      attention_mask, **kwargs)

    AttentionInterface.register("fp8_kv_emulation", attention)
    previous = hf.config._attn_implementation
    hf.config._attn_implementation = "fp8_kv_emulation" if quantize else "sdpa"
    try:
        with torch.no_grad():
            return [hf(torch.tensor([seq])).logits[0].float() for seq in sequences]
    finally:
        hf.config._attn_implementation = previous


def compare(name: str, logits: list, reference: list, **extra) -> dict:
    """The per-position figures of ``logits`` against ``reference`` (lists of ``[len, V]``)."""
    errors, agree, confident_agree, confident, positions = [], 0, 0, 0, 0
    for got, want in zip(logits, reference):
        errors.append((got - want).norm(dim=-1) / want.norm(dim=-1))
        same = got.argmax(-1) == want.argmax(-1)
        top2 = want.topk(2, dim=-1).values
        spread = want.max(-1).values - want.min(-1).values
        margin = (top2[:, 0] - top2[:, 1]) > 0.05 * spread
        agree += int(same.sum())
        confident += int(margin.sum())
        confident_agree += int((same & margin).sum())
        positions += got.shape[0]
    error = torch.cat(errors)
    return dict(setting=name, positions=positions, rel_logit_error_mean=float(error.mean()),
                rel_logit_error_p99=float(error.quantile(0.99)),
                argmax_agreement=agree / positions, confident_positions=confident,
                confident_agreement=confident_agree / max(1, confident), **extra)


def peak_concurrency(engine, args) -> dict:
    from dynctx.context import DynamicInferenceRequest, SamplingParams

    gen = torch.Generator().manual_seed(args.seed + 2)
    peak = []
    engine.step_callback = lambda result: peak.append(result.active_requests)
    requests = [DynamicInferenceRequest(
        request_id=i, prompt_tokens=torch.randint(0, args.vocab, (args.prompt,),
                                                  generator=gen).tolist(),
        sampling_params=SamplingParams(temperature=1.0, top_k=1,
                                       num_tokens_to_generate=args.new_tokens))
        for i in range(args.requests)]
    start = time.perf_counter()
    results = engine.generate_requests(requests)
    alloc = engine.context.block_allocator
    return dict(kv_dtype=str(engine.context.kv_cache_dtype).removeprefix("torch."),
                kv_blocks=alloc.total_count - 1, active_budget=alloc.active_count,
                peak_running_requests=max(peak), steps=len(peak),
                mean_running_requests=sum(peak) / len(peak),
                finished=len(results), seconds=round(time.perf_counter() - start, 2))


def capacity(args) -> dict:
    max_seq = args.prompt + args.new_tokens
    hf = random_llama(args, torch.bfloat16, max_seq + 8)
    head_dim = args.hidden // args.heads
    # A budget of about 10 requests' blocks in bf16 (2 bytes, K and V, every layer).
    blocks_per_request = -(-max_seq // 16)
    bf16_block = 2 * 2 * args.layers * 16 * args.kv_heads * head_dim
    gib = (2 * 10 * blocks_per_request + 1) * bf16_block / 1024 ** 3
    runs = [peak_concurrency(build_engine(hf, gib, max_tokens=args.prompt * 16,
                                          max_sequence_length=max_seq, **options), args)
            for options in ({}, dict(kv_cache_dtype="fp8"))]
    return dict(buffer_size_gb=gib, prompt=args.prompt, new_tokens=args.new_tokens,
                requests=args.requests, runs=runs,
                ratio=runs[1]["mean_running_requests"] / runs[0]["mean_running_requests"],
                steps_ratio=runs[0]["steps"] / runs[1]["steps"])


def print_table(rows: list, cap: dict | None) -> None:
    if rows:
        print(f"{'setting':30} {'rel logit err':>14} {'p99':>7} {'argmax':>8} "
              f"{'argmax (margin>5%)':>19} {'max |dlogp|':>12}")
    for row in rows:
        print(f"{row['setting']:30} {100 * row['rel_logit_error_mean']:13.2f}% "
              f"{100 * row['rel_logit_error_p99']:6.2f}% {100 * row['argmax_agreement']:7.2f}% "
              f"{100 * row['confident_agreement']:18.2f}% "
              f"{row['max_prompt_log_prob_change']:12.4f}")
    if cap is None:
        return
    print(f"\ncapacity at buffer_size_gb={cap['buffer_size_gb']:.6f} ({cap['requests']} requests "
          f"of {cap['prompt']} + {cap['new_tokens']} tokens):")
    for run in cap["runs"]:
        print(f"  {run['kv_dtype']:14} {run['kv_blocks']:5d} KV blocks, active budget "
              f"{run['active_budget']:4d}: {run['steps']} steps, requests per step mean "
              f"{run['mean_running_requests']:.1f}, peak {run['peak_running_requests']}")
    print(f"  fp8 / bf16: {cap['ratio']:.2f}x the requests per step, {cap['steps_ratio']:.2f}x "
          "fewer steps")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048, help="tokens per scored sequence")
    parser.add_argument("--sequences", type=int, default=2, help="scored sequences")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=64, help="capacity workload requests")
    parser.add_argument("--prompt", type=int, default=192, help="capacity prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="capacity new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="accuracy,capacity",
                        help="what to measure: accuracy, capacity or both")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    rows = accuracy(args) if "accuracy" in parts else []
    cap = capacity(args) if "capacity" in parts else None
    print_table(rows, cap)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            accuracy=rows, capacity=cap, args=vars(args), git=git_sha(),
            torch=torch.__version__, python=platform.python_version(),
            machine=platform.machine()), indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
